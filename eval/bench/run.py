"""Speed and memory benchmark in interleaved rounds: prefill (+compression), TTFT, TPOT and peak
memory per method, input length and batch size, configured from conf/bench.yaml.

    python scripts/bench_speed.py [key=value ...]      # a thin entry point for `main()`

A run is R rounds; each round runs every configuration once, in an order rotated by one per round,
so a burst of background load lands on different configurations in different rounds. Every ratio is
computed per round from configurations of that round, then summarised as median and IQR over the
rounds (`eval.bench.report`). Every configuration also records the CPU other processes used while it
ran (`eval.machine`), the load average and the thread settings; rounds above `noise_threshold`
are flagged and left out of the summary. On CPU every configuration runs in a fresh process (peak
RSS only resets per process); on CUDA in-process with the allocator peak reset per configuration.
Raw per-round rows go to the CSV `out`.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from eval.bench import measure
from eval.bench import report as bench_report
from eval.conf import CONF_DIR, load_option, method_config, options
from eval.machine import THREAD_ENV
from snapkv import METHODS, build_method
from snapkv.errors import first_line
from snapkv_models.embedded import EMBEDDED
from snapkv_models.loading import RANDOM_SHAPES

log = logging.getLogger(__name__)

COLUMNS = ["round", "order", "method", "budget", "batch_size", "input_tokens", "prefill_s", "ttft_s", "tpot_s",
           "prefill_cpu_s", "tpot_cpu_s", "prefill_ref", "tpot_ref", "ref_prefill_cpu_s", "ref_decode_cpu_s",
           "ref_prefill_tokens", "ref_decode_tokens", "peak_mem_bytes", "kv_bytes", "kv_bytes_full", "kv_tokens", "status",
           "error", "noisy", "wall_s", "own_cpu_s", "other_cpu_s", "other_cores", "prefill_other_cores",
           "decode_other_cores", "load_start", "load_end",
           "torch_threads", "cpu_count", *(k.lower() for k in THREAD_ENV),
           "model", "dtype", "device", "attn_impl", "method_params", "tpot_mean_cpu_s", "tpot_mean_ref",
           "kv_quant", "kv_index_bytes", "decode_peak_mem_bytes"]  # fmt: skip
CLOCKS = ("ref", "cpu", "wall")
# Top-level shortcuts for the model config's keys (`dtype=bfloat16` -> `model.dtype=bfloat16`).
MODEL_ALIASES = ("dtype", "device", "attn_implementation")


@dataclass(frozen=True)
class Config:
    """One benchmark configuration: a method (with all its parameters) at one input length and batch,
    on the plain cache or on the quantized storage `storage` names (`kv_quants`; `kv_quant` its
    fields). Its rows' `method` is its `label`: `snapkv`, or `snapkv+kivi4` on storage `kivi4`."""

    method: str
    params: tuple[tuple[str, Any], ...]
    input_tokens: int
    batch_size: int
    storage: str | None = None
    kv_quant: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        return self.method if self.storage is None else f"{self.method}+{self.storage}"

    @property
    def key(self) -> tuple[str, int, int]:
        return self.label, self.input_tokens, self.batch_size


def _model_options() -> list[str]:
    return options("model")


def _check_model_name(name: str) -> None:
    """A `model=` value that is not a conf/model name must be something load_model takes."""
    if name.startswith("random:"):
        if name.split(":", 1)[1] not in RANDOM_SHAPES:
            raise ValueError(
                f"unknown random model shape {name!r}; known: {', '.join(sorted(RANDOM_SHAPES))}"
            )
        return
    if name in EMBEDDED or Path(name).expanduser().exists():
        return
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        return  # a Hub id
    raise ValueError(
        f"unknown model {name!r}; known: {', '.join(_model_options())} (conf/model), random:<shape>, a path, a Hub id"
    )


def _method_node(name: str) -> dict[str, Any]:
    if name not in METHODS or name not in options("method"):
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(sorted(METHODS))}")
    return OmegaConf.to_container(method_config(name))


def split_overrides(argv: list[str]) -> tuple[list[str], dict[str, dict[str, str]], dict[str, str]]:
    """(Hydra overrides for conf/bench.yaml, per-method `{method: {param: value}}`, every-method
    `{param: value}`) from `key=value` arguments (see conf/bench.yaml)."""
    bench_keys = set(OmegaConf.load(CONF_DIR / "bench.yaml")) - {"defaults"}
    hydra_args: list[str] = []
    per_method: dict[str, dict[str, str]] = {}
    every: dict[str, str] = {}
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq:
            raise ValueError(f"expected key=value, got {arg!r}")
        head, _, rest = key.partition(".")
        if key == "model" and value not in _model_options():
            _check_model_name(value)
            hydra_args.append(f"model.name={value}")  # any name snapkv_models.loading.load_model takes
        elif key in MODEL_ALIASES:
            hydra_args.append(f"model.{key}={value}")
        elif head in METHODS and rest:
            per_method.setdefault(head, {})[rest] = value
        elif key in bench_keys or head == "model":
            hydra_args.append(arg)
        elif head == "kv_quants" and rest:
            hydra_args.append(f"++{arg}")  # a storage of one's own naming: kv_quants.kivi4={kind:kivi,bits:4}
        elif any(key in cls.__dataclass_fields__ for cls in METHODS.values()):
            every[key] = value
        else:
            known = sorted(bench_keys | set(MODEL_ALIASES))
            raise ValueError(f"unknown option {key!r}; known: {', '.join(known)}, <method>.<param>, <param>")
    return hydra_args, per_method, every


