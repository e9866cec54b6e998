"""snapkv-bench entry point: `python run.py [group=option ...] [key=value ...]` (configs in conf/).

    python run.py                                    # needle grid, SmolLM2-135M: SnapKV beside the
                                                     # full cache and StreamingLLM (CPU, minutes)
    python run.py task=longbench task.data_dir=DIR   # LongBench
    python run.py -m method=full,snapkv budget=256,512             # a sweep
    python run.py -m hydra/launcher=slurm model=mistral-7b-instruct-v0.2 task=longbench ...

The work is done by `eval.compare.run_with_compare(cfg)` (the run and its `compare` methods);
this file only turns bad input into one line on stderr
(`error: ...`, exit code 2) instead of a traceback, before any model loads: an unknown config
group option (`method=bogus`) is refused before Hydra composes the config, and an override of a key
the config does not have (`method.nope=1`, `task.nope=1`, `nope=1`) once the groups it chooses are
composed (in a sweep: every combination of the groups it sweeps). A run whose samples all
failed exits 1. In a sweep (`-m`) a bad point is recorded and the sweep goes on; after the last job
the report is written and the failed points are listed (exit code 2). Rows already written are
always kept, and rerunning the command resumes.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
from pathlib import Path

# CPU timings: on VMs an idle OpenMP worker that sleeps costs a scheduler tick per parallel region
# to wake up; spinning workers measure the kernels (docs/pitfalls.md, "CPU timing on VMs").
# Must be set before torch loads its OpenMP runtime; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")

import hydra  # noqa: E402
from hydra.core.override_parser.overrides_parser import OverridesParser  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

# Project modules are imported inside the functions: launchers that pickle `main` (submitit) load
# it in a fresh process before the checkout is on sys.path. For the same reason Hydra's config path
# is spelled here rather than taken from eval.conf (which finds the same folder).
CONF_DIR = Path(__file__).resolve().parent / "conf"

# Bad input surfaces as one of these (unknown names, out-of-range values, missing files or data,
# malformed jsonl, missing mandatory config values); anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, KeyError, OmegaConfBaseException)
# Config groups whose options are files conf/<group>/<option>.yaml, checked before Hydra composes.
CHECKED_GROUPS = ("model", "method", "kv_quant", "task", "experiment")
# Hydra's options that compose another config, or none: the key check leaves such commands to Hydra.
OTHER_CONFIG = ("-cn", "--config-name", "-cp", "--config-path", "-cd", "--config-dir", "-h", "--help",
                "--hydra-help", "-i", "--info", "-sc", "--shell-completion", "--experimental-rerun")  # fmt: skip
logger = logging.getLogger("run")


def error_line(err: BaseException) -> str:
    from snapkv.errors import first_line

    return first_line(err)


def check_group_options(args: list[str]) -> None:
    """ValueError naming an unknown option of a config group (`method=bogus`), sweeps included."""
    from eval.conf import options

    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001 - a syntax error: Hydra reports it itself
        return
    for o in parsed:
        if o.key_or_group not in CHECKED_GROUPS:
            continue
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.value()]
        known = options(o.key_or_group)
        for v in values:
            if v is not None and str(v) not in known:
                raise ValueError(f"unknown {o.key_or_group} {str(v)!r}; known: {', '.join(known)}")


def check_override_keys(args: list[str]) -> None:
    """ValueError naming an override of a key the composed config does not have (`method.nope=1`;
    Hydra's struct mode would refuse it with its own message and exit code 1) and the keys that its
    parent has. The config is composed with the command's group choices only, once per combination
    of the groups a sweep (`-m`) chooses; additions (`+key=`) and deletions (`~key`) are Hydra's."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.types import OverrideType

    from eval.conf import is_group, missing_key

    if any(a.partition("=")[0] in OTHER_CONFIG for a in args):
        return
    try:
        parsed = OverridesParser.create().parse_overrides(
            [a for a in args if "=" in a and not a.startswith("-")]
        )
    except Exception:  # noqa: BLE001 - a syntax error: Hydra reports it itself
        return
    groups = [o for o in parsed if is_group(o.key_or_group)]
    keys = [o for o in parsed if not is_group(o.key_or_group) and o.type == OverrideType.CHANGE]
    if not keys:
        return
    sweep = "-m" in args or "--multirun" in args
    choices = [
        [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
        if sweep and o.is_sweep_override()
        else [o.input_line]
        for o in groups
    ]
    points = list(itertools.product(*choices))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for point in points:
            try:
                cfg = compose("config", overrides=list(point), return_hydra_config=True)
            except Exception:  # noqa: BLE001 - groups Hydra cannot compose: it reports them itself
                continue
            for o in keys:
                if (missing := missing_key(cfg, o.key_or_group)) is None:
                    continue
                parent, known = missing
                swept = [c for c, options in zip(point, choices) if len(options) > 1]
                at = f" (with {' '.join(swept)})" if swept else ""
                where = f"known keys of {parent}" if parent else "known top-level keys"
                if not known:  # an empty dict (hydra.job.env_set): its entries are added with +
                    raise ValueError(
                        f"unknown config key {o.key_or_group!r}{at}; add it with +{o.input_line}"
                    )
                raise ValueError(f"unknown config key {o.key_or_group!r}{at}; {where}: {', '.join(known)}")


def _fail(message: str, code: int) -> None:
    """One line on stderr and exit `code`; in a sweep job: recorded, and the sweep goes on."""
    from eval.callbacks import in_multirun, record_job_error

    if in_multirun():
        record_job_error(message)
        logger.error("error: %s (this sweep point is skipped; the sweep goes on)", message)
        return
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from eval.callbacks import clear_job_error, in_multirun
    from eval.compare import run_with_compare
    from eval.runner import AllSamplesFailed

    if in_multirun():
        clear_job_error()  # a rerun of the sweep: this point's earlier failure is not this run's
    try:
        run_with_compare(cfg)
    except USER_ERRORS as err:
        _fail(error_line(err), 2)
    except AllSamplesFailed as err:
        _fail(error_line(err), 1)
    except KeyboardInterrupt:
        print("interrupted: the rows written so far are kept; run the same command again to resume",
              file=sys.stderr, flush=True)  # fmt: skip
        sys.exit(130)


def cli() -> None:
    try:
        check_group_options(sys.argv[1:])
        check_override_keys(sys.argv[1:])
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    main()


if __name__ == "__main__":
    cli()
