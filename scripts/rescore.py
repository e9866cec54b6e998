"""Score stored predictions again with the task's current scorer (eval/rescore.py).

python scripts/rescore.py RESULTS_DIR [task.key=value ...] [model.key=value ...]
"""

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file from a checkout

from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from eval.rescore import rescore_dir  # noqa: E402
from snapkv.errors import first_line  # noqa: E402


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="[rescore] %(message)s")
    if not argv or argv[0].startswith("-"):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    try:
        done = rescore_dir(argv[0], argv[1:])
    except (ValueError, FileNotFoundError, KeyError, OmegaConfBaseException) as e:
        print(f"error: {first_line(e)}", file=sys.stderr)
        return 2
    checked = sum(c for c, _ in done.values())
    changed = sum(n for _, n in done.values())
    print(f"{checked} ok rows checked in {len(done)} files, {changed} rescored")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
