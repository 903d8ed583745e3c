"""Surgical aggregation on tiny hand-made parameter dicts, checked against hand-computed values
and against NVFlare's own weighted aggregation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cxrfl.core.updates import validate_update
from cxrfl.errors import UpdateRejected
from cxrfl.surgical.aggregation import surgical_aggregate
from cxrfl.surgical.head_modes import site_payload
from nvflare.app_common.aggregators.weighted_aggregation_helper import WeightedAggregationHelper

W, B = "classifier.weight", "classifier.bias"


def update(site, head, body, n=1):
    """head: {class: ([row...], bias)} in the site's row order; body: name -> array-like."""
    classes = list(head)
    params = {k: np.asarray(v, dtype=np.float32) for k, v in body.items()}
    params[W] = np.array([head[c][0] for c in classes], dtype=np.float32)
    params[B] = np.array([head[c][1] for c in classes], dtype=np.float32)
    return {"site": site, "classes": classes, "params": params, "num_samples": n}


def three_sites():
    """Shared (y: all three), partially shared (x: a and c) and unique classes (w: c, z: b)."""
    return [
        update("a", {"x": ([1, 0], 1), "y": ([0, 2], 2)}, {"f.w": [[1, 2], [3, 4]], "f.b": [1]}, n=1),
        update("b", {"y": ([4, 4], 4), "z": ([6, 0], 6)}, {"f.w": [[3, 2], [1, 0]], "f.b": [4]}, n=2),
        update("c", {"x": ([3, 2], 3), "y": ([2, 0], 0), "w": ([9, 9], 9)}, {"f.w": [[2, 2], [2, 2]], "f.b": [7]}, n=5),
    ]


def to_torch(u):
    return {**u, "params": {k: torch.from_numpy(np.array(v)) for k, v in u["params"].items()}}


def test_uniform_shared_partial_and_unique_classes():
    params, classes = surgical_aggregate(three_sites())
    assert classes == ["w", "x", "y", "z"]  # sorted union
    np.testing.assert_allclose(params["f.w"], [[2, 2], [2, 2]])
    np.testing.assert_allclose(params["f.b"], [4])
    # w: only site c; x: mean of a and c; y: mean of all three; z: only site b
    np.testing.assert_allclose(params[W], [[9, 9], [2, 1], [2, 2], [6, 0]])
    np.testing.assert_allclose(params[B], [9, 2, 2, 6])
    assert params[W].dtype == np.float32 and list(params) == ["f.w", "f.b", W, B]


def test_sample_weighting():
    params, classes = surgical_aggregate(three_sites(), weighting="samples")  # n = 1, 2, 5
    np.testing.assert_allclose(params["f.w"], np.array([[17, 16], [15, 14]]) / 8, rtol=1e-6)
    np.testing.assert_allclose(params["f.b"], [44 / 8], rtol=1e-6)
    expected_w = [[9, 9], [16 / 6, 10 / 6], [18 / 8, 10 / 8], [6, 0]]
    np.testing.assert_allclose(params[W], expected_w, rtol=1e-6)
    np.testing.assert_allclose(params[B], [9, 16 / 6, 10 / 8, 6], rtol=1e-6)


def test_unique_class_keeps_its_row_exactly():
    rng = np.random.default_rng(0)
    row = rng.normal(size=5).astype(np.float32)
    ups = [
        update("a", {"rare": (row, 0.123456789)}, {"f": rng.normal(size=3)}),
        update("b", {"common": (np.ones(5), 1.0)}, {"f": rng.normal(size=3)}, n=7),
    ]
    params, classes = surgical_aggregate(ups, weighting="samples")
    assert classes == ["common", "rare"]
    assert np.array_equal(params[W][1], row)
    assert params[B][1] == np.float32(0.123456789)


def test_explicit_class_order_and_unknown_class():
    params, classes = surgical_aggregate(
        three_sites(),
        classes=["z", "y", "x", "w", "extra"],
        reference={W: np.full((5, 2), 7.0, np.float32), B: np.full(5, 7.0, np.float32)},
    )
    assert classes == ["z", "y", "x", "w", "extra"]
    np.testing.assert_allclose(params[W], [[6, 0], [2, 2], [2, 1], [9, 9], [7, 7]])  # extra: reference row
    np.testing.assert_allclose(params[B], [6, 2, 2, 9, 7])
    with pytest.raises(ValueError, match="no site sent class 'extra'"):
        surgical_aggregate(three_sites(), classes=["z", "y", "x", "w", "extra"])
    with pytest.raises(UpdateRejected, match=r"site c: .*\['w'\].*never announced"):
        surgical_aggregate(three_sites(), classes=["x", "y", "z"])


