"""NVFlare glue without a running federation: config resolution, the aggregator component, the
surgical workflow's arguments."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from cxrfl.errors import ConfigError
from cxrfl.fl.aggregator import SurgicalAggregator
from cxrfl.fl.site_config import LOCAL_CONFIG_NAME, resolve_site_config
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType


def test_site_config_resolution_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CXRFL_SITE_CONFIG", raising=False)
    monkeypatch.delenv("CXRFL_SITE_CONFIG_DIR", raising=False)
    (tmp_path / "site_configs").mkdir()
    (tmp_path / "site_configs" / "h1.yaml").write_text("x")
    path, how = resolve_site_config("h1")
    assert path == (tmp_path / "site_configs" / "h1.yaml").resolve() and how == "site_configs/"

    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "h1.yaml").write_text("x")
    monkeypatch.setenv("CXRFL_SITE_CONFIG_DIR", str(other))
    assert resolve_site_config("h1")[0] == (other / "h1.yaml").resolve()

    local = tmp_path / "local"
    local.mkdir()
    (local / LOCAL_CONFIG_NAME).write_text("x")
    assert resolve_site_config("h1", local)[0] == local / LOCAL_CONFIG_NAME

    monkeypatch.setenv("CXRFL_SITE_CONFIG", "/some/file.yaml")
    assert resolve_site_config("h1", local) == (__import__("pathlib").Path("/some/file.yaml"), "$CXRFL_SITE_CONFIG")


def test_unknown_site_without_config_fails_clearly(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CXRFL_SITE_CONFIG", raising=False)
    monkeypatch.delenv("CXRFL_SITE_CONFIG_DIR", raising=False)
    with pytest.raises(ConfigError, match="no site config for 'mystery-hospital'"):
        resolve_site_config("mystery-hospital")


def result(site: str, classes: list[str], rows: np.ndarray, body: float, n: int = 10) -> FLModel:
    params = {
        "body.w": np.full((2,), body, np.float32),
        "classifier.weight": rows.astype(np.float32),
        "classifier.bias": rows[:, 0].astype(np.float32),
    }
    return FLModel(
        params_type=ParamsType.FULL, params=params, meta={"client_name": site, "classes": classes, "num_samples": n}
    )


def test_aggregator_stitches_rows_and_rejects_a_bad_site(caplog):
    agg = SurgicalAggregator()
    agg.expect({"body.w": (2,)}, {"a": ["x", "y"], "b": ["y", "z"], "c": ["x"]})
    assert agg.accept_model(result("a", ["x", "y"], np.array([[1.0, 1.0], [2.0, 2.0]]), body=1.0))
    assert agg.accept_model(result("b", ["y", "z"], np.array([[4.0, 4.0], [6.0, 6.0]]), body=3.0))
    bad = result("c", ["x"], np.array([[np.nan, 0.0]]), body=0.0)
    with caplog.at_level(logging.WARNING):
        assert not agg.accept_model(bad)
    assert "c" in agg.rejected and "site c" in agg.rejected["c"]
    out = agg.aggregate_model()
    assert out.meta["classes"] == ["x", "y", "z"]
    assert out.meta["contributors"] == {"x": ["a"], "y": ["a", "b"], "z": ["b"]}
    np.testing.assert_allclose(out.params["body.w"], [2.0, 2.0])
    np.testing.assert_allclose(out.params["classifier.weight"], [[1, 1], [3, 3], [6, 6]])
    assert agg.accepted_sites == []  # reset after aggregation


def test_aggregator_rejects_unannounced_class_and_shape():
    agg = SurgicalAggregator()
    agg.expect({"body.w": (2,)}, {"a": ["x"]})
    assert not agg.accept_model(result("a", ["x", "secret"], np.ones((2, 2)), body=1.0))
    assert "secret" in agg.rejected["a"]
    wrong = result("a", ["x"], np.ones((1, 2)), body=1.0)
    wrong.params["body.w"] = np.ones((3,), np.float32)
    assert not agg.accept_model(wrong)
    assert "body.w" in agg.rejected["a"]


def test_a_missing_site_keeps_its_unique_rows_from_the_previous_global():
    reference = {
        "body.w": np.zeros(2, np.float32),
        "classifier.weight": np.array([[1.0, 1.0], [2.0, 2.0], [9.0, 9.0]], np.float32),
        "classifier.bias": np.array([1.0, 2.0, 9.0], np.float32),
    }
    agg = SurgicalAggregator()
    agg.expect({"body.w": (2,)}, {"a": ["x", "y"], "b": ["y", "z"]}, ["x", "y", "z"], reference)
    assert agg.accept_model(result("a", ["x", "y"], np.array([[3.0, 3.0], [4.0, 4.0]]), body=1.0))
    out = agg.aggregate_model()  # site b (the only one with z) did not answer this round
    assert out.meta["classes"] == ["x", "y", "z"]
    np.testing.assert_allclose(out.params["classifier.weight"], [[3, 3], [4, 4], [9, 9]])
    np.testing.assert_allclose(out.params["classifier.bias"], [3, 4, 9])
    assert out.meta["contributors"] == {"x": ["a"], "y": ["a"]}


def test_clip_limits_a_scaled_update_against_the_previous_global():
    reference = {
        "body.w": np.zeros(2, np.float32),
        "classifier.weight": np.zeros((1, 2), np.float32),
        "classifier.bias": np.zeros(1, np.float32),
    }
    plain, clipped = SurgicalAggregator(), SurgicalAggregator(robust="clip", clip_norm=1.0)
    for agg in (plain, clipped):
        agg.expect({"body.w": (2,)}, {"a": ["x"], "b": ["x"]}, ["x"], reference)
        agg.accept_model(result("a", ["x"], np.array([[0.1, 0.1]]), body=0.1))
        agg.accept_model(result("b", ["x"], np.array([[1e6, 1e6]]), body=1e6))
    big, small = plain.aggregate_model(), clipped.aggregate_model()
    assert np.abs(big.params["body.w"]).max() > 1e5
    assert np.abs(small.params["body.w"]).max() < 1.0


def test_aggregator_checks_before_summing_and_keeps_only_head_rows():
    """The plain mean is summed at accept time; a NaN anywhere in an update rejects it (naming the
    first bad key) before any of it is added, so the sum of the accepted results goes on; each
    accepted result's feature extractor is dropped once summed (only its head rows are kept)."""
    from cxrfl.surgical.aggregation import surgical_aggregate

    rng = np.random.default_rng(0)

    def big_result(site: str, n: int) -> FLModel:
        params = {
            "body.big": rng.normal(size=(80, 64)).astype(np.float32),
            "body.w": rng.normal(size=2).astype(np.float32),
            "body.n": np.array(n, np.int64),
            "classifier.weight": np.ones((1, 2), np.float32),
            "classifier.bias": np.ones(1, np.float32),
        }
        return FLModel(
            params_type=ParamsType.FULL, params=params, meta={"client_name": site, "classes": ["x"], "num_samples": n}
        )

    shapes = {"body.big": (80, 64), "body.w": (2,), "body.n": ()}
    results = [big_result(s, n) for s, n in (("a", 3), ("b", 5), ("c", 7))]
    bad = big_result("b", 5)
    bad.params["body.w"][1] = np.nan  # a small array, after body.big in the update
    for weighting in ("uniform", "samples"):
        agg = SurgicalAggregator(weighting=weighting)
        agg.expect(shapes, {"a": ["x"], "b": ["x"], "c": ["x"]})
        assert agg.accept_model(results[0]) and not agg.accept_model(bad)
        assert agg.rejected["b"] == "site b: non-finite values (NaN or Inf) in 'body.w'"
        assert (
            agg.core.stream.running is not None
            and agg.core.stream.running.usable
            and [s for s, _ in agg.core.stream.running.added] == ["a"]
        )
        assert agg.accept_model(results[2])
        assert all(set(p.params) == {"classifier.weight", "classifier.bias"} for p in agg.core.stream.accepted)
        out = agg.aggregate_model()
        ups = [
            {"site": r.meta["client_name"], "classes": ["x"], "params": r.params, "num_samples": r.meta["num_samples"]}
            for r in (results[0], results[2])
        ]
        want, _ = surgical_aggregate(ups, weighting=weighting)
        for k in want:
            np.testing.assert_array_equal(out.params[k], want[k], err_msg=k)
        clean = SurgicalAggregator(weighting=weighting)  # all valid: the sum fed at accept time is used
        clean.expect(shapes, {"a": ["x"], "b": ["x"], "c": ["x"]})
        assert all(clean.accept_model(r) for r in results) and clean.core.stream.running.usable
        out = clean.aggregate_model()
        ups = [
            {"site": r.meta["client_name"], "classes": ["x"], "params": r.params, "num_samples": r.meta["num_samples"]}
            for r in results
        ]
        want, _ = surgical_aggregate(ups, weighting=weighting)
        for k in want:
            np.testing.assert_array_equal(out.params[k], want[k], err_msg=k)


