"""Issue 45 point 1: a training job's final evaluation pools the sites' binned test counts per class, with the
code of the evaluation-only federation (:mod:`cxrfl.clinical.pooling`), in process on tiny synthetic sites.

The expectation is independent of the federation: sklearn's AUROC of the pooled per-image scores of the
selected model (``cxrfl predict``'s code path) at every site that labels the class.
"""

from __future__ import annotations

import json

import pytest
from cxrfl.clinical.pooling import PooledEvaluation
from cxrfl.data.site import load_site
from cxrfl.nn.models import ModelConfig
from cxrfl.nn.training import TrainConfig
from cxrfl.surgical.config import SurgicalConfig
from cxrfl.surgical.inprocess import make_hosts, run_surgical
from cxrfl.synth import write_profile
from pooling_helpers import central_auroc

SITES = ["hospital-a", "hospital-b"]
TRAIN = TrainConfig(warmup_epochs=1, batch_size=8, max_steps_per_epoch=1, augment=False, precision="fp32")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    root = tmp_path_factory.mktemp("final_evaluation")
    paths = write_profile("two-hospitals", root, n_per_site=120, image_size=32, sites=SITES)
    return [load_site(p, check_images=False) for p in sorted(paths) if p.stem in SITES]


def run(sites, tmp_path, **settings):
    hosts = make_hosts(sites, tmp_path / "sites", train_overrides={s.site: {"precision": "fp32"} for s in sites})
    config = SurgicalConfig.from_dict(
        {
            "num_rounds": 1,
            "model_config": ModelConfig(arch="densenet-tiny", image_size=32),  # the network is not the subject
            "train_config": TRAIN,
            "min_clients_timeout": 0,
            "retry_pause": 0.01,
            "pooled": {"min_cell": 1},
            **settings,
        }
    )
    return run_surgical(hosts, config, tmp_path / "run")


def test_the_selected_model_is_pooled_per_class_over_the_sites_that_label_it(sites, tmp_path):
    res = run(sites, tmp_path)
    report = res.outcome.evaluation["pooled"]
    evaluated = [c for c, e in report["classes"].items() if e["auroc"] is not None]
    shared = set(sites[0].classes) & set(sites[1].classes)
    assert len(evaluated) >= 6 and shared & set(evaluated), report["classes"].keys()
    best = tmp_path / "run" / "best_FL_global_model.pt"
    for c in evaluated:
        entry = report["classes"][c]
        assert entry["sites_labelling"] == entry["sites_pooled"] == sorted(s.site for s in sites if c in s.classes)
        # within 0.002, or within the binning bound the report states where a positive's and a negative's
        # scores are closer than the finest bins (a model trained one step scores 58 images within 0.5 logit)
        bound = max(0.002, entry["auroc"]["binning_bound"])
        assert abs(entry["auroc"]["value"] - central_auroc(sites, best, c)) <= bound, str(entry["auroc"])
    sites_report = res.outcome.evaluation["sites"]
    assert set(sites_report) == set(SITES) and all("counts" not in m for m in sites_report.values())
    assert set(sites_report["hospital-b"]["auroc"]) == set(sites[1].classes)  # each site's own metrics stay
    written = json.loads((tmp_path / "run" / "cxrfl" / "evaluation.json").read_text())
    assert written["pooled"]["classes"].keys() == report["classes"].keys()


def test_the_minimum_cell_size_holds_and_local_heads_are_not_pooled(sites, tmp_path):
    high = run(sites, tmp_path / "high", pooled={"min_cell": 10**6}).outcome.evaluation["pooled"]
    assert all(e["auroc"] is None and not e["sites_pooled"] for e in high["classes"].values())
    assert {s for e in high["classes"].values() for s in e["sites_withheld"]} == set(SITES)
    local = run(sites, tmp_path / "local", head_mode="local").outcome.evaluation
    assert local["pooled"] is None and set(local["sites"]) == set(SITES)


def test_a_null_pooled_section_reads_as_its_defaults():
    # NVFlare writes an unset recipe argument as null into the server config
    assert SurgicalConfig.from_dict({"pooled": None}).pooled == PooledEvaluation()
    assert SurgicalConfig.from_dict({"pooled": {"min_cell": 3}}).pooled.min_cell == 3
