"""Tiny random models (Llama / Qwen2 / Mistral with GQA / Gemma 3 hybrid) and tiny byte-level BPE
tokenizers, built in code: offline, milliseconds per forward; `save_tiny_llama` saves one with its
tokenizer as a model folder for a run. `SHARED` is ../shared beside the checkout (tests may read it)."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Idle OpenMP workers that sleep cost a scheduler tick per wake-up on these VMs (see
# scripts/bench_speed.py); must be set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

SHARED = Path(__file__).resolve().parents[1].parent / "shared"

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def tiny_config(arch: str, layers: int = 3):
    if arch == "llama":
        return LlamaConfig(num_hidden_layers=layers, **COMMON)
    if arch == "qwen2":
        return Qwen2Config(num_hidden_layers=layers, **COMMON)
    if arch == "mistral":  # sliding_window=None as in Mistral-7B-Instruct-v0.2: full attention
        return MistralConfig(num_hidden_layers=layers, sliding_window=None, **COMMON)
    if arch == "gemma3":  # hybrid: 5 sliding layers per full one; only the full layers compress
        return Gemma3TextConfig(num_hidden_layers=6, sliding_window=16, head_dim=16, **COMMON)
    raise ValueError(arch)


def tiny_model(arch: str = "llama", attn: str = "sdpa", layers: int = 3, seed: int = 0):
    torch.manual_seed(seed)
    config = tiny_config(arch, layers)
    config._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    return model.eval()


def save_tiny_llama(out: Path, tokenizer, max_positions: int = 2048) -> str:
    """A random 2-layer Llama (GQA 4/2) sized to `tokenizer` (its vocabulary, its EOS), saved with
    it in `out`: a model folder `model.name` can point at. Returns the folder as a string."""
    tokenizer.save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return str(out)


ARCHS = ["llama", "qwen2", "mistral", "gemma3"]


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param


def random_ids(n: int, batch: int = 1, seed: int = 1, vocab: int = 128) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, n), generator=g)


# ChatML (Qwen's and SmolLM2's turn format), with no system prompt of its own.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_bpe(
    corpus: list[str],
    vocab_size: int,
    special_tokens: list[str],
    *,
    bos: str | None = None,
    eos: str = "<|im_end|>",
    add_bos: bool = False,
    chat_template: str | None = None,
):
    """A tiny byte-level BPE tokenizer (GPT-2 style, like SmolLM2's) trained on `corpus`: offline,
    milliseconds. `bos` / `eos` name the special tokens transformers knows; `add_bos` prepends `bos`
    to every encoding (Llama-style); `chat_template` None leaves it without one (a base model's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    # No bos_token argument without a BOS: a saved tokenizer_config.json then has no "bos_token": null.
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos, **({} if bos is None else {"bos_token": bos})
    )
    if chat_template is not None:
        out.chat_template = chat_template
    return out


# ---- tests that run in a fresh interpreter ------------------------------------------------------
CHILD_ENV = "SNAPKV_TEST_IN_CHILD"


def in_child_process(test):
    """Run `test` in a fresh interpreter (`python -m pytest NODE`), the parent passing when the child
    passes. For tests that build an OpenVINO GenAI pipeline: once one is built under pytest's output
    capture, a later in-process Hydra run (run.py's CLI under `capsys`) fails with "I/O operation on
    closed file"; outside pytest the same sequence works. The parent still resolves the test's
    fixtures; the child builds its own."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        if os.environ.get(CHILD_ENV):
            return test(*args, **kwargs)
        node = f"{inspect.getfile(test)}::{test.__name__}"
        child = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "slow or not slow", node],
            env={**os.environ, CHILD_ENV: "1"},
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
        )
        if child.returncode == 0 and " skipped" in child.stdout and " passed" not in child.stdout:
            pytest.skip(child.stdout.strip().splitlines()[-1])
        assert child.returncode == 0, (
            f"{node} failed in its own interpreter:\n{child.stdout[-4000:]}{child.stderr[-2000:]}"
        )

    return wrapper


# ---- the two tiers -----------------------------------------------------------------------------
# tests/e2e/ (subprocess runs, real models, the notebook, figure rebuilds) is marked `slow` and left
# out of a plain `pytest`; `pytest -m slow` runs it alone, `pytest --e2e` runs both tiers, and naming
# a file or folder under tests/e2e/ runs what it names.
E2E = Path(__file__).resolve().parent / "e2e"


def pytest_addoption(parser):
    parser.addoption(
        "--e2e", action="store_true", help="also run the end-to-end tier (tests/e2e, marked slow)"
    )


def _in_e2e(path: Path) -> bool:
    return path.resolve() == E2E or E2E in path.resolve().parents


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _in_e2e(item.path):
            item.add_marker(pytest.mark.slow)
    named_e2e = any(_in_e2e(Path(str(a).split("::", 1)[0])) for a in config.args)
    if config.getoption("--e2e") or config.getoption("markexpr") or named_e2e:
        return
    fast = [i for i in items if i.get_closest_marker("slow") is None]
    if len(fast) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("slow") is not None])
        items[:] = fast


_ROOT_LEVEL = logging.getLogger().level


@pytest.fixture(autouse=True)
def _project_loggers_enabled():
    """An in-process Hydra run (logging.config.dictConfig) disables the loggers that existed before
    it and, with `hydra/job_logging=disabled`, sets the root logger to ERROR; every test starts with
    the project's loggers enabled and the root logger's level as it was, whatever ran before it."""
    logging.getLogger().setLevel(_ROOT_LEVEL)
    project = ("eval", "snapkv", "snapkv_models", "run")
    for name, logger in logging.root.manager.loggerDict.items():
        if name.split(".")[0] in project and isinstance(logger, logging.Logger):
            logger.disabled = False
    yield
