"""FedFew's stage 3 on its own, without any network training: the job's own server workflow
(threshold from the sites' counts, prototypes kept, final model, evaluation) and the job's own site
code (roles, energy ranges and counts, dual prototypes, matching, majority vote, UC metrics), with
generated features and energies standing in for the stage-2 network's.

- features and energies that separate a UC -> F1 >= 0.9 on a balanced test set of 200 + 200;
- energies that do not separate -> the paper's rule (most training examples right) flags
  (almost) nothing, whatever the features;
- the prototype minimum: a site with too few positives refuses, and a prototype claiming too few
  images is left out by the server.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest
from cxrfl.common.transport import inprocess_transport
from cxrfl.data.site import SiteData
from cxrfl.fedfew import protocol as P
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.detectors import predict
from cxrfl.fedfew.learner import FedFewSite
from cxrfl.fedfew.model import FedFewModel
from cxrfl.fedfew.prototypes import dual_prototype
from cxrfl.fedfew.scorer import UCScorer
from cxrfl.fedfew.server import FedFewServer
from cxrfl.nn.models import ModelConfig, build_model
from sklearn.metrics import roc_auc_score

MODEL = ModelConfig(arch="densenet-tiny", image_size=32)  # stage 3 never runs the network
CC = "Atelectasis"
# stage 3 only: no self-supervised round, no classifier round; the paper's threshold rule (default)
CONFIG = FedFewConfig(
    ssl_rounds=0,
    warmup_rounds=0,
    rounds=0,
    ssl_proj_dim=32,
    ssl_pred_dim=8,
    min_prototype_images=10,
    uc_classes=("Edema", "Hernia", "Pneumonia"),
)


class GeneratedSite(FedFewSite):
    """The job's site code with generated features and energies in place of the network's.

    Args:
        data: the site's rows (paths are never read).
        generated: split -> (features [n, D] (D: MODEL's feature size), energies [n]) in the split's row order.
        kw: :class:`FedFewSite`'s settings.
    """

    def __init__(self, data: SiteData, generated: dict[str, tuple[np.ndarray, np.ndarray]], **kw):
        super().__init__(data, **kw)
        self.generated = generated

    def embed(self, params, split="train"):
        feats, energies = self.generated[split]
        return feats, energies, self.role_table(split)


class GeneratedHost(P.FedFewSiteHost):
    """The job's site endpoint (:func:`cxrfl.fedfew.protocol.handle_task`) over a :class:`GeneratedSite`."""

    def __init__(self, data: SiteData, generated):
        super().__init__(data)
        self.generated = generated

    def site_for(self, meta):
        if self._site is None:
            model_config, config = P.site_settings(meta)
            self._site = GeneratedSite(self.data, self.generated, model_config=model_config, config=config)
        return self._site


def _site(name: str, cls: str, counts: dict[str, tuple[int, int]]) -> SiteData:
    """Rows per split: (positives, negatives) of ``cls``."""
    rows = [
        {
            "path": f"/nowhere/{name}/{split}-{i}.png",
            "patient": f"{name}-{split}-{i}",
            "split": split,
            cls: 1.0 if i < pos else 0.0,
        }
        for split, (pos, neg) in counts.items()
        for i in range(pos + neg)
    ]
    return SiteData(site=name, classes=[cls], table=pd.DataFrame(rows))


def _generate(
    data: SiteData,
    cls: str,
    rng: np.random.Generator,
    *,
    base: np.ndarray,
    direction: np.ndarray,
    feature_shift: float,
    energy_shift: float,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Non-negative features around a shared ``base`` (plus ``feature_shift`` x ``direction`` for
    positives) and energies around -4 (plus ``energy_shift`` for positives)."""
    out = {}
    for split in ("train", "val", "test"):
        y = data.split_table(split)[cls].to_numpy()
        feats = base + 0.5 * rng.random((len(y), base.size)) + feature_shift * y[:, None] * direction
        energies = -4.0 + 0.5 * rng.standard_normal(len(y)) + energy_shift * y
        out[split] = (feats.astype(np.float32), energies.astype(np.float32))
    return out


def _features() -> int:
    """The feature size of MODEL's network, which the generated features stand in for."""
    return build_model(MODEL, 1).num_features


def _run(tmp_path, uc_sites: dict[str, tuple[SiteData, dict]], config=CONFIG, hosts_extra=None):
    rng, dim = np.random.default_rng(0), _features()
    cc = _site("cc-1", CC, {"train": (40, 60), "val": (5, 5), "test": (20, 20)})
    cc_gen = _generate(cc, CC, rng, base=rng.random(dim), direction=np.zeros(dim), feature_shift=0.0, energy_shift=0.0)
    hosts = {
        "cc-1": GeneratedHost(cc, cc_gen),
        **{s: GeneratedHost(d, g) for s, (d, g) in uc_sites.items()},
        **(hosts_extra or {}),
    }
    msgs = []
    server = FedFewServer(
        inprocess_transport(hosts, msgs.append),
        sites=list(hosts),
        config=config,
        model_config=MODEL,
        out_dir=tmp_path,
        min_clients_timeout=0,
        info=msgs.append,
        warning=msgs.append,
    )
    outcome = server.run()
    evaluation = json.loads((tmp_path / "cxrfl" / "evaluation.json").read_text())
    return outcome, evaluation, msgs


def _uc(name: str, uc: str, seed: int, *, feature_shift: float, energy_shift: float, train=(20, 200), test=(200, 200)):
    rng, dim = np.random.default_rng(seed), _features()
    data = _site(name, uc, {"train": train, "val": (2, 20), "test": test})
    direction = rng.random(dim) * (rng.random(dim) < 0.5)  # the finding lights up half the features
    return data, _generate(
        data,
        uc,
        rng,
        base=rng.random(dim),
        direction=direction,
        feature_shift=feature_shift,
        energy_shift=energy_shift,
    )


def test_features_that_separate_a_uc_give_f1_of_at_least_0_9(tmp_path):
    sites = {
        "uc-hernia": _uc("uc-hernia", "Hernia", 1, feature_shift=1.0, energy_shift=3.0),
        "uc-edema": _uc("uc-edema", "Edema", 2, feature_shift=1.0, energy_shift=3.0),
    }
    outcome, evaluation, _ = _run(tmp_path, sites)
    # the threshold classifies every UC-labelled training example right (energies 3 SD apart)
    assert outcome.threshold_stats["n_out"] == 40 and outcome.threshold_stats["n_in"] == 400
    assert outcome.threshold_stats["accuracy"] >= 0.99
    for site, uc in (("uc-hernia", "Hernia"), ("uc-edema", "Edema")):
        (proto,) = outcome.detectors[uc]
        assert (proto.n_positive, proto.n_negative) == (20, 200)
        m = evaluation["sites"][site]["uc"][uc]
        assert m["n"] == 400 and m["n_positive"] == 200
        assert m["f1"] >= 0.9, m
    # issue 45: the CCs pooled per class over the sites that label them, from binned counts (here one site:
    # the pooled AUROC is that site's own, computed by scikit-learn on its scores)
    pooled = evaluation["pooled"]["classes"][CC]
    assert pooled["sites_pooled"] == ["cc-1"] and pooled["sites_labelling"] == ["cc-1"]
    assert abs(pooled["auroc"]["value"] - evaluation["sites"]["cc-1"]["cc_auroc"][CC]) <= 0.002
    assert "counts" not in evaluation["sites"]["cc-1"]  # the counts are pooled, not stored per site


def test_energies_that_do_not_separate_flag_almost_nothing_under_the_papers_rule(tmp_path):
    sites = {"uc-hernia": _uc("uc-hernia", "Hernia", 3, feature_shift=1.0, energy_shift=0.0)}
    outcome, evaluation, _ = _run(tmp_path, sites)
    feats, energies = sites["uc-hernia"][1]["test"]
    flagged = float((energies > outcome.threshold).mean())
    assert flagged <= 0.05  # 20 positives among 220: flagging costs more negatives than it finds positives
    m = evaluation["sites"]["uc-hernia"]["uc"]["Hernia"]
    assert m["n_predicted"] <= 0.05 * m["n"] and m["f1"] < 0.2


class LyingHost(GeneratedHost):
    """Sends a prototype over 3 positives (what an honest site refuses to do below the minimum)."""

    def handle(self, task, params, meta):
        if task != P.DETECTORS:
            return super().handle(task, params, meta)
        site = self.site_for(meta)
        site.set_roles(meta["cc_classes"], meta["uc_classes"])
        feats, _, table = site.embed(params, "train")
        proto = dual_prototype("Edema", feats, table["Edema"].to_numpy(dtype=float), min_images=1)
        return {}, {"prototypes": [proto.to_payload()], "refused": {}}


def test_the_prototype_minimum_is_enforced_at_the_site_and_at_the_server(tmp_path):
    few = _uc("uc-pneumonia", "Pneumonia", 4, feature_shift=1.0, energy_shift=3.0, train=(6, 200))  # 6 < 10 positives
    liar = _uc("uc-edema", "Edema", 5, feature_shift=1.0, energy_shift=3.0, train=(3, 200))
    ok = _uc("uc-hernia", "Hernia", 6, feature_shift=1.0, energy_shift=3.0)
    outcome, evaluation, msgs = _run(
        tmp_path, {"uc-pneumonia": few, "uc-hernia": ok}, hosts_extra={"uc-edema": LyingHost(*liar)}
    )
    assert set(outcome.detectors) == {"Hernia"}  # only the UC with enough images behind its prototype
    assert "only 6 positive" in outcome.refused["Pneumonia@uc-pneumonia"]
    assert any("no prototype of Pneumonia from site uc-pneumonia" in m and "at least 10 images" in m for m in msgs)
    assert any("site uc-edema sent a prototype of Edema over fewer than 10 images; left out" in m for m in msgs)
    assert "uc" not in evaluation["sites"]["uc-pneumonia"] and "uc" not in evaluation["sites"]["uc-edema"]
    assert evaluation["sites"]["uc-hernia"]["uc"]["Hernia"]["f1"] >= 0.9


def test_prototypes_of_features_that_do_not_separate_do_not_help(tmp_path):
    # energies separate but the features do not: the flagged images are matched no better than by chance
    sites = {"uc-hernia": _uc("uc-hernia", "Hernia", 7, feature_shift=0.0, energy_shift=3.0)}
    _, evaluation, _ = _run(tmp_path, sites)
    assert evaluation["sites"]["uc-hernia"]["uc"]["Hernia"]["f1"] < 0.75


class RecordingHost(GeneratedHost):
    """Keeps every task's meta it received (what the server let this site see)."""

    def __init__(self, data, generated):
        super().__init__(data, generated)
        self.received = []

    def handle(self, task, params, meta):
        self.received.append((task, json.dumps(meta, default=str)))
        return super().handle(task, params, meta)


def test_scorers_find_the_ucs_the_energy_gate_misses_and_reach_only_their_own_sites(tmp_path):
    # issue 42: energies that do not separate a UC, features that do. The paper's recipe flags
    # (almost) nothing; each UC site's scorer, fitted on its positives and negatives, finds it
    def sites():
        return {
            "uc-hernia": _uc("uc-hernia", "Hernia", 8, feature_shift=0.3, energy_shift=0.0),
            "uc-edema": _uc("uc-edema", "Edema", 9, feature_shift=0.3, energy_shift=0.0),
        }

    _, paper, _ = _run(tmp_path / "paper", sites())
    hosts = {s: RecordingHost(*v) for s, v in sites().items()}
    scorer_config = dataclasses.replace(CONFIG, detector="scorer")
    outcome, scorer, _ = _run(tmp_path / "scorer", {}, config=scorer_config, hosts_extra=hosts)
    assert outcome.detector == "scorer" and scorer["detector"] == "scorer"
    for site, uc in (("uc-hernia", "Hernia"), ("uc-edema", "Edema")):
        old, new = paper["sites"][site]["uc"][uc], scorer["sites"][site]["uc"][uc]
        assert old["balanced_accuracy"] < 0.56 and old["n_predicted"] <= 0.05 * old["n"], old
        assert new["auroc"] >= 0.95 and new["balanced_accuracy"] >= 0.85 and new["mcc"] >= 0.7, new
        assert new["auroc_ci"][0] > 0.9 and new["f1"] > new["f1_flag_all"] == pytest.approx(2 / 3)
        (s,) = outcome.detectors[uc]
        assert isinstance(s, UCScorer) and (s.n_positive, s.n_negative) == (20, 200)
        # F1 and precision also at the site's own training prevalence (20 / 220)
        assert new["at_prevalence"]["prevalence"] == pytest.approx(20 / 220)
        assert new["at_prevalence"]["precision"] <= new["precision"]
    # a site receives the scorers of its own UCs only; nothing it reads names the other's UC
    for site, other in (("uc-hernia", "Edema"), ("uc-edema", "Hernia")):
        (validate,) = [m for t, m in hosts[site].received if t == P.VALIDATE]
        assert '"scorers"' in validate
        assert not any(other in m for _, m in hosts[site].received)
    # the final model file predicts with the scorers, as the sites evaluated them
    model = FedFewModel.from_checkpoint(outcome.final_path)
    assert model.detector == "scorer" and model.uc_classes == ["Edema", "Hernia"]
    feats, energies = hosts["uc-edema"].generated["test"]
    pred = predict(model.detector, feats, energies, model.threshold, model.detectors)["Edema"]
    y = hosts["uc-edema"].data.split_table("test")["Edema"].to_numpy()
    assert roc_auc_score(y, pred["score"]) == pytest.approx(
        scorer["sites"]["uc-edema"]["uc"]["Edema"]["auroc"], abs=1e-3
    )
