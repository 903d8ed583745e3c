"""Pieces of `cxrfl bench speed`: the updates, the three aggregators agree, payload sizes."""

from __future__ import annotations

import numpy as np

from cxrfl.bench.speed import aggregate_with, make_updates, payload_benchmark, speed_verdicts


def test_surgical_aggregation_of_the_body_equals_nvflare_fedavg():
    updates, shapes = make_updates(3)
    assert all(u["params"]["classifier.weight"].shape[0] == len(u["classes"]) for u in updates)
    ours, classes = aggregate_with("surgical", updates, shapes)
    component = aggregate_with("surgical_nvflare", updates, shapes)
    theirs = aggregate_with("nvflare_fedavg", updates, shapes)
    from nvflare.apis.dxo import from_shareable

    fedavg = from_shareable(theirs).data
    for key in shapes:  # every feature-extractor entry: the plain mean, as NVFlare computes it
        if ours[key].dtype == np.float32:
            np.testing.assert_allclose(ours[key], fedavg[key], rtol=1e-5, atol=1e-6, err_msg=key)
        np.testing.assert_array_equal(component.params[key], ours[key])
    # a head row is the mean over the sites that have the class (NVFlare's FedAvg: over all sites)
    c = classes[0]
    having = [u for u in updates if c in u["classes"]]
    expected = np.mean([u["params"]["classifier.weight"][u["classes"].index(c)] for u in having], axis=0)
    np.testing.assert_allclose(ours["classifier.weight"][0], expected, rtol=1e-6)


def test_payload_is_the_feature_extractor_plus_own_rows():
    pay = payload_benchmark()
    for site, rows in pay["sites"].items():
        assert rows["surgical"]["equals_feature_extractor_plus_own_rows"], site
        assert rows["union (vanilla FL, partial loss)"]["raw_bytes"] == pay["full_model_bytes"]
        assert rows["local (personalized FL)"]["head_rows"] == 0
        assert rows["local + FedBN"]["raw_bytes"] < rows["local (personalized FL)"]["raw_bytes"]
    fake = {"aggregation": {"sites": {"10": {
        "surgical": {"median_seconds": 0.12, "ratio_to_nvflare_fedavg": 1.2, "extra_model_sizes": 1.1},
        "surgical_nvflare": {"median_seconds": 0.2, "ratio_to_nvflare_fedavg": 2.0, "extra_model_sizes": 2.1},
        "nvflare_fedavg": {"median_seconds": 0.1, "extra_model_sizes": 2.9}}}}, "payload": pay}
    text = " ".join(speed_verdicts(fake))
    assert "**MET** (0.120 s vs 0.100 s = 1.20x)" in text and "**NOT MET** (0.200 s = 2.00x)" in text