@pytest.mark.parametrize("path", ["cxrfl.fl.surgical.SiteExecutor", "cxrfl.fl.executor.SiteExecutor"])
def test_a_job_exported_before_the_executor_was_renamed_still_builds_it_and_is_told(path, caplog):
    # issue 43 point 6: SiteExecutor became SurgicalExecutor (the <Method>Executor pattern); old job configs name it
    import importlib

    from cxrfl.fl.surgical import SurgicalExecutor

    module, name = path.rsplit(".", 1)
    built = getattr(importlib.import_module(module), name)(device="cpu", num_workers=0, num_threads=1)
    assert isinstance(built, SurgicalExecutor)
    assert any(
        "SiteExecutor is deprecated" in r.getMessage() and "SurgicalExecutor" in r.getMessage() for r in caplog.records
    )


def test_every_surgical_job_builds_its_workflow_with_the_exported_settings(repo_root):
    import json

    from cxrfl.fl import controller
    from cxrfl.fl.aggregator import AGGREGATION_POLICY
    from cxrfl.fl.surgical import SurgicalAggregation
    from cxrfl.jobs import JOBS, SURGICAL

    assert controller.SurgicalAggregation is SurgicalAggregation  # the old path
    specs = [spec for spec in JOBS if spec.controller == SURGICAL]
    assert len(specs) >= 5
    for spec in specs:
        server = json.loads((repo_root / "jobs" / spec.name / "app" / "config" / "config_fed_server.json").read_text())
        args = server["workflows"][0]["args"]
        workflow = SurgicalAggregation(**args)
        expected = {k: v for k, v in args.items() if k not in ("task_timeout", "analytic_sender_id", "aggregator_id")}
        # the aggregation policy is the aggregator component's, declared there only (issue 43 point 7)
        (component,) = [c for c in server["components"] if c["id"] == args["aggregator_id"]]
        assert component["path"] == "cxrfl.fl.aggregator.SurgicalAggregator", spec.name
        assert sorted(component["args"]) == sorted(AGGREGATION_POLICY) and not set(args) & set(AGGREGATION_POLICY)
        config = workflow.config.to_dict()
        assert {k: v for k, v in config.items() if k not in AGGREGATION_POLICY} == expected, spec.name
        assert workflow.task_timeout == args["task_timeout"]


