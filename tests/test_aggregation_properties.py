"""Property-based tests (hypothesis) of surgical aggregation's invariants (issue 44 point 4).

Each property is checked against an independent expectation computed here with numpy: the plain
FedAvg mean, the site's own row, the global model's rows.
"""

from __future__ import annotations

import numpy as np
from cxrfl.nn.models import HEAD_PREFIX
from cxrfl.surgical.aggregation import surgical_aggregate
from cxrfl.surgical.head_modes import payload_for
from hypothesis import given, settings
from hypothesis import strategies as st

W, B = HEAD_PREFIX + "weight", HEAD_PREFIX + "bias"
POOL = ["Atelectasis", "Edema", "Effusion", "Mass", "Pneumonia"]
FEATURES = 3
finite = st.floats(-10, 10, allow_nan=False, width=32)


@st.composite
def rounds(draw, same_classes: bool = False):
    """1-5 site updates: distinct names, each with a non-empty subset of POOL (rows in the site's order)."""
    n = draw(st.integers(1, 5))
    shared = draw(st.lists(st.sampled_from(POOL), min_size=1, max_size=5, unique=True))
    updates = []
    for i in range(n):
        classes = shared if same_classes else draw(st.lists(st.sampled_from(POOL), min_size=1, max_size=5, unique=True))
        k = len(classes)
        params = {
            "body.w": np.array(draw(st.lists(finite, min_size=4, max_size=4)), np.float32).reshape(2, 2),
            W: np.array(draw(st.lists(finite, min_size=k * FEATURES, max_size=k * FEATURES)), np.float32).reshape(
                k, FEATURES
            ),
            B: np.array(draw(st.lists(finite, min_size=k, max_size=k)), np.float32),
        }
        updates.append(
            {"site": f"s{i}", "classes": list(classes), "params": params, "num_samples": draw(st.integers(1, 50))}
        )
    return updates


def rows_of(update: dict) -> dict[str, np.ndarray]:
    p = update["params"]
    return {c: np.concatenate([p[W][j], p[B][j : j + 1]]) for j, c in enumerate(update["classes"])}


@settings(max_examples=60, deadline=None)
@given(rounds(), st.randoms(use_true_random=False), st.sampled_from(["uniform", "samples"]))
def test_the_order_the_sites_answer_in_does_not_change_the_model(updates, rng, weighting):
    shuffled = list(updates)
    rng.shuffle(shuffled)
    a, ca = surgical_aggregate(updates, weighting=weighting)
    b, cb = surgical_aggregate(shuffled, weighting=weighting)
    assert ca == cb
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(rounds(), st.integers(1, 1000))
def test_equal_sample_counts_weigh_as_uniform(updates, count):
    same = [{**u, "num_samples": count} for u in updates]
    a, _ = surgical_aggregate(same, weighting="samples")
    b, _ = surgical_aggregate(same, weighting="uniform")
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(rounds(same_classes=True))
def test_identical_label_sets_are_fedavg(updates):
    out, classes = surgical_aggregate(updates)
    order = [updates[0]["classes"].index(c) for c in classes]  # the global rows are sorted by class name
    for key in ("body.w", W, B):
        mean = np.mean([u["params"][key] for u in updates], axis=0)
        expected = mean if key == "body.w" else mean[order]
        np.testing.assert_allclose(out[key], expected, rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(rounds(), st.sampled_from(["uniform", "samples"]))
def test_a_class_held_by_one_site_keeps_that_sites_row_and_shared_rows_are_the_holders_mean(updates, weighting):
    out, classes = surgical_aggregate(updates, weighting=weighting)
    for i, c in enumerate(classes):
        holders = [u for u in updates if c in u["classes"]]
        w = np.array([u["num_samples"] if weighting == "samples" else 1.0 for u in holders], float)
        expected = sum(wi * rows_of(u)[c].astype(float) for wi, u in zip(w, holders, strict=True)) / w.sum()
        got = np.concatenate([out[W][i], out[B][i : i + 1]])
        if len(holders) == 1:
            np.testing.assert_array_equal(got, rows_of(holders[0])[c])  # exactly, not approximately
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(rounds(), st.data())
def test_a_site_receives_the_global_rows_of_its_own_classes_in_its_order(updates, data):
    out, classes = surgical_aggregate(updates)
    site = data.draw(st.sampled_from(updates))
    sent, order = payload_for(out, classes, site["classes"], head_mode="surgical")
    assert order is None and set(sent) == set(out)
    rows = [classes.index(c) for c in site["classes"]]
    np.testing.assert_array_equal(sent[W], out[W][rows])
    np.testing.assert_array_equal(sent[B], out[B][rows])
    np.testing.assert_array_equal(sent["body.w"], out["body.w"])
