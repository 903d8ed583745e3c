"""Issue 43: one in-process runner signature and one result type for the three methods (the table row
"in-process runner: run_surgical(sites, config, out_dir) / run_cwt(sites, model_config, config,
out_dir=None) / run_fedfew(data, *, config, model_config, out_dir)")."""

from __future__ import annotations

import inspect
import typing

import pytest
from cxrfl.common.inprocess import RUNNER_PARAMETERS, RunResult
from cxrfl.cwt.inprocess import run_cwt
from cxrfl.fedfew.inprocess import run_fedfew
from cxrfl.surgical.inprocess import run_surgical


@pytest.mark.parametrize("runner", [run_surgical, run_cwt, run_fedfew], ids=lambda f: f.__name__)
def test_every_runner_takes_the_same_arguments_first_and_returns_a_run_result(runner):
    params = list(inspect.signature(runner).parameters.values())
    assert [p.name for p in params[: len(RUNNER_PARAMETERS)]] == list(RUNNER_PARAMETERS)
    assert [p.kind for p in params[:3]] == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * 3
    assert all(p.kind == inspect.Parameter.KEYWORD_ONLY for p in params[3:])
    returned = typing.get_type_hints(runner)["return"]
    assert issubclass(typing.get_origin(returned) or returned, RunResult)