def test_bad_workflow_settings_fail_at_construction_naming_the_key():
    from cxrfl.fl.surgical import SurgicalAggregation

    with pytest.raises(ConfigError, match="surgical.head_mode must be one of"):
        SurgicalAggregation(head_mode="everything")
    with pytest.raises(ConfigError, match="surgical.clip_norm must be > 0"):
        SurgicalAggregation(robust="clip", clip_norm=0)
    with pytest.raises(ValueError, match="task_timeout"):
        SurgicalAggregation(task_timeout=-1)


def test_a_site_with_an_empty_split_stops_at_start_with_the_reason_and_refuses_tasks(tmp_path, monkeypatch, caplog):
    # issue 44 point 3 (RELIABILITY.md, "an empty train or val split stops the site there with the reason"): no test
    # showed it. A site of test images only (the demo's external site) is started as NVFlare starts it: the start
    # logs the reason naming its split sizes, and every task is refused without training
    import pandas as pd
    from cxrfl.fl.surgical import SurgicalExecutor
    from cxrfl.synth import write_profile
    from nvflare.apis.fl_constant import ReturnCode
    from nvflare.apis.fl_context import FLContext
    from nvflare.apis.shareable import Shareable

    (config,) = write_profile("two-hospitals", tmp_path / "data", n_per_site=12, image_size=32, sites=["external"])
    n_test = len(pd.read_csv(tmp_path / "data" / "external" / "labels.csv"))
    monkeypatch.setenv("CXRFL_SITE_CONFIG", str(config))
    ws = tmp_path / "ws"
    engine = type(
        "Engine",
        (),
        {
            "get_workspace": lambda self: type(
                "Workspace", (), {"get_root_dir": lambda s: str(ws), "get_site_config_dir": lambda s: str(ws / "local")}
            )(),
            "get_component": lambda self, _: None,
            "fire_event": lambda self, *_: None,
        },
    )()
    ctx = FLContext()
    ctx.get_identity_name = lambda default="": "external"
    ctx.get_engine = lambda: engine
    executor = SurgicalExecutor(device="cpu", num_workers=0, num_threads=1, analytic_sender_id="")
    with caplog.at_level(logging.ERROR):
        executor.handle_event("_start_run", ctx)
    reason = f"site external: empty train or val split {{'train': 0, 'val': 0, 'test': {n_test}}}"
    assert executor.error is not None and executor.error.startswith(reason)
    assert any(reason in r.getMessage() for r in caplog.records)  # the site log line
    reply = executor.execute("train", Shareable(), ctx, abort_signal=type("Signal", (), {"triggered": False})())
    assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION and executor.host is None  # nothing trained


