"""Declarative parameter checks (`snapkv.methods.checks`): what each rule accepts, and that a
method's table is merged along its class hierarchy."""

from __future__ import annotations

import math

import pytest

from snapkv import build_method
from snapkv.methods.adakv import AdaKV
from snapkv.methods.checks import Check, flag, integer, number, one_of
from snapkv.methods.criticalkv import CriticalKV


@pytest.mark.parametrize(
    "check,good,bad",
    [
        (integer(), [1, 7], [0, -1, 1.0, True, "1", None]),
        (integer(0, none=True), [0, 3, None], [-1, 2.5, False]),
        (number(0, 1), [0, 0.5, 1], [-0.1, 1.5, math.nan, True, "0.5", None]),
        (number(0, 1, high_open=True), [0, 0.99], [1, 1.0]),
        (number(0), [0, 1e9], [-1e-9, math.nan]),
        (one_of((False, True, "sum")), [False, True, "sum"], [1, 0, "mass", None]),
        (flag(), [True, False], [0, 1, "yes", None]),
        (Check("a list", types=(int,), low=0, each=True), [[], [0, 3], (1,)], [0, [-1], [True], "0"]),
    ],
)
def test_a_check_accepts_exactly_its_values(check, good, bad):
    assert all(check.accepts(v) for v in good)
    assert not any(check.accepts(v) for v in bad)


def test_checks_merge_along_the_class_hierarchy():
    ada, critical = AdaKV.param_checks(), CriticalKV.param_checks()
    assert {"budget", "window", "schedule", "alpha"} <= set(ada)  # inherited from SnapKV / PyramidKV
    assert ada["base"].choices == ("snapkv", "pyramidkv")
    assert critical["base"].choices == ("snapkv", "pyramidkv", "adakv")  # replaced by the subclass


@pytest.mark.parametrize(
    "name,params,message",
    [
        ("snapkv", dict(window=True), "window must be a positive integer, got window=True"),
        ("h2o", dict(normalize=1), "normalize must be true or false, got normalize=1"),
        ("h2o", dict(block_size=2.5), "block_size must be positive, got block_size=2.5"),
        ("h2o", dict(recent_ratio="x"), "recent_ratio must be in [0, 1), got recent_ratio='x'"),
        ("h2o", dict(budget=None), "h2o needs a budget, got budget=None"),
        ("full", dict(budget=-3), "method 'full' keeps every token and takes no budget, got budget=-3"),
    ],
)
def test_a_refusal_names_the_value(name, params, message):
    with pytest.raises(ValueError) as error:
        build_method(name, **params)
    assert str(error.value) == message