def compose(argv: list[str]) -> DictConfig:
    """conf/bench.yaml composed with conf/model/* and the command line; `cfg.method_params` holds each
    listed method's full parameters (conf/method/<name>.yaml + overrides), validated by building it."""
    hydra_args, per_method, every = split_overrides(argv)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name="bench", overrides=hydra_args)
    OmegaConf.set_struct(cfg, False)
    unknown = sorted(set(per_method) - set(cfg.methods))
    if unknown:
        raise ValueError(
            f"parameters given for method(s) {unknown} that are not in methods={list(cfg.methods)}"
        )
    params = {}
    for name in cfg.methods:
        node = OmegaConf.create({"budget": cfg.budget, "m": _method_node(name)})
        node.m.update({k: v for k, v in every.items() if k in build_method_fields(name)})
        node.m.update(per_method.get(name, {}))
        values = OmegaConf.to_container(node, resolve=True)["m"]
        values = {k: _parse(v) for k, v in values.items()}
        values.pop("name")
        params[name] = build_method(name, **values).params()  # raises ValueError on a bad value
    cfg.method_params = params
    cfg.kv_quants = {name: storage(name, node) for name, node in (cfg.kv_quants or {}).items()}
    validate(cfg)
    return cfg


def storage(name: str, node: Any) -> dict[str, Any]:
    """The fields of quantized storage `name`: `node`'s `kind` names conf/kv_quant/<kind>.yaml, its
    other keys override that file's fields (ValueError naming a bad node or an unknown kind)."""
    node = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    if not isinstance(node, dict) or not isinstance(node.get("kind"), str) or node["kind"] == "none":
        raise ValueError(
            f"kv_quants.{name} must be {{kind: <conf/kv_quant name>, ...}}, got kv_quants.{name}={node!r}"
        )
    base = OmegaConf.to_container(load_option("kv_quant", node["kind"]), resolve=True)
    base.pop("defaults", None)
    return {**base, **node}


def build_method_fields(name: str) -> set[str]:
    return set(METHODS[name].__dataclass_fields__)


def _parse(value: Any) -> Any:
    """A command-line string as YAML would read it (`16` -> 16, `null` -> None, `avg` -> 'avg')."""
    return yaml.safe_load(value) if isinstance(value, str) and value else value


def validate(cfg: DictConfig) -> None:
    """Bad values raise ValueError naming them, before anything loads."""
    for key in ("rounds", "decode_tokens"):
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ValueError(f"{key} must be a positive integer, got {key}={cfg[key]!r}")
    for key in ("lengths", "batch_sizes"):
        bad = [v for v in cfg[key] if not isinstance(v, int) or v < 1]
        if bad or not cfg[key]:
            raise ValueError(
                f"{key} must be a non-empty list of positive integers, got {key}={list(cfg[key])}"
            )
    if cfg.clock == "auto":
        cfg.clock = "ref" if cfg.model.device == "cpu" else "wall"
    if cfg.clock not in CLOCKS:
        raise ValueError(f"clock must be one of {CLOCKS} or auto, got clock={cfg.clock!r}")
    if cfg.clock == "ref":
        refs = cfg.reference_tokens
        if not isinstance(refs, DictConfig):
            raise ValueError(
                f"reference_tokens must be {{prefill: N, decode: M}}, got reference_tokens={refs!r}"
            )
        for phase in ("prefill", "decode"):
            n = refs.get(phase)
            if not isinstance(n, int) or n < 1:
                raise ValueError(
                    f"clock=ref needs reference_tokens.{phase} >= 1, got reference_tokens.{phase}={n!r}"
                )
    if cfg.threads is not None and (not isinstance(cfg.threads, int) or cfg.threads < 1):
        raise ValueError(f"threads must be a positive integer or null, got threads={cfg.threads!r}")
    if not isinstance(cfg.noise_threshold, int | float) or cfg.noise_threshold < 0:
        raise ValueError(f"noise_threshold must be >= 0, got noise_threshold={cfg.noise_threshold!r}")
    if not isinstance(cfg.resume, bool):
        raise ValueError(f"resume must be true or false, got resume={cfg.resume!r}")
    resumed(cfg, plan(cfg))


