"""`compare`: the methods a single run also runs, on the same task, model and budget, so that its
report draws the asked-for method beside the full cache and a baseline (`needle_compare_*.png`).

    python run.py                           # snapkv, then compare=[full, streamingllm]
    python run.py method=h2o compare=[full]  # h2o and the full cache
    python run.py compare=[]                 # only the method asked for

Each compare method is its own job with its own results file (resumed like any run: rows already
there are not recomputed); it takes its config as `method=<name>` composes it, so method-specific overrides
on the command line (`method.window=16`) apply to the asked-for method only, and the shared
`budget` to all; `kv_quant` to the asked-for method only (the baselines store the model's dtype).
A sweep (`-m`) names its methods itself: there `compare` is ignored.

`run_with_compare(cfg)` is what `python run.py` does: the run, then its compare methods, every spec
validated before any model loads, one report at the end.
"""

from __future__ import annotations

import logging

from omegaconf import DictConfig, ListConfig, open_dict

from eval.callbacks import in_multirun
from eval.conf import method_config, options
from eval.runner import AllSamplesFailed, report_results, run
from eval.spec import RunSpec

logger = logging.getLogger(__name__)


def compare_names(cfg: DictConfig) -> list[str]:
    """The `compare` list, checked: conf/method/ names, without the run's own method, deduplicated.
    ValueError naming a bad entry (before anything loads)."""
    value = cfg.get("compare")
    if value is None:
        return []
    if not isinstance(value, (list, tuple, ListConfig)):
        raise ValueError(
            f"compare must be a list of method names (e.g. [full,streamingllm]), got compare={value!r}"
        )
    known = options("method")
    names = []
    for name in value:
        if not isinstance(name, str) or name not in known:
            raise ValueError(f"unknown compare method {name!r}; known: {', '.join(known)}")
        if name != cfg.method.name and name not in names:
            names.append(name)
    return names


def compare_configs(cfg: DictConfig) -> list[DictConfig]:
    """`cfg` itself, then one config per `compare` method: `cfg` with `method` replaced by that
    method's config (`eval.conf.method_config`; its `${budget}` resolves against the run's own `budget`)."""
    configs = [cfg]
    for name in compare_names(cfg):
        other = cfg.copy()
        with open_dict(other):
            other.method = method_config(name)
            # the baselines at the model's dtype: a quantized run (`kv_quant`) is drawn beside the
            # unquantized references (their rows and files are those of a plain run)
            other.kv_quant = {"kind": "none"}
        configs.append(other)
    return configs


def run_with_compare(cfg: DictConfig) -> None:
    """The run, then its `compare` methods, every spec validated before any model loads; one report
    at the end. In a sweep job: the job alone (a sweep names its methods)."""
    if in_multirun():
        run(cfg, write_report=False)  # the sweep's callback writes it once, after the last job
        return
    first, *others = compare_configs(cfg)
    specs = [RunSpec.from_config(first)]
    for other in others:
        try:
            specs.append(RunSpec.from_config(other))
        except ValueError as err:
            if specs[0].engine is None:
                raise
            # An engine runs fewer methods than the harness: the asked-for run goes on without them.
            logger.warning("compare: %s skipped: %s", other.method.name, err)
    if len(specs) == 1:
        run(specs[0])
        return
    logger.info(
        "compare: %s, then %s on the same grid (compare=[] runs %s alone)",
        specs[0].method.name, ", ".join(s.method.name for s in specs[1:]), specs[0].method.name,
    )  # fmt: skip
    failed: AllSamplesFailed | None = None
    for spec in specs:
        try:
            run(spec, write_report=False)  # the report once, below, over every method's rows
        except AllSamplesFailed as err:
            failed = failed or err
    if specs[0].report:
        report_results(specs[0].results_dir)
    if failed is not None:
        raise failed
