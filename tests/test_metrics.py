"""Metrics against scikit-learn and scipy on fixed arrays."""

from __future__ import annotations

import math

import numpy as np
import pytest
from cxrfl.bench.intervals import bootstrap_auroc_ci, bootstrap_aurocs, paired_ttest, percentile_ci
from cxrfl.nn.metrics import fast_auroc, per_class_auroc, summarise_auroc
from scipy import stats
from sklearn.metrics import roc_auc_score

Y = np.array([[1, 0, 1], [0, 0, 1], [1, 1, 1], [0, 1, 1], [1, 0, 1], [0, 0, 1]], dtype=float)
S = np.array([[0.9, 0.2, 0.5], [0.3, 0.1, 0.4], [0.6, 0.8, 0.3], [0.7, 0.3, 0.9], [0.8, 0.6, 0.1], [0.2, 0.4, 0.2]])


def test_per_class_auroc_matches_sklearn():
    got = per_class_auroc(Y, S, ["a", "b", "c"])
    assert got["a"] == pytest.approx(roc_auc_score(Y[:, 0], S[:, 0]))
    assert got["a"] == pytest.approx(8 / 9)  # 8 of the 9 positive/negative pairs ordered right
    assert got["b"] == pytest.approx(roc_auc_score(Y[:, 1], S[:, 1]))
    assert got["c"] is None  # only positives: undefined, never 0.5


def test_per_class_auroc_with_mask_and_nan():
    mask = np.ones_like(Y)
    mask[[1, 3], 0] = 0  # drop two rows of class a
    got = per_class_auroc(Y, S, ["a", "b", "c"], mask=mask)
    keep = mask[:, 0] == 1
    assert got["a"] == pytest.approx(roc_auc_score(Y[keep, 0], S[keep, 0]))
    y_nan = Y.copy()
    y_nan[[1, 3], 0] = np.nan  # NaN marks unknown when no mask is given
    assert per_class_auroc(y_nan, S, ["a", "b", "c"])["a"] == got["a"]
    mask_b = np.ones_like(Y)
    mask_b[Y[:, 1] == 0, 1] = 0  # known entries of b are all positive
    assert per_class_auroc(Y, S, ["a", "b", "c"], mask=mask_b)["b"] is None
    one = per_class_auroc(Y[:, 0], S[:, 0], ["a"])
    assert one["a"] == pytest.approx(8 / 9)
    with pytest.raises(ValueError, match="must both be"):
        per_class_auroc(Y, S, ["a", "b"])
    with pytest.raises(ValueError, match="0 or 1"):
        per_class_auroc(Y * 2, S, ["a", "b", "c"])


def test_summarise_with_shared_and_unique():
    aurocs = {"a": 0.8, "b": 0.6, "c": 0.7, "d": None}
    s = summarise_auroc(aurocs, shared=["a", "b", "x"])
    assert s["mean"] == pytest.approx(0.7) and s["n"] == 3
    assert s["sd"] == pytest.approx(0.1)  # sample SD (ddof=1) of 0.8, 0.6, 0.7
    assert s["undefined"] == ["d"]
    assert s["shared"] == pytest.approx({"mean": 0.7, "sd": math.sqrt(0.02), "n": 2})
    assert s["unique"] == {"mean": pytest.approx(0.7), "sd": None, "n": 1}
    assert "shared" not in summarise_auroc(aurocs)
    assert summarise_auroc({"a": None}) == {"mean": None, "sd": None, "n": 0, "undefined": ["a"]}


def test_bootstrap_ci_brackets_estimate_and_is_deterministic():
    rng = np.random.default_rng(3)
    y = rng.integers(0, 2, 200)
    s = y * 0.8 + rng.normal(size=200)
    point = roc_auc_score(y, s)
    lo, hi = bootstrap_auroc_ci(y, s, n_boot=300, seed=7)
    assert lo < point < hi and 0.0 < hi - lo < 0.3
    assert bootstrap_auroc_ci(y, s, n_boot=300, seed=7) == (lo, hi)
    assert bootstrap_auroc_ci(y, s, n_boot=300, seed=8) != (lo, hi)
    lo90, hi90 = bootstrap_auroc_ci(y, s, n_boot=300, seed=7, alpha=0.1)
    assert lo <= lo90 and hi90 <= hi
    with pytest.raises(ValueError, match="both present"):
        bootstrap_auroc_ci(np.ones(10), np.arange(10.0))


