"""Every config in conf/ composes, resolves and instantiates (composition only: no model is loaded).

Each file of every group is composed on top of conf/config.yaml, every experiment is composed (and
each point of its sweep), and the method / task nodes are built the way the runner builds them.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import get_class
from omegaconf import OmegaConf

from eval.conf import is_group, load_option, method_config, method_fields, missing_key
from eval.spec import RunSpec
from eval.tasks import TASKS
from eval.tasks.longbench.task import model_max_length
from snapkv import METHODS, Method, build_method
from snapkv.methods.base import DecodeSchedule
from snapkv_models.loading import DTYPES, RANDOM_SHAPES

CONF = Path(__file__).resolve().parents[1] / "conf"
MODEL_KEYS = {"key", "name", "tokenizer", "dtype", "device", "attn_implementation", "context", "max_prompt_tokens", "chat_template"}  # fmt: skip
# conf/model file -> SnapKV's model2maxlen name (LongBench max prompt length must match the paper's).
MODEL2MAXLEN_NAMES = {
    "mistral-7b-instruct-v0.2": "mistral-7B-instruct-v0.2",
    "longchat-7b-v1.5-32k": "longchat-v1.5-7b-32k",
    "mixtral-8x7b-instruct": "mixtral-8x7B-instruct-v0.1",
    "lwm-text-chat-1m": "lwm-text-chat-1m",
}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def compose_cfg(overrides: list[str] = (), hydra: bool = False):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra)


def resolved(cfg) -> dict:
    # Missing mandatory values (`???`, e.g. gemma3-270m's local path) stay unresolved, not errors.
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)


def check_buildable(cfg) -> None:
    method = build_method(**OmegaConf.to_container(cfg.method, resolve=True))
    assert method.name == cfg.method.name
    spec = RunSpec.from_config(cfg)  # the runner's own validation, before anything loads
    assert spec.task.name == cfg.task.name and (spec.shard, spec.num_shards) == (0, 1)
    assert spec.method.name == cfg.method.name


def test_groups_are_complete():
    assert set(options("method")) == set(METHODS)
    assert set(options("task")) == set(TASKS)
    assert {"smollm2-135m-instruct", "gemma3-270m", "mistral-7b-instruct-v0.2", "lwm-text-chat-1m",
            "longchat-7b-v1.5-32k", "mixtral-8x7b-instruct", "llama-3.1-8b-instruct", "qwen2.5-7b-instruct",
            "llama2-7b-random", "llama3-8b-random"} <= set(options("model"))  # fmt: skip
    assert {"debug", "needle_methods", "longbench_multinews", "sweep_window_budget"} <= set(
        options("experiment")
    )


def test_default_config():
    cfg = compose_cfg()
    assert OmegaConf.is_struct(cfg)
    assert (
        cfg.model.name == "smollm2-135m-instruct"
        and cfg.method.name == "snapkv"
        and cfg.task.name == "needle"
    )
    assert cfg.query_aware is True and cfg.prefill.chunk_size is None and cfg.task.num_shards == 1
    # The default run stays small enough for a few minutes on 2 CPU cores.
    assert len(cfg.task.lengths) * len(cfg.task.depths) <= 9 and max(cfg.task.lengths) <= 4000
    assert cfg.task.max_new_tokens >= 32  # SmolLM2's needle answer is 19 tokens
    check_buildable(cfg)


@pytest.mark.parametrize("name", options("model"))
def test_model_configs(name):
    cfg = compose_cfg([f"model={name}", "task=longbench"])
    model = resolved(cfg)["model"]
    assert set(model) == MODEL_KEYS
    assert model["dtype"] in DTYPES
    assert model["attn_implementation"] in ("sdpa", "eager", "flash_attention_2")
    assert model["device"] in ("cpu", "cuda", "auto") or model["device"].startswith("cuda:")
    assert 0 < model["max_prompt_tokens"] <= model["context"]
    # LongBench truncation follows the model (interpolated into the task).
    assert resolved(cfg)["task"]["max_prompt_tokens"] == model["max_prompt_tokens"]
    if name in MODEL2MAXLEN_NAMES:
        assert model["max_prompt_tokens"] == model_max_length(MODEL2MAXLEN_NAMES[name])
    if str(model["name"]).startswith("random:"):
        assert model["name"].split(":", 1)[1] in RANDOM_SHAPES
        assert model["tokenizer"], "random-weight models need a tokenizer for text tasks"
    if name == "gemma3-270m":
        assert OmegaConf.is_missing(cfg.model, "name")  # a local path the user supplies
        with pytest.raises(ValueError, match=r"model\.name is required"):  # said before anything loads
            RunSpec.from_config(cfg)
        cfg = compose_cfg([f"model={name}", "task=longbench", "model.name=/models/gemma-3-270m-q4_k_m.gguf"])
        assert RunSpec.from_config(cfg).model.key == "gemma-3-270m-q4_k_m"  # short folder name
    else:
        assert model["name"]
    check_buildable(cfg)


@pytest.mark.parametrize("name", options("method"))
def test_method_configs_hold_every_field_and_set_only_what_differs(name):
    cls = METHODS[name]
    cfg = compose_cfg([f"method={name}"])
    fields = method_fields(cls)
    # Every field is in the composed node (`method.<field>=...` needs no `+`), the decode schedule
    # as a node of DecodeSchedule's fields.
    assert list(cfg.method) == list(fields) and fields["name"] == name
    assert set(cfg.method.decode_schedule) == {f.name for f in dataclasses.fields(DecodeSchedule)}
    # The file sets only what differs from the dataclass.
    own = {k: v for k, v in OmegaConf.to_container(load_option("method", name)).items() if k != "defaults"}
    assert all(fields[k] != v for k, v in own.items()), own
    # eval.conf.method_config (compare, the speed benchmark) gives what Hydra composes.
    assert method_config(name) == cfg.method
    check_buildable(cfg)


@pytest.mark.parametrize("name", options("method"))
def test_every_method_field_takes_a_command_line_value(name):
    fields = method_fields(METHODS[name])
    schedule = fields.pop("decode_schedule")
    value = {None: "null", True: "true", False: "false"}
    overrides = [
        f"method.{k}={value.get(v, v) if not isinstance(v, list | dict) else v}" for k, v in fields.items()
    ]
    overrides += [f"method.decode_schedule.{k}={value.get(v, v)}" for k, v in schedule.items()]
    cfg = compose_cfg([f"method={name}", *overrides])  # no `+`: every field is there to override
    assert OmegaConf.to_container(cfg.method) == {**fields, "decode_schedule": schedule}


def test_method_fields_of_a_dataclass():
    @dataclasses.dataclass
    class Toy(Method):
        name = "toy"
        ratio: float = 20  # an int default of a float field stays the int: no hash changes
        layers: list[int] = dataclasses.field(default_factory=lambda: [0, 1])
        required: int = dataclasses.field(default=0, init=False)

    assert method_fields(Toy) == {
        "name": "toy", "budget": None, "protect": "none", "ratio": 20, "layers": [0, 1],
        "decode_schedule": {
            "interval": None, "buffer": 0, "target": None, "window": None, "count_from": "prefill"
        },
    }  # fmt: skip
    assert isinstance(method_fields(Toy)["ratio"], int)


@pytest.mark.parametrize("name", options("method"))
def test_method_parameters_from_the_command_line(name):
    overrides = {
        "snapkv": ["budget=512", "method.window=16", "method.kernel_size=5", "method.pooling=avg"],
        "h2o": ["method.budget=300", "method.recent=100", "method.evict_during_decode=false"],
        "streamingllm": ["budget=64", "method.n_sink=8", "method.positions=compacted"],
        "full": ["budget=512"],  # full ignores the top-level budget
        "pyramidkv": ["budget=256", "method.window=16", "method.beta=10"],
        "adakv": [
            "budget=256",
            "method.base=pyramidkv",
            "method.alpha=0.5",
            "method.layout=padded",
            "method.normalize=true",
            "method.scorer=tova",
        ],  # fmt: skip
        "criticalkv": [
            "budget=256",
            "method.base=adakv",
            "method.first_stage_ratio=0.25",
            "method.allocation=kvpress",
        ],
        "expected_attention": [
            "budget=256",
            "method.n_sink=8",
            "method.use_covariance=false",
            "method.n_future_positions=128",
        ],
        "adakv_expected_attention": [
            "budget=256",
            "method.alpha=0.5",
            "method.layout=padded",
            "method.allocation=adakv",
        ],
        "tova": ["budget=64", "method.evict_during_decode=false", "method.keep_last=true"],
        "knorm": [
            "budget=64",
            "method.prune_after=2048",
            "method.evict_during_decode=true",
            "method.keep_ratio=0.98",
        ],
        "snapkv_d": ["budget=256", "method.window=16", "method.decode_schedule.interval=32"],
        "rkv": [
            "budget=256",
            "method.mix_lambda=0.1",
            "method.threshold=0.6",
            "method.decode_schedule.buffer=16",
            "method.kept_order=topk",
            "method.decode_schedule.count_from=start",
        ],
        "chunkkv": [
            "budget=256",
            "method.chunk_length=20",
            "method.chunk_score=mean",
            "method.reuse_layers=2",
            "method.scorer=knorm",
        ],
        "kvzip": [
            "budget=256",
            "method.selection=global",
            "method.n_sink=4",
            "method.prompt=kvpress",
            "method.repeat_chunk=2048",
            "method.kvzip_plus=true",
        ],
    }[name]
    cfg = compose_cfg([f"method={name}", *overrides])
    method = build_method(**OmegaConf.to_container(cfg.method, resolve=True))
    expected = {o.split("=")[0].removeprefix("method."): o.split("=")[1] for o in overrides}
    for key, value in expected.items():
        if key.startswith("decode_schedule."):
            assert str(getattr(method.decode_schedule, key.removeprefix("decode_schedule."))) == value
        elif hasattr(method, key) and name != "full":
            assert str(getattr(method, key)).lower() == value.lower()
    if name == "full":
        assert method.budget is None


def test_struct_mode_rejects_typos():
    with pytest.raises(ConfigCompositionException, match="budgt"):
        compose_cfg(["method.budgt=5"])
    with pytest.raises(ConfigCompositionException, match="lenghts"):
        compose_cfg(["task.lenghts=[1]"])
    with pytest.raises(ConfigCompositionException):
        compose_cfg(["method=nope"])


# Overrides of keys the default config has, and of keys it lacks (run.py's exit-2 check).
KNOWN_KEYS = ["budget", "method.window", "method.decode_schedule.interval", "task.depths", "model.name",
              "hydra.run.dir", "hydra.job.chdir", "generation.top_p"]  # fmt: skip
UNKNOWN_KEYS = {
    "method.budgt": ("method", "budget"),
    "task.lenghts": ("task", "lengths"),
    "nope": ("", "budget"),
    "nope.sub": ("", "budget"),
    "method.decode_schedule.nope": ("method.decode_schedule", "interval"),
    "hydra.run.nope": ("hydra.run", "dir"),
    "hydra.job.env_set.X": ("hydra.job.env_set", None),
}


def test_missing_key_agrees_with_struct_mode():
    """`missing_key` on the default config refuses exactly the overrides Hydra's struct mode
    refuses, and names the node where the key leaves the config with that node's keys."""
    cfg = compose_cfg(hydra=True)
    for key in KNOWN_KEYS:
        assert missing_key(cfg, key) is None, key
        compose_cfg([f"{key}=1"], hydra=True)  # Hydra takes it too
    for key, (parent, one_of_its_keys) in UNKNOWN_KEYS.items():
        where, known = missing_key(cfg, key)
        node = OmegaConf.select(cfg, where) if where else cfg
        assert where == parent and known == sorted(node.keys()), key
        assert (known == []) if one_of_its_keys is None else (one_of_its_keys in known), key
        with pytest.raises(ConfigCompositionException, match=f"Could not override '{key}'"):
            compose_cfg([f"{key}=1"], hydra=True)
    assert missing_key(cfg, "compare.0") is None  # a list: left to Hydra
    assert [is_group(n) for n in ("method", "task", "model", "experiment", "hydra/launcher")] == [True] * 5
    assert not any(is_group(n) for n in ("budget", "method.window", "hydra.run.dir", "compare"))