def plan(cfg: DictConfig) -> list[Config]:
    """The configurations of one round, in the first round's order."""
    pairs = []
    stores = cfg.get("kv_quants") or {}
    if cfg.configs is None:
        pairs = [(m, None, n) for n in cfg.lengths for m in cfg.methods]
    else:
        for item in cfg.configs:
            head, at, length = str(item).partition("@")
            if not at or not length.isdigit() or int(length) < 1:
                raise ValueError(
                    f"configs entries are 'method@length' or 'method+storage@length', got {item!r}"
                )
            name, plus, store = head.partition("+")
            if name not in cfg.method_params:
                raise ValueError(
                    f"configs entry {item!r}: method {name!r} is not in methods={list(cfg.methods)}"
                )
            if plus and store not in stores:
                raise ValueError(
                    f"configs entry {item!r}: storage {store!r} is not in kv_quants (known: {', '.join(stores) or 'none'})"
                )
            pairs.append((name, store or None, int(length)))
    return [
        Config(
            m,
            tuple(sorted(cfg.method_params[m].items())),
            n,
            b,
            s,
            tuple(sorted(_plain(stores[s]).items())) if s else (),
        )
        for b in cfg.batch_sizes
        for m, s, n in pairs
    ]


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def _cell(value: str) -> Any:
    """A CSV cell as `_write_csv` wrote it: "" -> None, numbers and booleans as such."""
    if value == "":
        return None
    if value in ("True", "False"):
        return value == "True"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _key(method: str, input_tokens: int, batch_size: int) -> tuple[str, int, int]:
    return method, int(input_tokens), int(batch_size)


def resumed(cfg: DictConfig, configs: list[Config]) -> list[dict[str, Any]]:
    """With `resume=true`, the rows `out` already holds (every one kept, a cut-short round's too, an
    error row as the cell's result): `run` measures only the (round, configuration) cells they
    lack. Rows of another plan (a method, length or batch size not planned, other method
    parameters, another model or dtype) raise ValueError naming the first, before anything loads."""
    out = Path(cfg.out)
    if not cfg.resume or not out.exists():
        return []
    with out.open(newline="") as f:
        rows = [{k: _cell(v) for k, v in r.items()} for r in csv.DictReader(f)]
    planned = {
        _key(c.label, c.input_tokens, c.batch_size): {
            k: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for k, v in c.params
        }
        for c in configs
    }
    quants = {_key(c.label, c.input_tokens, c.batch_size): dict(c.kv_quant) or None for c in configs}
    for row in rows:
        key = _key(row["method"], row["input_tokens"], row["batch_size"])
        what = f"{out} round {row['round']} {key[0]}@{key[1]} batch {key[2]}"
        if key not in planned:
            raise ValueError(f"resume=true: {what} is not in this run's configurations")
        if json.loads(row["method_params"]) != planned[key]:
            raise ValueError(f"resume=true: {what} ran with other parameters: {row['method_params']}")
        if json.loads(row.get("kv_quant") or "null") != quants[key]:
            raise ValueError(f"resume=true: {what} ran on other storage: {row.get('kv_quant')}")
        for field, want in (("model", cfg.model.name), ("dtype", cfg.model.dtype)):
            if str(row[field]) != str(want):
                raise ValueError(f"resume=true: {what} ran with {field}={row[field]}, not {want}")
    return rows


def rotated(configs: list[Config], r: int) -> list[Config]:
    """Round r's order: the plan rotated left by r."""
    k = r % len(configs) if configs else 0
    return configs[k:] + configs[:k]


def spec_of(cfg: DictConfig, c: Config) -> dict[str, Any]:
    return dict(
        method=c.method,
        label=c.label,
        # list-valued parameters (knorm's skip_layers) are ListConfig inside the composed config
        params={k: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for k, v in c.params},
        kv_quant=dict(c.kv_quant) or None,
        input_tokens=c.input_tokens,
        batch_size=c.batch_size,
        decode_tokens=cfg.decode_tokens,
        chunk_size=cfg.chunk_size,
        seed=cfg.seed,
        model=OmegaConf.to_container(cfg.model, resolve=True),
        reference_tokens=OmegaConf.to_container(cfg.reference_tokens) if cfg.clock == "ref" else {},
    )