def with_bn(u, mean, count, var=1.0):
    u["params"]["f.norm1.running_mean"] = np.full(2, mean, np.float32)
    u["params"]["f.norm1.running_var"] = np.full(2, var, np.float32)
    u["params"]["f.norm1.num_batches_tracked"] = np.array(count, dtype=np.int64)
    return u


BN_KEYS = ["f.norm1.running_mean", "f.norm1.running_var", "f.norm1.num_batches_tracked"]


def test_batchnorm_fedavg_averages_bn_keys():
    ups = [with_bn(u, m, c) for u, m, c in zip(three_sites(), (0.0, 3.0, 6.0), (10, 20, 31))]
    params, _ = surgical_aggregate(ups, bn_keys=BN_KEYS, batchnorm="fedavg")
    np.testing.assert_allclose(params["f.norm1.running_mean"], [3, 3])
    # integer buffer: weighted mean rounded to the nearest integer, dtype kept: (10 + 20 + 31) / 3 = 20.33
    assert params["f.norm1.num_batches_tracked"] == 20
    assert params["f.norm1.num_batches_tracked"].dtype == np.int64
    params, _ = surgical_aggregate(ups, bn_keys=BN_KEYS, weighting="samples")
    assert params["f.norm1.num_batches_tracked"] == round((10 + 40 + 155) / 8)  # 25.6 -> 26


@pytest.mark.parametrize("mode", ["fedbn", "fedbn+"])
def test_batchnorm_local_modes_leave_bn_keys_out(mode):
    ups = [with_bn(u, m, c) for u, m, c in zip(three_sites(), (0.0, 3.0, 6.0), (10, 20, 31))]
    params, _ = surgical_aggregate(ups, bn_keys=BN_KEYS, batchnorm=mode)
    assert set(params) == {"f.w", "f.b", W, B}
    np.testing.assert_allclose(params["f.w"], [[2, 2], [2, 2]])
    # sites may also keep their BatchNorm entries to themselves (and may differ in them)
    ups[0]["params"] = {k: v for k, v in ups[0]["params"].items() if k not in BN_KEYS}
    ups[1]["params"]["f.norm1.running_mean"] = np.zeros(7, np.float32)
    params2, _ = surgical_aggregate(ups, bn_keys=BN_KEYS, batchnorm=mode)
    assert set(params2) == set(params)


def test_payload_rows_in_site_order():
    params, classes = surgical_aggregate(three_sites())
    payload = site_payload(params, classes, ["z", "x"])
    assert list(payload) == ["f.w", "f.b", W, B]
    np.testing.assert_allclose(payload[W], [[6, 0], [2, 1]])
    np.testing.assert_allclose(payload[B], [6, 2])
    assert payload["f.w"] is params["f.w"]
    torch_params = {k: torch.from_numpy(v) for k, v in params.items()}
    tp = site_payload(torch_params, classes, ["y"])
    assert torch.equal(tp[W], torch.tensor([[2.0, 2.0]])) and torch.equal(tp[B], torch.tensor([2.0]))
    with pytest.raises(ValueError, match="'Hernia'.*not in the global"):
        site_payload(params, classes, ["x", "Hernia"])
    with pytest.raises(ValueError, match="duplicate"):
        site_payload(params, classes, ["x", "x"])


def random_sites(rng, n_sites, classes, kind):
    ups = []
    for i in range(n_sites):
        body = {
            "conv.weight": rng.normal(size=(4, 3, 3, 3)),
            "norm.running_var": rng.random(4) + 0.5,
            "fc.bias": rng.normal(size=6),
        }
        head = {c: (rng.normal(size=6), rng.normal()) for c in classes}
        u = update(f"site-{i}", head, body, n=int(rng.integers(1, 500)))
        ups.append(to_torch(u) if kind == "torch" else u)
    return ups


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_identical_class_sets_equal_nvflare_fedavg(kind, weighting):
    rng = np.random.default_rng(42)
    ups = random_sites(rng, 4, ["a", "b", "c"], kind)
    ours, classes = surgical_aggregate(ups, weighting=weighting)
    helper = WeightedAggregationHelper()
    for u in ups:
        data = {k: (v.clone() if kind == "torch" else v.copy()) for k, v in u["params"].items()}
        helper.add(data, u["num_samples"] if weighting == "samples" else 1, u["site"], 0)
    theirs = helper.get_result()
    assert classes == ["a", "b", "c"] and set(ours) == set(theirs)
    for k in theirs:
        assert isinstance(ours[k], torch.Tensor if kind == "torch" else np.ndarray)
        np.testing.assert_allclose(np.asarray(ours[k]), np.asarray(theirs[k]), rtol=1e-5, atol=1e-6)