def test_a_late_answer_is_dropped_and_logged_not_handed_on(caplog):
    # NVFlare's ModelController hands a late "train" result on as the context's TRAINING_RESULT ("sent to
    # aggregator"); the round it answers was aggregated without it, so cxrfl only logs it
    from cxrfl.fl.surgical import SurgicalAggregation
    from nvflare.apis.client import Client
    from nvflare.apis.fl_context import FLContext
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
    from nvflare.app_common.app_constant import AppConstants
    from nvflare.app_common.utils.fl_model_utils import FLModelUtils

    late = FLModelUtils.to_shareable(FLModel(params_type=ParamsType.FULL, params={"w": np.ones(2)}, meta={}))
    ctx = FLContext()
    with caplog.at_level("WARNING"):
        SurgicalAggregation().process_result_of_unknown_task(Client("hospital-c", "t"), "train", "id-1", late, ctx)
    assert ctx.get_prop(AppConstants.TRAINING_RESULT) is None
    assert "late answer from site hospital-c to task train dropped" in caplog.text


def test_the_surgical_workflow_takes_exactly_the_config_settings_declared_once():
    # issue 43 point 4: every SurgicalConfig setting was written out three times in fl/surgical.py (signature,
    # docstring, dict); the workflow now takes **settings and shows SurgicalConfig's fields with their defaults
    import dataclasses
    import inspect

    from cxrfl.errors import ConfigError
    from cxrfl.fl.surgical import SurgicalAggregation
    from cxrfl.surgical.config import SurgicalConfig

    params = inspect.signature(SurgicalAggregation).parameters
    fields = [f.name for f in dataclasses.fields(SurgicalConfig)]
    assert list(params) == [*fields, "task_timeout", "analytic_sender_id", "aggregator_id"]
    assert params["patience"].default == SurgicalConfig().patience and params["model_config"].default is None
    built = SurgicalAggregation(num_rounds=3, train_config={"lr": 0.01}, task_timeout=5)
    assert built.config == SurgicalConfig.from_dict({"num_rounds": 3, "train_config": {"lr": 0.01}})
    with pytest.raises(
        ConfigError, match=r"unknown surgical setting\(s\) \['num_round'\] \(in the SurgicalAggregation"
    ):
        SurgicalAggregation(num_round=3)