@pytest.mark.parametrize("name", options("task"))
def test_task_configs(name):
    cfg = compose_cfg([f"task={name}"])
    check_buildable(cfg)
    cfg = compose_cfg([f"task={name}", "task.num_shards=4", "task.shard=3"])
    spec = RunSpec.from_config(cfg)
    assert (spec.shard, spec.num_shards) == (3, 4)


def sweep_points(params: dict) -> list[list[str]]:
    keys = list(params)
    values = [str(params[k]).split(",") for k in keys]
    return [[f"{k}={v}" for k, v in zip(keys, combo)] for combo in itertools.product(*values)]


def sweep_cover(params: dict) -> list[list[str]]:
    """Points of the sweep in which every value of every swept key shows at least once (the i-th
    point takes each key's i-th value, cycling): a handful of `sweep_points`."""
    keys = list(params)
    values = [str(params[k]).split(",") for k in keys]
    n = max((len(v) for v in values), default=0)
    return [[f"{k}={v[i % len(v)]}" for k, v in zip(keys, values)] for i in range(n)]


def sweep(name: str) -> dict:
    return compose_cfg([f"experiment={name}"], hydra=True).hydra.sweeper.params or {}


# Composing a sweep's point takes a Hydra composition (~0.1 s) and the catalogue experiments sweep
# dozens: the fast tier composes every value of every swept key (a typo or a refused value in the
# sweep fails there), the slow tier the rest of their cross product.
@pytest.mark.parametrize("name", options("experiment"))
def test_experiments(name):
    resolved(compose_cfg([f"experiment={name}"]))
    cfg = compose_cfg([f"experiment={name}"], hydra=True)
    check_buildable(cfg)
    for point in sweep_cover(cfg.hydra.sweeper.params or {}):
        check_buildable(compose_cfg([f"experiment={name}", *point]))


