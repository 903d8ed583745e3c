"""Evaluation-only federation (issue 45 point 1), in process on tiny synthetic sites.

The expectation is independent of the federation: each site's test images are scored by
``cxrfl predict``'s code path (:func:`cxrfl.predict.predict_images`), the scores of every site
that labels a class are pooled, and scikit-learn's AUROC of the pooled scores is what the
binned counts must give (issue 45: within 0.002).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from cxrfl.common.transport import inprocess_transport
from cxrfl.data.site import load_site
from cxrfl.fedeval.config import FedEvalConfig
from cxrfl.fedeval.inprocess import run_fedeval
from cxrfl.fedeval.server import FedEvalServer
from cxrfl.nn.models import ModelConfig, build_model, load_checkpoint, save_checkpoint
from cxrfl.predict import predict_images
from cxrfl.surgical.inprocess import make_hosts
from cxrfl.synth import write_profile
from pooling_helpers import central_auroc, scores_by_path
from sklearn.metrics import roc_auc_score

SITES = ["hospital-a", "hospital-b"]
EXTRA = "Hernia-of-nobody"  # a model class no site labels

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    root = tmp_path_factory.mktemp("fedeval")
    paths = write_profile("two-hospitals", root, n_per_site=120, image_size=32, sites=SITES)
    return [load_site(p, check_images=False) for p in sorted(paths) if p.stem in SITES]


def untrained(sites, path: Path, config: ModelConfig) -> Path:
    classes = sorted(set().union(*(s.classes for s in sites))) + [EXTRA]
    torch.manual_seed(0)
    save_checkpoint(path, build_model(config, len(classes)), classes=classes, model_config=config)
    return path


@pytest.fixture(scope="module")
def checkpoint(sites, tmp_path_factory) -> Path:
    return untrained(
        sites, tmp_path_factory.mktemp("model") / "model.pt", ModelConfig(arch="densenet-tiny", image_size=32)
    )


@pytest.fixture(scope="module")
def densenet121_checkpoint(sites, tmp_path_factory) -> Path:
    """For the comparisons within 0.002, which need every positive and negative a fitted bin apart: an untrained
    densenet-tiny scores a few such pairs of these sites within 3e-6 logit (binning bound up to 0.02), DenseNet121
    none (bound 0)."""
    return untrained(sites, tmp_path_factory.mktemp("model121") / "model.pt", ModelConfig(image_size=32))


def fp32_hosts(sites, root: Path):
    return make_hosts(sites, root, train_overrides={s.site: {"precision": "fp32"} for s in sites})


@pytest.fixture(scope="module")
def evaluated121(sites, densenet121_checkpoint, tmp_path_factory) -> tuple[dict, Path]:
    """One evaluation of the DenseNet121 model with every cell sent (``min_cell=1``): its report and folder."""
    out = tmp_path_factory.mktemp("fedeval121")
    return run_fedeval(fp32_hosts(sites, out / "sites"), densenet121_checkpoint, FedEvalConfig(min_cell=1), out), out


def test_pooled_auroc_from_counts_equals_sklearn_on_the_pooled_scores(sites, densenet121_checkpoint, evaluated121):
    report, tmp_path = evaluated121
    evaluated = [c for c, e in report["classes"].items() if e["auroc"] is not None]
    shared = set(sites[0].classes) & set(sites[1].classes)
    assert len(evaluated) >= 6 and shared & set(evaluated), report["classes"].keys()
    for c in evaluated:
        entry = report["classes"][c]
        assert entry["sites_pooled"] == sorted(s.site for s in sites if c in s.classes)  # a site without a
        # positive in its split still sends its negatives' counts (an empty cell identifies nobody)
        assert abs(entry["auroc"]["value"] - central_auroc(sites, densenet121_checkpoint, c)) <= 0.002, c
        assert entry["auroc"]["low"] <= entry["auroc"]["value"] <= entry["auroc"]["high"]
    assert report["not_labelled"] == [EXTRA]
    written = json.loads((tmp_path / "cxrfl" / "evaluation.json").read_text())
    assert written["classes"].keys() == report["classes"].keys()
    assert (tmp_path / "cxrfl" / "evaluation.json").stat().st_mode & 0o077 == 0  # names sites per class


def test_subgroups_pooled_from_counts_equal_sklearn_on_each_groups_pooled_scores(
    sites, densenet121_checkpoint, evaluated121
):
    # issue 45 point 4: by sex, age band and view, from the sites' own metadata, nothing per image sent
    audit = evaluated121[0]["subgroups"]
    checked = 0
    for c, entry in audit.items():
        for group, member in (
            ("sex=F", lambda t: t["sex"] == "F"),
            ("sex=M", lambda t: t["sex"] == "M"),
            ("view=PA", lambda t: t["view"] == "PA"),
            ("age=40-59", lambda t: (t["age"] >= 40) & (t["age"] < 60)),
        ):
            got = entry["groups"][group]
            if got is None:
                continue
            scores, labels = [], []
            for site in sites:
                if c not in site.classes:
                    continue
                table = site.split_table("test")
                rows = table[member(table) & table[c].notna()]  # the group read from the site's own table
                found = scores_by_path(site, densenet121_checkpoint)
                scores += [found[p][c] for p in rows["path"]]
                labels += rows[c].tolist()
            assert abs(got["auroc"]["value"] - roc_auc_score(labels, scores)) <= 0.002, (c, group)
            checked += 1
    assert checked >= 8, audit.keys()
    assert any(e["largest_gap"].get("sex") for e in audit.values())


def test_a_class_below_the_minimum_cell_size_is_not_sent(sites, checkpoint, tmp_path):
    ckpt = load_checkpoint(checkpoint)
    smallest = min(
        n for s in sites for c in s.classes for v in (0.0, 1.0) if (n := int((s.split_table("test")[c] == v).sum())) > 0
    )
    report = run_fedeval(fp32_hosts(sites, tmp_path / "sites"), ckpt, FedEvalConfig(min_cell=smallest + 1), tmp_path)
    withheld = {c for c, e in report["classes"].items() if e["sites_withheld"]}
    assert withheld, "some site has a class with exactly `smallest` cases: it must send nothing for it"
    for c, entry in report["classes"].items():
        if entry["sites_pooled"]:  # what was pooled comes from sites with enough cases
            for s in sites:
                if s.site in entry["sites_pooled"]:
                    table = s.split_table("test")
                    assert all(n == 0 or n > smallest for n in ((table[c] == 1).sum(), (table[c] == 0).sum()))
    high = run_fedeval(fp32_hosts(sites, tmp_path / "s2"), ckpt, FedEvalConfig(min_cell=10**6), tmp_path / "high")
    assert all(e["auroc"] is None and not e["sites_pooled"] for e in high["classes"].values())


def test_a_site_receives_and_is_asked_about_only_its_own_classes(sites, checkpoint, tmp_path):
    hosts = fp32_hosts(sites, tmp_path / "sites")
    sent: dict[str, list] = {s: [] for s in hosts}
    transport = inprocess_transport(hosts)

    def recording(task, payloads, **kw):
        for site, (params, meta) in payloads.items():
            sent[site].append((task, {k: np.asarray(v).shape for k, v in params.items()}, json.dumps(meta)))
        return transport(task, payloads, **kw)

    fits = FedEvalConfig(split="val", min_cell=1, calibration="platt", target="youden")  # site_fit tasks too
    server = FedEvalServer(
        recording,
        config=fits,
        checkpoint=load_checkpoint(checkpoint),
        sites=list(hosts),
        out_dir=tmp_path,
    )
    server.run()
    by_name = {s.site: s for s in sites}
    for site, messages in sent.items():
        others = sorted((set().union(*(s.classes for s in sites)) | {EXTRA}) - set(by_name[site].classes))
        assert others, "positive control: there are other sites' classes to leak"
        for task, shapes, meta in messages:
            assert [c for c in others if c in meta] == [], (site, task)
            if task == "validate":
                assert shapes["classifier.weight"][0] == len(by_name[site].classes)
        assert [m[0] for m in messages] == ["classes", "validate", "validate", "site_fit"][: len(messages)]
        assert messages[-1][0] == "site_fit" and messages[-1][1]["classifier.weight"][0] == len(by_name[site].classes)
        planted = messages[-1][2].replace("}", f', "x": "{others[0]}"}}', 1)
        assert others[0] in planted  # the scan above finds a name when one is there


def test_calibration_and_operating_points_fitted_on_validation_travel_in_the_checkpoint(sites, checkpoint, tmp_path):
    from cxrfl.clinical.fitted import ClinicalFit
    from cxrfl.errors import ConfigError
    from scipy.special import logit
    from sklearn.linear_model import LogisticRegression

    with pytest.raises(ConfigError, match="split.*val"):
        FedEvalConfig(calibration="platt")  # never fitted on the test split
    config = FedEvalConfig(split="val", min_cell=1, calibration="platt", target="sensitivity", target_value=0.9)
    report = run_fedeval(fp32_hosts(sites, tmp_path / "sites"), checkpoint, config, tmp_path)
    path = tmp_path / "cxrfl" / "calibrated_model.pt"
    fit = ClinicalFit.from_checkpoint(load_checkpoint(path), str(path))
    assert fit is not None and fit.operating_points and report["fitted"]["model"] == "cxrfl/calibrated_model.pt"
    # independent: the pooled raw validation scores of the class with most cases, as `cxrfl predict --raw` gives them
    c = max(fit.calibration, key=lambda k: sum(fit.fitted_on["classes"][k][n] for n in ("positives", "negatives")))
    images, labels = [], []
    for site in sites:
        if c in site.classes:
            table = site.split_table("val")
            known = table[c].notna()
            images += table.loc[known, "path"].tolist()
            labels += table.loc[known, c].tolist()
    raw_rows = predict_images(path, images, device="cpu", precision="fp32", raw=True)
    raw = np.array([r["probabilities"][c] for r in raw_rows])
    shown = predict_images(path, images, device="cpu", precision="fp32")
    np.testing.assert_allclose([r["probabilities"][c] for r in shown], fit.calibration[c].apply(raw), atol=1e-6)
    assert [r["positive"][c] for r in shown] == list(raw >= fit.operating_points[c]["threshold"])
    # the map is the logistic regression of the labels on the raw logits (scikit-learn, unpenalised)
    reference = LogisticRegression(penalty=None, tol=1e-10, max_iter=10_000).fit(logit(raw)[:, None], labels)
    expected = reference.predict_proba(logit(raw)[:, None])[:, 1]
    np.testing.assert_allclose(fit.calibration[c].apply(raw), expected, atol=0.01)
    # the operating point keeps at least 90 % of the validation positives (at least 90 % of n + 1: new data)
    y = np.array(labels) == 1
    caught = (raw[y] >= fit.operating_points[c]["threshold"]).sum()
    assert caught >= 0.9 * (y.sum() + 1) if fit.operating_points[c]["met"] else caught == y.sum()
    assert (raw[~y] < fit.operating_points[c]["threshold"]).any()  # never simply "everything positive"
    # each site wrote its copy: its own classes only, the consortium's points, its own map only where its
    # counts call for one; owner-only; `cxrfl predict` applies it to the site's images
    assert report["fitted"]["sites"].keys() == {s.site for s in sites}
    for site in sites:
        own = tmp_path / "sites" / site.site / "site_models" / "fedeval.pt"
        assert own.stat().st_mode & 0o777 == 0o600 and report["fitted"]["sites"][site.site]["written"]
        copy = ClinicalFit.from_checkpoint(load_checkpoint(own), str(own))
        assert copy is not None and load_checkpoint(own)["classes"] == site.classes  # EXTRA is not the site's
        assert copy.operating_points.keys() == {k for k in fit.operating_points if k in site.classes}
        for k, point in copy.operating_points.items():  # the consortium's thresholds
            assert point["threshold"] == fit.operating_points[k]["threshold"] and point["rule"] == "new_data"
        mine = sum(copy.calibration.get(k) != fit.calibration.get(k) for k in site.classes)
        assert mine == report["fitted"]["sites"][site.site]["own_maps"]
        images = site.split_table("val")["path"].tolist()[:5]
        shown = predict_images(own, images, device="cpu", precision="fp32")
        raw_here = predict_images(own, images, device="cpu", precision="fp32", raw=True)
        for k in site.classes:
            raw_k = np.array([r["probabilities"][k] for r in raw_here])
            expected = copy.calibration[k].apply(raw_k) if k in copy.calibration else raw_k
            np.testing.assert_allclose([r["probabilities"][k] for r in shown], expected, atol=1e-6)
            np.testing.assert_allclose(raw_k, [r["probabilities"][k] for r in raw_rows_of(path, images)], atol=1e-6)


def raw_rows_of(model: Path, images: list[str]) -> list[dict]:
    """``cxrfl predict --raw`` rows of a model."""
    return predict_images(model, images, device="cpu", precision="fp32", raw=True)
