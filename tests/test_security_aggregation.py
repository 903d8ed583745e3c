"""Issue 40 points 3 and 6: hostile site updates against every aggregation path (surgical, CWT, FedFew).

Plain dicts of small arrays (hand-computed expectations, weights compared as tensors), except the
server tests, which drive :class:`SurgicalServer` with a scripted transport (no training).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from conftest import fedfew_fedavg
from cxrfl.common.io import read_records
from cxrfl.cwt.config import CWTConfig
from cxrfl.cwt.relay import Visit
from cxrfl.cwt.server import CWTServer, RelayPlan
from cxrfl.errors import ConfigError
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.server import FedFewServer
from cxrfl.nn.models import ModelConfig, load_checkpoint
from cxrfl.surgical.aggregation import surgical_aggregate
from cxrfl.surgical.config import SurgicalConfig
from cxrfl.surgical.round_aggregator import RoundAggregator
from cxrfl.surgical.server import SurgicalServer

W, B = "classifier.weight", "classifier.bias"
BIG = (64, 64)  # 4096 elements: summed on its own, before the small arrays (cxrfl.core.updates.SMALL)
NBT = "f.bn.num_batches_tracked"
MODEL = ModelConfig(arch="densenet-tiny", image_size=32)  # server tests: clip_norm is given, no norm is DenseNet's


def reference() -> dict[str, np.ndarray]:
    """The previous global model: a big and a small float32 array, an int64 counter, one head row (x)."""
    return {
        "f.big": np.zeros(BIG, np.float32),
        "f.small": np.zeros(2, np.float32),
        NBT: np.array(0, np.int64),
        W: np.zeros((1, 2), np.float32),
        B: np.zeros(1, np.float32),
    }


def site(name: str, value: float, n: int = 10, **override) -> dict:
    params = {
        "f.big": np.full(BIG, value, np.float32),
        "f.small": np.full(2, value, np.float32),
        NBT: np.array(4, np.int64),
        W: np.full((1, 2), value, np.float32),
        B: np.full(1, value, np.float32),
    }
    params.update(override)
    return {"site": name, "classes": ["x"], "params": params, "num_samples": n}


def aggregator(**kw) -> RoundAggregator:
    agg = RoundAggregator(warning=lambda _: None, **kw)
    ref = reference()
    agg.expect(
        {k: v.shape for k, v in ref.items() if not k.startswith("classifier.")}, {s: ["x"] for s in "abcd"}, ["x"], ref
    )
    return agg


def accept_all(agg: RoundAggregator, updates: list[dict]) -> None:
    for u in updates:
        with contextlib.suppress(Exception):  # NVFlare swallows an exception of the accept callback
            agg.accept(u)


def assert_honest(params: dict, value: float = 1.0) -> None:
    for k in ("f.big", "f.small", W, B):
        t = torch.as_tensor(np.asarray(params[k]))
        torch.testing.assert_close(t, torch.full_like(t, value), rtol=0, atol=0, msg=k)


# ------------------------------------------------------------------------------------ dtypes
def test_complex_in_a_later_key_is_rejected_before_anything_is_summed():
    # issue 40 point 3: a complex64 small array after a huge big one poisoned the running sum (5e29)
    hostile = site("c", 1e30, **{"f.small": np.full(2, 1 + 1j, np.complex64)})
    agg = aggregator()
    accept_all(agg, [site("a", 0.5), hostile, site("b", 1.5)])
    assert set(agg.rejected) == {"c"} and "complex64" in agg.rejected["c"]
    assert_honest(agg.aggregate().params)


def test_complex_first_is_rejected_not_stripped_of_its_imaginary_part():
    # issue 40 point 3: the first update complex -> accepted, imaginary part dropped (global 2.33)
    hostile = site("c", 5.0, **{"f.big": np.full(BIG, 5 + 5j, np.complex64)})
    agg = aggregator()
    accept_all(agg, [hostile, site("a", 0.5), site("b", 1.5)])
    assert list(agg.rejected) == ["c"] and agg.accepted_sites == ["a", "b"]
    assert_honest(agg.aggregate().params)


@pytest.mark.parametrize("dtype", [np.int64, np.bool_, np.float64])
@pytest.mark.parametrize("robust", [None, "median", "clip"])
def test_other_dtypes_where_float32_is_expected_are_rejected(dtype, robust):
    # issue 40 point 3: int64, bool and float64 were accepted into a float32 model
    agg = aggregator(robust=robust, clip_norm=None if robust is None else 1e3)
    hostile = site("d", 1.0, **{"f.small": np.ones(2, dtype)})
    accept_all(agg, [site("a", 0.5), site("b", 1.5), hostile, site("c", 1.0)])
    assert set(agg.rejected) == {"d"} and "dtype" in agg.rejected["d"]
    out = agg.aggregate().params
    assert np.asarray(out["f.small"]).dtype == np.float32
    assert np.asarray(out[NBT]).dtype == np.int64 and int(out[NBT]) == 4  # the int64 buffer stays int64


@pytest.mark.parametrize("robust", [None, "median", "clip"])
@pytest.mark.parametrize("bad", [np.array(["a", "b"]), np.array([object(), 1.0], dtype=object)])
def test_object_and_str_arrays_are_rejected_without_a_type_error(robust, bad):
    # issue 40 point 3: object/str arrays crashed the server loop with TypeError when robust was on
    agg = aggregator(robust=robust, clip_norm=None if robust is None else 1e3)
    agg.accept(site("a", 0.5))
    assert agg.accept(site("d", 1.0, **{"f.small": bad})) is False  # no exception
    agg.accept(site("b", 1.5))
    agg.accept(site("c", 1.0))
    assert set(agg.rejected) == {"d"}
    assert_honest(agg.aggregate().params)


def test_a_head_in_integers_is_rejected_without_a_reference_too():
    ups = [site("a", 0.5), site("b", 1.5, **{W: np.ones((1, 2), np.int64)})]
    with pytest.raises(Exception, match="site b: .*dtype"):
        surgical_aggregate(ups)


# ---------------------------------------------------------------------------- sample counts
def test_a_huge_sample_count_is_rejected_and_the_mean_stays_honest():
    # issue 40 point 6: a site claiming 10**12 images set the model under weighting: samples
    agg = aggregator(weighting="samples")
    accept_all(agg, [site("a", 0.5), site("b", 1.5), site("c", 1e6, n=10**12)])
    assert set(agg.rejected) == {"c"} and "num_samples" in agg.rejected["c"]
    assert_honest(agg.aggregate().params)


def test_a_changed_sample_count_is_rejected_in_a_later_round():
    # issue 40 point 6: the count a site reports first is the one it must keep (the split is fixed)
    agg = aggregator(weighting="samples")
    accept_all(agg, [site("a", 0.5, n=10), site("b", 1.5, n=10)])
    agg.aggregate()
    ref = reference()
    agg.expect({k: v.shape for k, v in ref.items() if not k.startswith("classifier.")}, None, ["x"], ref)
    accept_all(agg, [site("a", 0.5, n=10), site("b", 1e3, n=10_000), site("c", 1.5, n=10)])
    assert set(agg.rejected) == {"b"} and "num_samples" in agg.rejected["b"]
    assert_honest(agg.aggregate().params)


# -------------------------------------------------------------------------- BatchNorm variances
VAR = "f.bn.running_var"


@pytest.mark.parametrize("robust", [None, "median", "clip"])
def test_a_negative_batchnorm_variance_is_rejected_and_the_model_stays_usable(robust):
    # issue 40, hostile benchmark: one sign-flipped site among five made 26 running variances of the
    # global model negative and every site's validation failed (NaN) in the next round, with or without
    # clipping (the flipped update has an honest norm). Previous variance 1; the hostile site c flips
    # an honest update of 9: 1 - (9 - 1) = -7. The plain mean of a, b, c would be (0.5 + 0.5 - 7) / 3 = -2.
    agg = RoundAggregator(warning=lambda _: None, bn_keys=(VAR,), robust=robust)
    ref = {**reference(), VAR: np.ones(4, np.float32)}
    agg.expect({k: v.shape for k, v in ref.items() if not k.startswith("classifier.")}, None, ["x"], ref)
    honest = {VAR: np.full(4, 0.5, np.float32)}
    flipped = {VAR: np.array([1.0, 1.0, -7.0, 1.0], np.float32)}
    accept_all(agg, [site("a", 1.0, **honest), site("b", 1.0, **honest), site("c", 1.0, **flipped)])
    assert set(agg.rejected) == {"c"}
    assert VAR in agg.rejected["c"] and "negative" in agg.rejected["c"] and "-7" in agg.rejected["c"]
    out = agg.aggregate().params
    assert_honest(out)
    torch.testing.assert_close(torch.as_tensor(np.asarray(out[VAR])), torch.full((4,), 0.5), rtol=0, atol=0)


def test_a_zero_variance_is_accepted_and_torch_tensors_are_checked_too():
    from cxrfl.core.updates import validate_update
    from cxrfl.errors import UpdateRejected

    ok = site("a", 1.0, **{VAR: torch.zeros(4)})
    ok["params"] = {k: torch.as_tensor(v) for k, v in ok["params"].items()}
    validate_update(ok)  # a channel that never varied has variance 0: valid
    bad = dict(ok, params={**ok["params"], VAR: torch.tensor([0.0, -1e-3, 0.0, 0.0])})
    with pytest.raises(UpdateRejected, match=r"site a: BatchNorm running variance 'f.bn.running_var' has negative"):
        validate_update(bad)


# ------------------------------------------------------------------------------- robust modes
def test_median_of_two_falls_back_to_clipping_around_the_reference():
    # issue 40 point 6: the median of two sites is their mean; documented fallback: clip (clip_norm)
    agg = aggregator(robust="median", clip_norm=1.0)
    hostile = site("b", 1e6)
    accept_all(agg, [site("a", 0.5), hostile])
    out = agg.aggregate().params
    # body: a's delta 0.5 * sqrt(4098) > 1 is clipped too; every clipped delta has norm <= 1
    body = np.concatenate([np.asarray(out["f.big"]).ravel(), np.asarray(out["f.small"]).ravel()])
    assert np.linalg.norm(body) <= 1.0 + 1e-5
    row = np.concatenate([np.asarray(out[W]).ravel(), np.asarray(out[B])])
    assert np.linalg.norm(row) <= 1.0 + 1e-5  # reference row 0: the mean of two clipped deltas


def test_clip_norm_is_adaptive_when_null_and_refused_when_not_positive():
    assert SurgicalConfig(robust="median").clip_norm is None  # the round's lower median update norm
    with pytest.raises(ConfigError, match="clip_norm"):
        SurgicalConfig(robust="median", clip_norm=-1.0)


def test_median_of_three_or_more_is_the_median():
    agg = aggregator(robust="median", clip_norm=1e-3)
    accept_all(agg, [site("a", 0.5), site("b", 1.0), site("c", 1e6)])
    assert_honest(agg.aggregate().params)


def test_each_update_norm_is_recorded_and_a_scaled_site_is_named_in_a_warning():
    # issue 40 point 3 ("nothing records it"): without a robust option a x100 update is averaged in (the
    # hostile-site benchmark: every site failed in the next round); the round record now keeps each site's
    # update norm and one warning line names the site whose norm passes 10x the round's median
    from cxrfl.surgical.records import round_record

    lines: list[str] = []
    agg = aggregator()
    agg.warning = lines.append
    accept_all(agg, [site("a", 1.0), site("b", 1.0), site("c", 1.0), site("d", 100.0)])
    result = agg.aggregate()
    honest = np.sqrt(64 * 64 + 2 + 2 + 1)  # every float value moved by 1 (the int counter is not a weight)
    norms = round_record(1, "train", list("abcd"), {}, result, {})["update_norm"]
    assert norms == pytest.approx({"a": honest, "b": honest, "c": honest, "d": 100 * honest})
    assert lines == [
        f"site d: its update norm {100 * honest:.4g} is 100x the round's median ({honest:.4g}); a scaled or broken "
        "update: check that site (robust: median or clip bounds it)"
    ]
    agg = aggregator()
    agg.warning = lines.append
    accept_all(agg, [site("a", 1.0), site("b", 2.0), site("c", 9.0)])  # 9x the median: spread, not an outlier
    agg.aggregate()
    assert len(lines) == 1


# -------------------------------------------------------------- server: warm-up and late join
class ScriptedSites:
    """Answers the surgical tasks without training: each site returns what it received plus its own
    head rows (``rows``: site -> value of its class's row); ``down``: sites that miss the warm-up."""

    def __init__(self, rows: dict[str, float], down: tuple[str, ...] = ()) -> None:
        self.rows = rows
        self.down = set(down)

    def __call__(self, task, payloads, *, on_answer=None):
        out = {}
        for s, (params, meta) in payloads.items():
            warm = meta.get("phase") == "warmup"
            if warm and meta["round"] == 0 and s in self.down:
                continue
            answer = self.answer(s, params, meta, task, warm)
            if on_answer is not None:
                on_answer(s, answer)
                answer = ({}, answer[1])
            out[s] = answer
        return out

    def answer(self, s, params, meta, task, warm):
        if task != "train":
            return {}, {"metrics": {"loss": 1.0, "mean_auroc": 0.5}}
        out = {k: np.array(v, copy=True) for k, v in params.items()}
        if warm:
            n_in = out["backbone.norm5.weight"].shape[0]
            out[W] = np.full((1, n_in), self.rows[s], np.float32)
            out[B] = np.full(1, self.rows[s], np.float32)
        return out, {"classes": [f"class-{s}"], "num_samples": 10, "metrics": {"val_loss": 1.0, "val_mean_auroc": 0.5}}


def run_server(tmp_path, send, **kw) -> SurgicalServer:
    cfg = SurgicalConfig(
        num_rounds=kw.pop("num_rounds", 0),
        min_clients=1,
        model_config=MODEL,
        robust="clip",
        clip_norm=1.0,
        min_clients_timeout=0,
        retry_pause=0,
        evaluate_test=False,
        **kw,
    )
    server = SurgicalServer(
        send, config=cfg, sites=["a", "b", "c"], out_dir=tmp_path, warning=lambda _: None, info=lambda _: None
    )
    server.run()
    return server


def head_row_norms(path) -> dict[str, float]:
    ckpt = load_checkpoint(path)
    w, b = ckpt["model"][W], ckpt["model"][B]
    return {c: float(torch.linalg.vector_norm(torch.cat([w[i], b[i : i + 1]]))) for i, c in enumerate(ckpt["classes"])}


def test_clip_bounds_a_hostile_head_row_in_the_warmup(tmp_path):
    # issue 40 point 6: with robust: clip the warm-up aggregation was a plain mean (a 1e6 row kept)
    run_server(tmp_path, ScriptedSites({"a": 0.01, "b": 0.01, "c": 1e6}))
    norms = head_row_norms(tmp_path / "FL_global_model.pt")
    assert norms["class-c"] <= 1.0 + 1e-5 and norms["class-a"] < 1.0


def test_clip_bounds_a_hostile_head_row_of_a_late_joiner(tmp_path):
    # issue 40 point 6: with robust: clip the late-join aggregation was a plain mean (a 1e6 row kept)
    run_server(tmp_path, ScriptedSites({"a": 0.01, "b": 0.01, "c": 1e6}, down=("c",)), num_rounds=1)
    joins = [r for r in read_records(tmp_path / "cxrfl" / "rounds.jsonl") if r["phase"] == "join"]
    assert joins and joins[0]["joined"] == ["c"]
    assert head_row_norms(tmp_path / "FL_global_model.pt")["class-c"] <= 1.0 + 1e-5


def test_a_rejected_warmup_result_is_in_the_round_record(tmp_path):
    class ComplexC(ScriptedSites):
        def answer(self, s, params, meta, task, warm):
            out, m = super().answer(s, params, meta, task, warm)
            if s == "c" and task == "train":
                out[B] = out[B].astype(np.complex64)
            return out, m

    run_server(tmp_path, ComplexC({"a": 0.01, "b": 0.01, "c": 0.01}))
    warm = next(r for r in read_records(tmp_path / "cxrfl" / "rounds.jsonl") if r["phase"] == "warmup")
    assert list(warm["rejected"]) == ["c"] and warm["sites_aggregated"] == ["a", "b"]


# ------------------------------------------------------------------------------------- CWT
@pytest.mark.parametrize(
    "bad", [np.full(2, 1 + 1j, np.complex64), np.full(2, np.nan, np.float32), np.ones(2, np.float64)]
)
def test_cwt_refuses_a_complex_nan_or_retyped_model(tmp_path, bad):
    # issue 40 point 3: CWT takes a site's returned model as the next site's start
    server = CWTServer(lambda *a, **k: {}, sites=["a"], config=CWTConfig(), model_config=MODEL, out_dir=tmp_path)
    plan = RelayPlan(["a"], ["x"], {"a": Visit(1, 0.1)}, {"a": {"n_train": 5}})
    sent = {"w": np.zeros(2, np.float32), W: np.zeros((1, 2), np.float32), B: np.zeros(1, np.float32)}
    answer = ({**sent, "w": bad}, {})
    assert "unusable result" in server._check(answer, "a", plan, sent)
    complex_opt = ({**sent, "__optimizer__.0.exp_avg": np.ones(2, np.complex64)}, {})
    assert "optimizer" in server._check(complex_opt, "a", plan, sent)


# ----------------------------------------------------------------------------------- FedFew
def fedfew_server(tmp_path, **config) -> FedFewServer:
    return FedFewServer(
        lambda *a, **k: {},
        sites=["a", "b", "c"],
        config=FedFewConfig(**config),
        model_config=MODEL,
        out_dir=tmp_path,
        warning=lambda _: None,
    )


@pytest.mark.parametrize("bad", [np.full(2, 1 + 1j, np.complex64), np.full(2, np.nan, np.float32)])
def test_fedfew_rejects_a_complex_or_nan_update(tmp_path, bad):
    # issue 40 point 3: the same validation for FedFew's FedAvg
    server = fedfew_server(tmp_path)
    ref = {"w": np.zeros(2, np.float32)}
    results = {
        "a": ({"w": np.full(2, 0.5, np.float32)}, {"num_samples": 10}),
        "b": ({"w": np.full(2, 1.5, np.float32)}, {"num_samples": 10}),
        "c": ({"w": bad}, {"num_samples": 10}),
    }
    agg, rejected, used = fedfew_fedavg(server, results, {"w": (2,)}, 1, reference=ref, task="ssl")
    assert list(rejected) == ["c"] and used == ["a", "b"]
    torch.testing.assert_close(torch.as_tensor(agg["w"]), torch.ones(2), rtol=0, atol=0)


def test_fedfew_clip_and_count_cap(tmp_path):
    # issue 40 point 6: FedFew had no robust option and trusted the reported counts
    server = fedfew_server(tmp_path, robust="clip", clip_norm=1.0)
    ref = {"w": np.zeros(2, np.float32)}
    results = {
        "a": ({"w": np.zeros(2, np.float32)}, {"num_samples": 10}),
        "b": ({"w": np.full(2, 1e6, np.float32)}, {"num_samples": 10}),
        "c": ({"w": np.full(2, 1e6, np.float32)}, {"num_samples": 10**12}),
    }
    agg, rejected, used = fedfew_fedavg(server, results, {"w": (2,)}, 1, reference=ref, task="ssl")
    assert list(rejected) == ["c"] and "num_samples" in rejected["c"]
    assert np.linalg.norm(agg["w"]) <= 0.5 + 1e-6  # b's delta clipped to norm 1, averaged with a's 0


def test_fedfew_clip_norm_is_adaptive_when_null_and_refused_when_not_positive():
    assert FedFewConfig(robust="median").clip_norm is None
    with pytest.raises(ConfigError, match="clip_norm"):
        FedFewConfig(robust="median", clip_norm=0.0)
