"""snapkv-bench entry point: `python run.py [group=option ...] [key=value ...]` (configs in conf/).

    python run.py                                    # needle grid, SmolLM2-135M, SnapKV (CPU, minutes)
    python run.py task=longbench task.data_dir=DIR   # LongBench
    python run.py -m method=full,snapkv budget=256,512             # a sweep
    python run.py -m hydra/launcher=slurm model=mistral-7b-instruct-v0.2 task=longbench ...

The work is done by `eval.runner.run(cfg)`; this file only turns bad input into one line on stderr
(`error: ...`, exit code 2) instead of a traceback. In a sweep (`-m`) a bad value stops the sweep the
same way; rows already written are always kept, and rerunning the command resumes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# CPU timings: on VMs an idle OpenMP worker that sleeps costs a scheduler tick (~4-8 ms) per
# parallel region to wake up; spinning workers measure the kernels (scripts/bench_speed.py).
# Must be set before torch loads its OpenMP runtime; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

# Bad input surfaces as one of these (unknown names, out-of-range values, missing files or data,
# malformed jsonl, missing mandatory config values); anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, KeyError, OmegaConfBaseException)
# Absolute, so that the entry point also works when imported (tests) or started from another directory.
CONF_DIR = str(Path(__file__).resolve().parent / "conf")


def error_line(err: BaseException) -> str:
    text = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
    return (str(text).strip().splitlines() or [type(err).__name__])[0]


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from eval.runner import run

    try:
        run(cfg)
    except USER_ERRORS as err:
        print(f"error: {error_line(err)}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted: the rows written so far are kept; run the same command again to resume",
              file=sys.stderr, flush=True)  # fmt: skip
        sys.exit(130)


if __name__ == "__main__":
    main()