def test_torch_and_numpy_inputs_give_the_same_result():
    ups = three_sites()
    ref, _ = surgical_aggregate(ups, weighting="samples")
    tparams, _ = surgical_aggregate([to_torch(u) for u in ups], weighting="samples")
    for k, v in ref.items():
        assert isinstance(tparams[k], torch.Tensor) and tparams[k].dtype == torch.float32
        np.testing.assert_allclose(tparams[k].numpy(), v)
    gen_params, _ = surgical_aggregate(u for u in three_sites())  # a one-shot iterator works too
    np.testing.assert_allclose(gen_params[W], surgical_aggregate(three_sites())[0][W])


def good():
    return update("h1", {"x": ([1, 2], 0), "y": ([3, 4], 0)}, {"f": [1.0, 2.0]}, n=10)


SHAPES = {"f": (2,), W: (5, 2), B: (5,)}


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda u: u["params"].__setitem__("f", np.array([np.nan, 1], np.float32)), "non-finite"),
        (lambda u: u["params"].__setitem__(W, np.array([[1, np.inf], [0, 0]], np.float32)), "non-finite"),
        (lambda u: u["params"].__setitem__("f", np.zeros(3, np.float32)), r"'f' has shape \(3,\), expected \(2,\)"),
        (lambda u: u["params"].pop("f"), r"missing parameter\(s\) 'f'"),
        (lambda u: u["params"].__setitem__("g", np.zeros(1, np.float32)), r"unexpected parameter\(s\) 'g'"),
        (lambda u: u["params"].__setitem__(W, np.zeros((3, 2), np.float32)), "one row per class"),
        (lambda u: u["params"].__setitem__(B, np.zeros(3, np.float32)), "head bias"),
        (lambda u: u["params"].__setitem__(W, np.zeros((2, 4), np.float32)), "4 inputs, expected 2"),
        (lambda u: u.__setitem__("classes", ["x", "Hernia"]), r"\['Hernia'\].*never announced"),
        (lambda u: u.__setitem__("classes", ["x", "x"]), r"duplicate class names \['x'\]"),
        (lambda u: u.__setitem__("num_samples", 0), "num_samples must be a positive integer"),
        (lambda u: u.__setitem__("num_samples", -5), "num_samples must be a positive integer"),
        (lambda u: u.__setitem__("num_samples", 2.5), "num_samples must be a positive integer"),
        (lambda u: u.pop("classes"), "missing field"),
    ],
)
def test_validate_update_rejections(mutate, reason):
    validate_update(good(), expected_shapes=SHAPES, announced_classes=["x", "y", "z"])  # the good one passes
    u = good()
    mutate(u)
    with pytest.raises(UpdateRejected, match=rf"^site h1: .*{reason}"):
        validate_update(u, expected_shapes=SHAPES, announced_classes=["x", "y", "z"])


def test_validate_update_torch_nan():
    u = to_torch(good())
    u["params"]["f"][1] = float("nan")
    with pytest.raises(UpdateRejected, match="site h1: non-finite values"):
        validate_update(u)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_finiteness_check_is_exact_behind_the_cheap_sums(kind):
    """Small arrays are summed together and large ones one by one; an overflowing sum of finite
    values is not a rejection, and the key named is the first bad one in the update's order."""
    big = np.full((64, 128), 3e38, np.float32)  # large (summed alone): finite, its sum overflows
    small = {f"f.s{i}": np.full((4,), 3e38, np.float32) for i in range(3)}  # small: their joint sum overflows
    params = {
        "f.big": big,
        **small,
        "f.n": np.zeros(3, np.int64),
        W: np.ones((1, 2), np.float32),
        B: np.ones(1, np.float32),
    }
    u = {"site": "h1", "classes": ["x"], "params": params, "num_samples": 1}
    conv = (lambda u: to_torch(u)) if kind == "torch" else (lambda u: u)
    validate_update(conv(u))  # finite everywhere: accepted
    for key in ("f.big", "f.s1", B):
        bad = {**params, **{k: v.copy() for k, v in params.items()}}
        bad[key].reshape(-1)[-1] = np.nan
        bad["f.s2"].reshape(-1)[0] = -np.inf  # a later key is bad too: the first one is named
        if key == B:
            bad["f.s2"].reshape(-1)[0] = 3e38
        with pytest.raises(UpdateRejected, match=rf"^site h1: non-finite values \(NaN or Inf\) in '{key}'$"):
            validate_update(conv({**u, "params": bad}))