def test_paired_ttest_matches_scipy():
    a = {"a": 0.81, "b": 0.72, "c": 0.90, "d": 0.66, "e": None, "only_a": 0.5}
    b = {"a": 0.78, "b": 0.70, "c": 0.86, "d": 0.67, "e": 0.7}
    got = paired_ttest(a, b)
    x, y = [0.81, 0.72, 0.90, 0.66], [0.78, 0.70, 0.86, 0.67]
    ref = stats.ttest_rel(x, y)
    assert got["n"] == 4 and got["classes"] == ["a", "b", "c", "d"]
    assert got["t"] == pytest.approx(ref.statistic) and got["p"] == pytest.approx(ref.pvalue)
    assert got["shapiro_p"] == pytest.approx(stats.shapiro(np.subtract(x, y)).pvalue)
    two = paired_ttest({"a": 0.8, "b": 0.7}, {"a": 0.7, "b": 0.5})
    assert two["n"] == 2 and two["shapiro_p"] is None
    assert two["p"] == pytest.approx(stats.ttest_rel([0.8, 0.7], [0.7, 0.5]).pvalue)
    assert paired_ttest({"a": 0.8}, {"a": 0.7}) == {"t": None, "p": None, "n": 1, "shapiro_p": None, "classes": ["a"]}


def test_summary_is_not_defined_when_the_model_lacks_a_class():
    aurocs = {"a": 0.8, "b": 0.6, "c": None, "d": None}  # c: one label value only; d: the model lacks it
    s = summarise_auroc(aurocs, shared=["a", "d"], model_classes=["a", "b", "c"])
    assert s["mean"] is None and s["sd"] is None and s["unknown"] == ["d"]  # never a mean of the rest, never 0.5
    assert s["undefined"] == ["c", "d"] and s["n"] == 2
    assert s["shared"] == {"mean": None, "sd": None, "n": 1, "unknown": ["d"]}  # a, d: d unknown
    assert s["unique"]["mean"] == pytest.approx(0.6) and "unknown" not in s["unique"]  # b, c: c undefined only
    full = summarise_auroc(aurocs, model_classes=["a", "b", "c", "d"])
    assert full["mean"] == pytest.approx(0.7) and full["sd"] == pytest.approx(np.std([0.8, 0.6], ddof=1))
    assert summarise_auroc(aurocs)["mean"] == pytest.approx(0.7)  # without model_classes: the old behaviour


def test_fast_auroc_matches_sklearn_with_ties():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, (5, 40)).astype(float)
    s = np.round(rng.normal(size=(5, 40)) + y, 1)  # rounding makes ties
    got = fast_auroc(y, s)
    np.testing.assert_allclose(got, [roc_auc_score(y[i], s[i]) for i in range(5)])
    one = fast_auroc(np.ones(5), np.arange(5.0))
    assert np.isnan(one)


def test_bootstrap_replicates_match_sklearn_and_the_one_class_interval():
    rng = np.random.default_rng(3)
    y = rng.integers(0, 2, (120, 3)).astype(float)
    s = y * 0.7 + rng.normal(size=(120, 3))
    mask = np.ones_like(y)
    mask[::4, 2] = 0  # a quarter of class 2 unknown
    reps = bootstrap_aurocs(y, s, mask=mask, n_boot=40, seed=5)
    assert reps.shape == (40, 3)
    idx_rng = np.random.default_rng(5)
    for b in range(40):  # the same resamples as bootstrap_auroc_ci draws
        idx = idx_rng.integers(0, 120, 120)
        for j in range(3):
            keep = mask[idx, j] == 1
            t, sc = y[idx, j][keep], s[idx, j][keep]
            expected = roc_auc_score(t, sc) if 0 < t.sum() < len(t) else np.nan
            np.testing.assert_allclose(reps[b, j], expected, equal_nan=True)
    ci = percentile_ci(bootstrap_aurocs(y[:, 0], s[:, 0], n_boot=300, seed=7)[:, 0])
    assert ci == pytest.approx(bootstrap_auroc_ci(y[:, 0], s[:, 0], n_boot=300, seed=7))
    assert percentile_ci(np.full(5, np.nan)) is None