class _Components:
    """The part of NVFlare's server engine a workflow asks for its components."""

    def __init__(self, **components) -> None:
        self.components = components

    def get_component(self, name: str):
        return self.components.get(name)


def _surgical_server(workflow, tmp_path, **components):
    workflow.engine = _Components(**components)
    return workflow.make_server(
        send=lambda *a, **kw: {}, sites=["a", "b"], out_dir=tmp_path, info=lambda _: None, warning=lambda _: None
    )


def test_the_surgical_workflow_aggregates_with_the_component_its_aggregator_id_names(tmp_path):
    # issue 43 point 7: an operator sees the aggregation in config_fed_server.json and can swap it; the workflow's
    # rounds run the round aggregator that component builds, with the component's policy
    from conftest import TINY_MODEL
    from cxrfl.fl.surgical import SurgicalAggregation

    class Swapped(SurgicalAggregator):
        def bind(self, **job):
            core = super().bind(**job)
            core.swapped = True
            return core

    component = Swapped(weighting="samples", robust="clip", clip_norm=2.0)
    workflow = SurgicalAggregation(aggregator_id="agg", model_config=TINY_MODEL, batchnorm="fedbn")
    server = _surgical_server(workflow, tmp_path, agg=component)
    assert (server.config.weighting, server.config.robust, server.config.clip_norm) == ("samples", "clip", 2.0)
    server._prepare()
    agg = server.aggregator
    assert agg is component.core and agg.swapped
    assert (agg.weighting, agg.robust, agg.clip_norm, agg.batchnorm) == ("samples", "clip", 2.0, "fedbn")
    assert set(agg.bn_keys) == server.bn_keys and agg.bn_keys and agg.head_mode == "surgical"


def test_a_job_exported_before_the_aggregator_component_keeps_its_policy_in_the_workflow(tmp_path):
    from conftest import TINY_MODEL
    from cxrfl.fl.surgical import SurgicalAggregation
    from cxrfl.surgical.round_aggregator import RoundAggregator

    workflow = SurgicalAggregation(weighting="samples", robust="clip", clip_norm=2.0, model_config=TINY_MODEL)
    server = _surgical_server(workflow, tmp_path)
    server._prepare()
    agg = server.aggregator
    assert type(agg) is RoundAggregator and (agg.weighting, agg.robust, agg.clip_norm) == ("samples", "clip", 2.0)


def test_an_aggregator_id_with_the_policy_twice_or_naming_no_aggregator_is_one_line(tmp_path):
    from cxrfl.fl.surgical import SurgicalAggregation

    with pytest.raises(ConfigError, match=r"robust, weighting set here and on the aggregator component 'agg'"):
        SurgicalAggregation(aggregator_id="agg", weighting="samples", robust="clip")
    with pytest.raises(ConfigError, match=r"'agg' of SurgicalAggregation names no component"):
        _surgical_server(SurgicalAggregation(aggregator_id="agg"), tmp_path)
    with pytest.raises(ConfigError, match=r"names a dict .* must name a cxrfl.fl.aggregator.SurgicalAggregator"):
        _surgical_server(SurgicalAggregation(aggregator_id="agg"), tmp_path, agg={})