def test_mean_of_large_small_and_mixed_dtype_arrays_matches_the_plain_mean():
    """Large arrays are added one by one, small ones as one flat array per dtype: same means."""
    rng = np.random.default_rng(0)
    shapes = {"big": (80, 64), "s16": (3,), "s32": (2, 2), "s64": (5,), "n": ()}
    dtypes = {"big": np.float32, "s16": np.float16, "s32": np.float32, "s64": np.float64, "n": np.int64}
    ups = []
    for i, site in enumerate("abc"):
        body = {k: np.asarray((rng.normal(size=shapes[k]) * 10 + 20).astype(dtypes[k])) for k in shapes}
        params = {**body, W: np.ones((1, 2), np.float32), B: np.ones(1, np.float32)}
        ups.append({"site": site, "classes": ["x"], "params": params, "num_samples": i + 1})
    for kind in ("numpy", "torch"):
        out, _ = surgical_aggregate([to_torch(u) for u in ups] if kind == "torch" else ups, weighting="samples")
        for k in shapes:
            got = np.asarray(out[k])
            assert got.dtype == dtypes[k] and got.shape == shapes[k], (kind, k)
            want = sum(w * np.asarray(u["params"][k], np.float64) for w, u in zip((1 / 6, 2 / 6, 3 / 6), ups))
            want = np.round(want) if k == "n" else want
            np.testing.assert_allclose(got, want, rtol=2e-3 if k == "s16" else 1e-5, err_msg=f"{kind} {k}")
    ups[1]["params"]["s32"] = ups[1]["params"]["s32"].astype(np.float64)  # issue 40: another float dtype is refused
    with pytest.raises(UpdateRejected, match="site b: parameter 's32' has dtype float64, expected float32"):
        surgical_aggregate(ups, weighting="samples")


def test_normalize_shapes_once_for_many_updates():
    from cxrfl.core.updates import normalize_shapes

    shapes = normalize_shapes({"f": [np.int64(3)], W: torch.Size([1, 2])})
    assert dict(shapes) == {"f": (3,), W: (1, 2)} and all(type(d) is int for s in shapes.values() for d in s)
    assert normalize_shapes(shapes) is shapes
    u = good()
    u["params"]["f"] = np.zeros(4, np.float32)
    with pytest.raises(UpdateRejected, match=r"'f' has shape \(4,\), expected \(3,\)"):
        validate_update(u, expected_shapes=shapes)