def run_subprocess(spec: dict[str, Any], timeout_s: float, threads: int | None = None) -> dict[str, Any]:
    """Measure one configuration in a fresh `python -m eval.bench.measure` process (`threads`: its
    OMP_NUM_THREADS, set before torch loads; None: inherited)."""
    cmd = [sys.executable, "-m", "eval.bench.measure", json.dumps(spec)]
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    base = dict(method=spec.get("label", spec["method"]), batch_size=spec["batch_size"], input_tokens=spec["input_tokens"],
                model=spec["model"]["name"], dtype=spec["model"]["dtype"], device=spec["model"]["device"])  # fmt: skip
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, cwd=CONF_DIR.parent, env=env
        )
    except subprocess.TimeoutExpired:
        return dict(base, status="error", error=f"timeout after {timeout_s}s")
    for line in proc.stdout.splitlines():
        if line.startswith("ROW "):
            return json.loads(line[4:])
    if proc.returncode in (-9, 137):  # killed by the kernel's OOM killer
        return dict(base, status="oom", error="killed (out of memory)")
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return dict(base, status="error", error=last)


def run(cfg: DictConfig) -> list[dict[str, Any]]:
    """All rounds; writes every row to `cfg.out` as it comes and returns the rows (`noisy` set)."""
    configs = plan(cfg)
    use_sub = cfg.subprocess if cfg.subprocess is not None else cfg.model.device == "cpu"
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model = vocab = None
    if not use_sub and cfg.threads and cfg.model.device == "cpu":
        torch.set_num_threads(cfg.threads)
    before = resumed(cfg, configs)
    done = {(row["round"], *_key(row["method"], row["input_tokens"], row["batch_size"])) for row in before}
    if before:
        print(f"resume: {len(before)} rows in {out}; measuring the cells they lack", flush=True)
    rows: list[dict[str, Any]] = []
    for r in range(cfg.rounds):
        round_rows = [row for row in before if row["round"] == r]
        later = [row for row in before if row["round"] > r]
        for order, c in enumerate(rotated(configs, r)):
            if (r, *c.key) in done:
                continue
            t = time.perf_counter()
            spec = spec_of(cfg, c)
            if use_sub:
                row = run_subprocess(spec, cfg.timeout_s, cfg.threads)
            else:
                if model is None:
                    model, vocab = measure.load(spec["model"], cfg.seed)
                row = measure.measure(model, vocab, spec)
            row.update({"round": r, "order": order})
            round_rows.append(row)
            _print_row(row, time.perf_counter() - t)
            # every row as it comes (`noisy` once its round is done), the later rounds' resumed rows too
            _write_csv(out, rows + round_rows + later)
        round_rows.sort(key=lambda x: x["order"])
        noisy = any((x.get("other_cores") or 0.0) > cfg.noise_threshold for x in round_rows)
        for row in round_rows:
            row["noisy"] = noisy
        rows += round_rows
        _write_csv(out, rows + later)
        print(f"round {r + 1}/{cfg.rounds}: {'NOISY' if noisy else 'quiet'} (max other cores "
              f"{max((x.get('other_cores') or 0.0) for x in round_rows):.2f})", flush=True)  # fmt: skip
    return rows + [row for row in before if row["round"] >= cfg.rounds]


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


def _print_row(row: dict[str, Any], took: float) -> None:
    tpot = f"{row['tpot_s'] * 1e3:.1f} ms" if row.get("tpot_s") else "-"
    pre = f"{row['prefill_s']:.2f} s" if row.get("prefill_s") else "-"
    if row.get("prefill_cpu_s") is not None:
        pre += f" (cpu {row['prefill_cpu_s']:.2f})"
    if row.get("tpot_cpu_s") is not None:
        tpot += f" (cpu {row['tpot_cpu_s'] * 1e3:.1f})"
    if row.get("tpot_ref") is not None:  # the reference clock: in units of the reference forward
        tpot += f" = {row['tpot_ref']:.3f} ref"
        pre += f" = {row['prefill_ref']:.1f} ref" if row.get("prefill_ref") is not None else ""
    other = f"{row['other_cores']:.2f}" if row.get("other_cores") is not None else "-"
    print(f"  {row['method']:>13} batch={row['batch_size']} len={row['input_tokens']:>7}: {row['status']:<5} "
          f"prefill {pre:>20}  TPOT {tpot:>22}  peak {row.get('peak_mem_bytes') or 0:>13,} B  "
          f"other cores {other}  ({took:.0f}s){'  ' + str(row.get('error')) if row.get('error') else ''}",
          flush=True)  # fmt: skip


def main(argv: list[str]) -> int:
    """The benchmark CLI: exit 2 with one line naming a bad value (before any model loads), else 0,
    whether or not the targets are met (the numbers are the result)."""
    try:
        cfg = compose(argv)
    except (ValueError, HydraException, OmegaConfBaseException) as err:
        print(f"error: {first_line(err)}", file=sys.stderr)
        return 2
    rows = run(cfg)
    out = Path(cfg.out)
    print(f"\nwrote {out}")
    if cfg.plots and rows:
        for p in bench_report.plot(rows, out):
            print(f"wrote {p}")
    print()
    print(bench_report.summary_text(rows, cfg))
    return 0
