"""Config hashes do not move: `params()` (what `RunSpec.method_hash` hashes) of every method and
switch equals the dict recorded in `tests/data/method_params_frozen.json`.

The file holds every `tests/method_catalogue.py` entry, each method at its defaults and with each
`protect` / `evict_during_decode` / `decode_schedule` spelling it accepts, every `conf/method` file
as the runner composes it (budget 512), and the parameters of every distinct committed result row
under `results/` that today's methods still build. A change to how a method stores its switches
(a new field, a normalised value) must leave each of these dicts as it is: add cases, never edit
an expectation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from snapkv import METHODS, build_method

FROZEN = json.loads((Path(__file__).parents[1] / "data" / "method_params_frozen.json").read_text())


def test_every_method_is_frozen():
    assert {case["method"] for case in FROZEN} == set(METHODS)


@pytest.mark.parametrize(
    "case", FROZEN, ids=lambda c: f"{c['method']}-{json.dumps(c['params'], sort_keys=True)}"
)
def test_params_are_the_recorded_ones(case):
    method = build_method(case["method"], **case["params"])
    assert method.params() == case["expected"]
    # The same dict once more: reading it must not change what the method holds.
    assert method.params() == case["expected"]
