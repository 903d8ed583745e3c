"""Detection metrics that flagging everything cannot game, against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest
from cxrfl.nn.detection import detection_metrics, flag_all_f1
from sklearn.metrics import roc_auc_score

# 4 positives, 6 negatives; the decision flags 3 positives and 1 negative
Y = np.array([1, 1, 1, 1, 0, 0, 0, 0, 0, 0], float)
PRED = np.array([1, 1, 1, 0, 1, 0, 0, 0, 0, 0], bool)
SCORE = np.array([0.9, 0.8, 0.7, 0.2, 0.75, 0.3, 0.1, 0.15, 0.05, 0.25])


def test_metrics_at_the_decision_match_the_confusion_matrix_by_hand():
    m = detection_metrics(Y, SCORE, PRED)
    tp, fn, fp, tn = 3, 1, 1, 5
    sens, spec = tp / 4, tn / 6
    assert m["balanced_accuracy"] == pytest.approx((sens + spec) / 2)
    mcc = (tp * tn - fp * fn) / np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert m["mcc"] == pytest.approx(mcc)
    assert m["f1"] == pytest.approx(2 * tp / (2 * tp + fp + fn))
    assert m["specificity"] == pytest.approx(spec) and m["recall"] == pytest.approx(sens)
    assert m["f1_flag_all"] == pytest.approx(2 * 0.4 / 1.4)
    assert (m["n"], m["n_positive"], m["n_predicted"]) == (10, 4, 4)
    # AUROC by counting ordered pairs: positive 0.2 is below 0.75, 0.3 and 0.25; 0.7 below 0.75
    assert m["auroc"] == pytest.approx(1 - 4 / 24) == roc_auc_score(Y, SCORE)


def test_flagging_everything_wins_f1_on_a_balanced_set_but_not_the_honest_metrics():
    y = np.repeat([1.0, 0.0], 200)
    m = detection_metrics(y, np.zeros(400), np.ones(400, bool), prevalence=0.09)
    assert m["f1"] == pytest.approx(2 / 3) == pytest.approx(m["f1_flag_all"])
    assert m["balanced_accuracy"] == 0.5 and m["mcc"] == 0.0 and m["auroc"] == 0.5
    at = m["at_prevalence"]
    # at 9 % prevalence flagging everything has precision 0.09: F1 = 2*0.09/1.09
    assert at["precision"] == pytest.approx(0.09) and at["f1"] == pytest.approx(flag_all_f1(0.09))
    assert at["f1_flag_all"] == pytest.approx(0.18 / 1.09)


def test_prevalence_reweights_the_negatives_for_precision():
    m = detection_metrics(Y, SCORE, PRED, prevalence=0.1)
    # negatives weighted w so that 4 / (4 + 6 w) = 0.1: w = 6; precision = 3 / (3 + 1 * 6)
    w = 4 * 0.9 / (0.1 * 6)
    prec = 3 / (3 + w)
    assert m["at_prevalence"]["precision"] == pytest.approx(prec)
    assert m["at_prevalence"]["recall"] == pytest.approx(0.75)
    assert m["at_prevalence"]["f1"] == pytest.approx(2 * prec * 0.75 / (prec + 0.75))


def test_auroc_interval_holds_the_auroc_is_seeded_and_narrows_with_more_images():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 400).astype(float)
    s = y + rng.normal(size=400)
    small = detection_metrics(y[:80], s[:80], s[:80] > 0.5, seed=1)
    big = detection_metrics(y, s, s > 0.5, seed=1)
    lo, hi = big["auroc_ci"]
    assert lo < big["auroc"] < hi
    assert hi - lo < small["auroc_ci"][1] - small["auroc_ci"][0]
    assert detection_metrics(y, s, s > 0.5, seed=1)["auroc_ci"] == big["auroc_ci"]
    assert detection_metrics(y, s, s > 0.5, seed=2)["auroc_ci"] != big["auroc_ci"]


def test_unknown_labels_are_left_out_and_one_class_sets_have_no_auroc():
    y = Y.copy()
    y[[0, 4]] = np.nan
    m = detection_metrics(y, SCORE, PRED)
    assert m["n"] == 8 and m["n_positive"] == 3
    assert m["auroc"] == pytest.approx(roc_auc_score(Y[[1, 2, 3, 5, 6, 7, 8, 9]], SCORE[[1, 2, 3, 5, 6, 7, 8, 9]]))
    one = detection_metrics(np.ones(5), np.arange(5.0), np.ones(5, bool), prevalence=0.1)
    assert one["auroc"] is None and one["auroc_ci"] is None and one["balanced_accuracy"] is None
    assert one["specificity"] is None and one["f1"] == 1.0
    with pytest.raises(ValueError, match="differ in length"):
        detection_metrics(Y, SCORE[:3], PRED)
