"""Issue 43 point 1: the shared federated core (cxrfl.core), head-agnostic: a head-less update validates
without any stand-in head, a result is rejected whole before any of it reaches the sum, and FedFew's
FedAvg streams through the same aggregator. Expectations are computed by hand on small arrays."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import fedfew_fedavg
from cxrfl.core.fedavg import fedavg
from cxrfl.core.streaming import StreamingFedAvg
from cxrfl.core.update_change import change_sq, compare_to_sent
from cxrfl.core.updates import SampleCounts, validate_update
from cxrfl.errors import UpdateRejected
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.server import FedFewServer
from cxrfl.nn.models import ModelConfig

W, B = "classifier.weight", "classifier.bias"
BIG = (64, 64)  # 4096 elements: summed on its own (cxrfl.core.updates.SMALL)
SHAPES = {"f.big": BIG, "f.small": (2,), "f.n": ()}


def params(value: float) -> dict[str, np.ndarray]:
    return {
        "f.big": np.full(BIG, value, np.float32),
        "f.small": np.full(2, value, np.float32),
        "f.n": np.array(int(value), np.int64),
    }


def test_a_headless_update_validates_without_classes_and_its_keys_are_all_checked():
    validate_update({"site": "a", "params": params(1.0), "num_samples": 3}, expected_shapes=SHAPES, head_prefix=None)
    with_head = {**params(1.0), W: np.zeros((1, 2), np.float32), B: np.zeros(1, np.float32)}
    with pytest.raises(UpdateRejected, match="unexpected parameter"):  # no head: a head key is just an extra key
        validate_update({"site": "a", "params": with_head, "num_samples": 3}, expected_shapes=SHAPES, head_prefix=None)
    with pytest.raises(UpdateRejected, match="missing field.*'classes'"):  # with a head, classes are needed
        validate_update({"site": "a", "params": with_head, "num_samples": 3})


def test_headless_fedavg_is_the_hand_computed_weighted_mean():
    updates = [
        {"site": "a", "params": params(1.0), "num_samples": 1},
        {"site": "b", "params": params(5.0), "num_samples": 3},
    ]
    out = fedavg(updates, weighting="samples")
    assert list(out) == list(SHAPES)
    np.testing.assert_array_equal(out["f.big"], np.full(BIG, 4.0, np.float32))  # (1 * 1 + 3 * 5) / 4
    np.testing.assert_array_equal(out["f.small"], np.full(2, 4.0, np.float32))
    assert out["f.n"].dtype == np.int64 and int(out["f.n"]) == 4
    stream = StreamingFedAvg(weighting="samples")
    stream.expect(SHAPES)
    assert all(stream.accept(u) is not None for u in updates)
    assert all(p.params == {} for p in stream.accepted)  # summed as they arrived, then dropped
    streamed = stream.aggregate()
    for k in out:
        np.testing.assert_array_equal(streamed[k], out[k], err_msg=k)
    uniform = fedavg(updates)
    np.testing.assert_array_equal(uniform["f.big"], np.full(BIG, 3.0, np.float32))


@pytest.mark.parametrize(
    "key, bad, reason",
    [
        ("f.small", np.full(2, 1 + 1j, np.complex64), "dtype complex64"),
        ("f.small", np.array([1.0, np.nan], np.float32), "non-finite"),  # a small array, after f.big
        ("f.big", np.ones(BIG, np.int32), "dtype int32"),
    ],
)
@pytest.mark.parametrize("robust", [None, "median", "clip"])
def test_a_bad_result_is_rejected_whole_and_never_touches_the_sum(key, bad, reason, robust):
    stream = StreamingFedAvg(weighting="uniform", robust=robust, clip_norm=None, counts=SampleCounts())
    ref = params(0.0)
    stream.expect(SHAPES, reference=ref)
    good = [("a", 1.0), ("b", 2.0), ("d", 3.0)]
    assert stream.accept({"site": "a", "params": params(1.0), "num_samples": 5}) is not None
    summed_before = None if stream.running is None else {k: v.clone() for k, v in stream.running.sums().items()}
    assert stream.accept({"site": "c", "params": {**params(1e6), key: bad}, "num_samples": 5}) is None
    assert list(stream.rejected) == ["c"] and reason in stream.rejected["c"] and "site c" in stream.rejected["c"]
    assert stream.accepted_sites == ["a"] and "c" not in stream.counts.first  # nothing of c is kept
    if robust is None:  # the running sum holds a's values only
        assert [s for s, _ in stream.running.added] == ["a"]
        for k, v in stream.running.sums().items():
            torch.testing.assert_close(v, summed_before[k], rtol=0, atol=0)
    for site, value in good[1:]:
        assert stream.accept({"site": site, "params": params(value), "num_samples": 5}) is not None
    out = stream.aggregate()
    if robust is None or robust == "median":  # mean and median of 1, 2, 3 are 2: c left no trace
        np.testing.assert_array_equal(out["f.big"], np.full(BIG, 2.0, np.float32))
    else:  # adaptive clip: every update bounded by the lower median norm (b's), none ever c's 1e6
        assert float(np.abs(out["f.big"]).max()) <= 2.0
    assert stream.accepted == [] and stream.running is None  # forgotten after aggregation


def test_accept_is_atomic_for_a_malformed_mapping_and_a_capped_count():
    stream = StreamingFedAvg(counts=SampleCounts(cap=10))
    stream.expect(SHAPES)
    assert stream.accept({"site": "a", "params": params(1.0), "num_samples": 11}) is None
    assert "cap" in stream.rejected["a"] and stream.running is None
    assert stream.accept({"site": "b", "params": "not a mapping", "num_samples": 1}) is None
    assert stream.accepted == [] and set(stream.rejected) == {"a", "b"}
    with pytest.raises(UpdateRejected, match="no valid site result"):
        stream.aggregate()


def fedfew_server(tmp_path, **config) -> FedFewServer:
    return FedFewServer(
        lambda *a, **k: {},
        sites=["a", "b", "c"],
        config=FedFewConfig(**config),
        model_config=ModelConfig(arch="densenet-tiny", image_size=32),
        out_dir=tmp_path,
        warning=lambda _: None,
    )


def stage2(value: float) -> dict[str, np.ndarray]:
    """A stage-2 model: a feature extractor and the head over every CC (+ "no CC"), held whole by each site."""
    return {
        "f.w": np.full(3, value, np.float32),
        W: np.full((2, 3), value, np.float32),
        B: np.full(2, value, np.float32),
    }


def test_fedfew_fedavg_is_the_hand_computed_mean_over_every_key(tmp_path):
    server = fedfew_server(tmp_path)
    expected = {k: v.shape for k, v in stage2(0.0).items()}
    results = {"a": (stage2(1.0), {"num_samples": 1}), "b": (stage2(3.0), {"num_samples": 3})}
    agg, rejected, used = fedfew_fedavg(server, results, expected, 2, reference=stage2(0.0), task="stage2")
    assert rejected == {} and used == ["a", "b"]
    for k, v in agg.items():  # weighted by images: (1 * 1 + 3 * 3) / 4 = 2.5, the head like the rest
        np.testing.assert_array_equal(v, np.full(expected[k], 2.5, np.float32), err_msg=k)
    results["c"] = (stage2(9.0), {"num_samples": 1})
    agg, rejected, used = fedfew_fedavg(server, results, expected, 4, reference=stage2(0.0), task="stage2")
    assert agg is None and used == ["a", "b", "c"]  # fewer than needed: no average


def test_fedfew_clip_bounds_one_norm_over_the_whole_update(tmp_path):
    # the behaviour issue 43 point 1 names: FedFew's head is plain FedAvg, so clip takes one norm over the
    # feature extractor and the head together (surgical aggregation clips each head row on its own)
    server = fedfew_server(tmp_path, robust="clip", clip_norm=1.0)
    expected = {k: v.shape for k, v in stage2(0.0).items()}
    results = {"a": (stage2(0.0), {"num_samples": 1}), "b": (stage2(1.0), {"num_samples": 1})}
    agg, _, _ = fedfew_fedavg(server, results, expected, 1, reference=stage2(0.0), task="stage2")
    norm_b = np.sqrt(3 + 6 + 2)  # b's update: 11 ones
    for k, v in agg.items():  # b clipped to norm 1 as a whole, averaged with a's zero update
        np.testing.assert_allclose(v, np.full(expected[k], 0.5 / norm_b), rtol=1e-6, err_msg=k)


@pytest.mark.filterwarnings("error")  # torch warns once per process about read-only arrays: none may reach it
def test_the_change_of_a_received_read_only_result_is_measured_in_float64():
    sent = {"w": np.array([1.0, 2.0, 3.0, 4.0], np.float32), "n": np.array(5, np.int64)}
    raw = np.array([1.0, 2.5, 3.0, 1e8 + 1.0], np.float32).tobytes()
    received = {"w": np.frombuffer(raw, np.float32), "n": np.array(6, np.int64)}  # as decoded: read-only
    assert not received["w"].flags.writeable
    delta = np.array([0.0, 0.5, 0.0, np.float64(np.float32(1e8 + 1.0)) - 4.0])  # exact in float64
    share, norm = compare_to_sent(received, sent)
    assert share == 0.5 and norm == pytest.approx(float(np.sqrt(np.sum(delta**2))), rel=1e-15)
    bf16 = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)  # a dtype numpy lacks
    assert change_sq(bf16, torch.zeros(2, dtype=torch.bfloat16)) == pytest.approx(5.0, rel=1e-12)