def test_aggregate_rejects_and_names_the_bad_site():
    ups = three_sites()
    ups[1]["params"]["f.w"][0, 1] = np.inf
    with pytest.raises(UpdateRejected, match=r"^site b: non-finite values \(NaN or Inf\) in 'f.w'"):
        surgical_aggregate(ups)
    ups = [to_torch(u) for u in three_sites()]
    ups[2]["params"][B][0] = float("nan")
    with pytest.raises(UpdateRejected, match=r"^site c: non-finite .* 'classifier.bias'"):
        surgical_aggregate(ups)
    ups = three_sites()
    ups[2]["params"]["f.extra"] = np.zeros(1, np.float32)
    with pytest.raises(UpdateRejected, match=r"^site c: unexpected parameter"):
        surgical_aggregate(ups)
    ups = three_sites()
    ups[2]["site"] = "a"
    with pytest.raises(UpdateRejected, match="site a: sent more than one update"):
        surgical_aggregate(ups)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"weighting": "size"}, "weighting"),
        ({"batchnorm": "bn"}, "batchnorm"),
        ({"robust": "trimmed"}, "robust"),
        ({"robust": "median", "weighting": "samples"}, "unweighted"),
        ({"robust": "clip", "clip_norm": 1.0}, "reference"),
        ({"robust": "clip", "clip_norm": 0.0, "reference": {}}, "clip_norm"),
        ({"clip_norm": 1.0}, "only used with robust='clip'"),
        ({"classes": ["x", "x"]}, "duplicate"),
        ({"bn_keys": [W], "batchnorm": "fedbn"}, "head"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        surgical_aggregate(three_sites(), **kwargs)


HONEST = [1.0, 1.2, 0.8, 1.1]


def poisoned_sites(scale=1e6):
    values = [*HONEST, 1.0 * scale]  # the last site sends its weights scaled by 1e6
    return [update(f"s{i}", {"x": ([v], v)}, {"f.w": np.full((2, 2), v)}) for i, v in enumerate(values)]


def test_robust_median_and_clip_survive_a_scaled_site():
    mean, _ = surgical_aggregate(poisoned_sites())
    np.testing.assert_allclose(mean["f.w"], np.full((2, 2), (sum(HONEST) + 1e6) / 5), rtol=1e-6)  # ruined
    assert mean["f.w"][0, 0] > 1e5

    median, _ = surgical_aggregate(poisoned_sites(), robust="median", clip_norm=1.0)
    np.testing.assert_allclose(median["f.w"], np.full((2, 2), 1.1))  # median of 0.8 1.0 1.1 1.2 1e6
    np.testing.assert_allclose(median[W], [[1.1]])
    np.testing.assert_allclose(median[B], [1.1])

    reference = {"f.w": np.ones((2, 2), np.float32), W: np.ones((1, 1), np.float32), B: np.ones(1, np.float32)}
    clipped, _ = surgical_aggregate(poisoned_sites(), robust="clip", clip_norm=0.5, reference=reference)
    # body: honest deltas have norm |d| * 2 <= 0.4 (kept); the attacker's is clipped to norm 0.5 -> 0.25 each
    np.testing.assert_allclose(clipped["f.w"], np.full((2, 2), 1 + (0 + 0.2 - 0.2 + 0.1 + 0.25) / 5), rtol=1e-6)
    # head row (weight, bias): honest norms |d| * sqrt(2) <= 0.283; attacker's clipped to 0.5 -> 0.5 / sqrt(2) each
    row = 1 + (0 + 0.2 - 0.2 + 0.1 + 0.5 / np.sqrt(2)) / 5
    np.testing.assert_allclose(clipped[W], [[row]], rtol=1e-6)
    np.testing.assert_allclose(clipped[B], [row], rtol=1e-6)
    assert abs(clipped["f.w"][0, 0] - 1.025) < 0.1 and abs(median["f.w"][0, 0] - 1.025) < 0.1


def test_robust_modes_without_attack_are_close_to_mean():
    honest = poisoned_sites(scale=1.0)[:4]
    reference = {"f.w": np.ones((2, 2), np.float32), W: np.ones((1, 1), np.float32), B: np.ones(1, np.float32)}
    mean, _ = surgical_aggregate(honest)
    clipped, _ = surgical_aggregate(honest, robust="clip", clip_norm=10.0, reference=reference, classes=["x"])
    np.testing.assert_allclose(clipped["f.w"], mean["f.w"], rtol=1e-6)  # nothing exceeds the norm: plain mean
    np.testing.assert_allclose(clipped[W], mean[W], rtol=1e-6)
    median, _ = surgical_aggregate([to_torch(u) for u in honest], robust="median", clip_norm=10.0)
    assert isinstance(median["f.w"], torch.Tensor)
    np.testing.assert_allclose(median["f.w"].numpy(), np.full((2, 2), 1.05), rtol=1e-6)  # mean of 1.0 and 1.1


def test_median_head_uses_only_sites_with_the_class():
    ups = [
        update("a", {"x": ([1.0], 1.0), "y": ([100.0], 100.0)}, {"f": [0.0]}),
        update("b", {"x": ([2.0], 2.0)}, {"f": [0.0]}),
        update("c", {"x": ([9.0], 9.0), "y": ([300.0], 300.0)}, {"f": [0.0]}),
    ]
    params, classes = surgical_aggregate(ups, robust="median", clip_norm=1e3)
    assert classes == ["x", "y"]
    np.testing.assert_allclose(params[W], [[2.0], [200.0]])  # y: 2 sites, clipped (norms < 1e3): their mean
    params, _ = surgical_aggregate(ups, robust="median", clip_norm=1.0)  # issue 40: a median of 2 is bounded
    assert np.linalg.norm([params[W][1, 0], params[B][1]]) <= 1.0 + 1e-6


def test_reference_must_match():
    body_only = {"f.w": np.ones((2, 2), np.float32)}
    with pytest.raises(ValueError, match="needs the reference head"):
        surgical_aggregate(poisoned_sites(), robust="clip", clip_norm=1.0, reference=body_only, classes=["x"])
    bad_rows = {**body_only, W: np.ones((2, 1), np.float32), B: np.ones(2, np.float32)}
    for classes in (["x"], None):
        with pytest.raises(ValueError, match="one row per entry of classes"):
            surgical_aggregate(poisoned_sites(), robust="clip", clip_norm=1.0, reference=bad_rows, classes=classes)
    with pytest.raises(ValueError, match=r"reference must hold 'f.w' with shape \(2, 2\), found nothing"):
        surgical_aggregate(poisoned_sites(), robust="clip", clip_norm=1.0, reference={W: [[1.0]], B: [1.0]})


def test_validate_update_expected_shapes_without_head_entries():
    validate_update(good(), expected_shapes={"f": [2]})
    with pytest.raises(UpdateRejected, match="missing parameter"):
        validate_update(good(), expected_shapes={"f": [2], "g": [1]})


def test_clip_reference_rows_follow_the_global_class_order():
    ups = [
        update("a", {"y": ([5.0], 5.0), "x": ([1.0], 1.0)}, {"f": [0.0]}),
        update("b", {"x": ([3.0], 3.0)}, {"f": [2.0]}),
    ]
    ref_sorted = {
        "f": np.zeros(1, np.float32),
        W: np.array([[2.0], [4.0]], np.float32),
        B: np.array([2.0, 4.0], np.float32),
    }
    # clip_norm 1.5: x deltas (-1, -1) and (1, 1) have norm 1.41 (kept); y delta (1, 1) kept; body deltas 0 and 2 -> 1.5
    params, classes = surgical_aggregate(ups, robust="clip", clip_norm=1.5, reference=ref_sorted)
    assert classes == ["x", "y"]
    np.testing.assert_allclose(params[W], [[2.0], [5.0]])
    np.testing.assert_allclose(params["f"], [(0 + 1.5) / 2])
    ref_yx = {"f": ref_sorted["f"], W: ref_sorted[W][::-1].copy(), B: ref_sorted[B][::-1].copy()}
    params_yx, classes_yx = surgical_aggregate(ups, robust="clip", clip_norm=1.5, reference=ref_yx, classes=["y", "x"])
    assert classes_yx == ["y", "x"]
    np.testing.assert_allclose(params_yx[W], [[5.0], [2.0]])


def test_adaptive_clip_bounds_every_update_by_the_lower_median_norm_of_its_round():
    # clip_norm None with robust: the bound is the round's lower median update norm (hand-computed below).
    ref = {"f": np.zeros(2, np.float32), W: np.zeros((1, 1), np.float32), B: np.zeros(1, np.float32)}
    ups = [
        update("a", {"x": ([3.0], 4.0)}, {"f": [1.0, 0.0]}),  # body norm 1, head row norm 5
        update("b", {"x": ([0.0], 1.0)}, {"f": [0.0, 2.0]}),  # 2, 1
        update("c", {"x": ([1.0], 0.0)}, {"f": [3.0, 0.0]}),  # 3, 1
        update("d", {"x": ([300.0], 400.0)}, {"f": [0.0, 400.0]}),
    ]  # hostile: 400, 500
    params, _ = surgical_aggregate(ups, robust="clip", clip_norm=None, reference=ref, classes=["x"])
    # body bound = lower median of (1, 2, 3, 400) = 2: c -> (2, 0), d -> (0, 2); mean (1+0+2+0, 0+2+0+2)/4
    np.testing.assert_allclose(params["f"], [0.75, 1.0], rtol=1e-6)
    # head bound = lower median of (5, 1, 1, 500) = 1: a -> (0.6, 0.8), d -> (0.6, 0.8); mean over 4 rows
    np.testing.assert_allclose([params[W][0, 0], params[B][0]], [2.2 / 4, 2.6 / 4], rtol=1e-6)
    plain, _ = surgical_aggregate(ups, reference=ref, classes=["x"])
    assert plain["f"][1] > 100  # the positive control: without robust the hostile site sets the model


def test_adaptive_median_of_two_bounds_both_by_the_smaller_update():
    ref = {"f": np.zeros(1, np.float32), W: np.zeros((1, 1), np.float32), B: np.zeros(1, np.float32)}
    ups = [update("a", {"x": ([0.0], 1.0)}, {"f": [1.0]}), update("b", {"x": ([0.0], 1e6)}, {"f": [-1e6]})]
    params, _ = surgical_aggregate(ups, robust="median", reference=ref, classes=["x"])
    np.testing.assert_allclose(params["f"], [0.0], atol=1e-6)  # (1 + (-1)) / 2
    np.testing.assert_allclose(params[B], [1.0], rtol=1e-6)