@pytest.mark.slow
@pytest.mark.parametrize("name", options("experiment"))
def test_every_job_of_an_experiments_sweep_is_valid(name):
    params = sweep(name)
    cover = sweep_cover(params)
    rest = [point for point in sweep_points(params) if point not in cover]  # the cover: test_experiments
    if not rest:
        pytest.skip(f"experiment={name} sweeps at most one key: test_experiments composes every job")
    for point in rest:
        check_buildable(compose_cfg([f"experiment={name}", *point]))


def test_debug_experiment_is_tiny():
    cfg = compose_cfg(["experiment=debug"])
    assert cfg.task.haystack == "noise" and len(cfg.task.lengths) == 1 and len(cfg.task.depths) == 1
    assert cfg.results_dir != compose_cfg().results_dir


@pytest.mark.parametrize("launcher", ["joblib", "submitit_local", "submitit_slurm", "slurm"])
def test_launchers(launcher):
    cfg = compose_cfg([f"hydra/launcher={launcher}"], hydra=True)
    target = cfg.hydra.launcher._target_
    assert target.startswith("hydra_plugins.")
    assert get_class(target).__name__.endswith("Launcher")  # importable
    if launcher == "slurm":
        assert target.endswith("SlurmLauncher")
        # conf/local/slurm.yaml (git-ignored; `make slurm-up` writes one) overrides slurm.yaml's values.
        local = CONF / "local" / "slurm.yaml"
        expected = OmegaConf.load(local) if local.is_file() else {}
        assert cfg.hydra.launcher.gpus_per_node == expected.get("gpus_per_node", 1)
        assert cfg.hydra.launcher.array_parallelism > 0
        # Requeued after a time limit (the plugin's default, 0, ends the job) and after node failures.
        assert cfg.hydra.launcher.max_num_timeout > 0 and cfg.hydra.launcher.additional_parameters.requeue


def test_local_launcher_settings_apply_to_the_slurm_launcher_only(tmp_path):
    """conf/local/slurm.yaml (what `make slurm-up` writes) sets hydra/launcher=slurm's fields; a run
    on any other launcher composes as without it (the basic launcher has no `partition`)."""
    import shutil

    conf = shutil.copytree(CONF, tmp_path / "conf", ignore=shutil.ignore_patterns("local", "__pycache__"))
    (conf / "local").mkdir()
    (conf / "local" / "slurm.yaml").write_text("gpus_per_node: null\ntimeout_min: 120\npartition: batch\n")
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        slurm = compose("config", overrides=["hydra/launcher=slurm"], return_hydra_config=True).hydra.launcher
        basic = compose("config", return_hydra_config=True).hydra.launcher
        on_cli = compose(
            "config",
            overrides=["hydra/launcher=slurm", "hydra.launcher.timeout_min=30"],
            return_hydra_config=True,
        )
    assert (slurm.gpus_per_node, slurm.timeout_min, slurm.partition, slurm.cpus_per_task) == (
        None,
        120,
        "batch",
        8,
    )
    assert "partition" not in basic
    assert on_cli.hydra.launcher.timeout_min == 30  # the command line still wins


def test_report_callback_is_configured():
    cfg = compose_cfg(hydra=True)
    assert cfg.hydra.callbacks.report._target_ == "eval.callbacks.ReportCallback"
    assert cfg.hydra.job.chdir is False
