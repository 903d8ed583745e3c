"""FedFew core: energy, hinge terms, threshold, prototypes, matching, votes (hand-computed values),
the minimum-count rule on what a site sends, class planning, bad input, the model file. The
server workflow over a scripted transport: ``test_fedfew_server.py``; stage 3's logic on
generated features: ``test_fedfew_stage3.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from cxrfl.cli import main
from cxrfl.data.dataset import make_loader
from cxrfl.data.site import SiteData, load_site
from cxrfl.data.site_config import SplitConfig, site_config_from_dict
from cxrfl.errors import ConfigError, DataError
from cxrfl.fedfew import protocol as P
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.energy import (
    choose_threshold,
    energy_score,
    hinge_in,
    hinge_out,
    joint_energy,
    margins_from_means,
    no_cc_targets,
    threshold_counts,
    threshold_grid,
)
from cxrfl.fedfew.learner import NO_CC, FedFewSite, stage2_classes
from cxrfl.fedfew.model import FedFewModel, fedfew_extra
from cxrfl.fedfew.plan import split_classes
from cxrfl.fedfew.prototypes import (
    DualPrototype,
    PrototypeRefused,
    cosine_distance,
    dual_prototype,
    match_prototypes,
    predict_ucs,
)
from cxrfl.fedfew.scorer import UCScorer
from cxrfl.fedfew.ssl import SimSiam, negative_cosine, simsiam_loss
from cxrfl.nn.models import CXRNet, ModelConfig, build_model, model_from_checkpoint, save_checkpoint
from PIL import Image

MODEL = ModelConfig(arch="densenet-tiny", image_size=32)  # the network is not the subject here


# ----------------------------------------------------------------------------- energy score
def test_energy_score_is_minus_t_logsumexp():
    logits = torch.tensor([[0.0, math.log(3.0)]])
    assert energy_score(logits).item() == pytest.approx(-math.log(4.0))
    # T = 2: -2 * log(exp(0) + exp(ln3 / 2)) = -2 * log(1 + sqrt(3))
    assert energy_score(logits, 2.0).item() == pytest.approx(-2 * math.log(1 + math.sqrt(3)))


def test_joint_energy_sums_binary_energies():
    logits = torch.tensor([[0.0, math.log(3.0)], [-50.0, -50.0]])
    e = joint_energy(logits)
    # row 0: -(log(1 + 1) + log(1 + 3)) = -log 8; row 1: both outputs confidently off -> ~0
    assert e[0].item() == pytest.approx(-math.log(8.0))
    assert e[1].item() == pytest.approx(0.0, abs=1e-12)
    # T = 2: -2 * (log 2 + log(1 + sqrt 3))
    assert joint_energy(logits[:1], 2.0).item() == pytest.approx(-2 * (math.log(2) + math.log(1 + math.sqrt(3))))
    # each output's energy is the softmax energy of the binary classifier (0, f_k)
    per_output = energy_score(torch.stack([torch.zeros(2), logits[0]], dim=-1))
    assert per_output.sum().item() == pytest.approx(e[0].item())
    # stable for large logits: -T * f
    assert joint_energy(torch.tensor([[1000.0]])).item() == pytest.approx(-1000.0)


# ------------------------------------------------------------------------------- hinge terms
def test_hinge_in_hand_computed_with_gradient():
    e = torch.tensor([-3.0, -1.0, 0.5], requires_grad=True)
    loss = hinge_in(e, -2.0)  # relu(e + 2) = [0, 1, 2.5] -> (0 + 1 + 6.25) / 3
    assert loss.item() == pytest.approx(7.25 / 3)
    loss.backward()
    assert e.grad.tolist() == pytest.approx([0.0, 2 * 1 / 3, 2 * 2.5 / 3])


def test_hinge_out_hand_computed_with_gradient():
    e = torch.tensor([-3.0, -1.0, 0.5], requires_grad=True)
    loss = hinge_out(e, -1.5)  # relu(-1.5 - e) = [1.5, 0, 0] -> 2.25 / 3
    assert loss.item() == pytest.approx(0.75)
    loss.backward()
    assert e.grad.tolist() == pytest.approx([-2 * 1.5 / 3, 0.0, 0.0])  # pushes the energy up


def test_hinges_of_no_image_are_zero():
    empty = torch.zeros(0)
    assert hinge_in(empty, -1.0).item() == 0.0
    assert hinge_out(empty, -1.0).item() == 0.0


def test_no_cc_target():
    nan = float("nan")
    y = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, nan], [1.0, nan], [nan, nan]])
    m = (~torch.isnan(y)).float()
    t, mk = no_cc_targets(torch.nan_to_num(y), m)
    assert t[:, 2].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert mk[:, 2].tolist() == [1.0, 1.0, 0.0, 1.0, 0.0]  # unknown when a CC is unknown and none positive
    assert torch.equal(t[:, :2], torch.nan_to_num(y)) and torch.equal(mk[:, :2], m)


def test_margins_from_warmup_means():
    assert margins_from_means(-5.0, -3.0, 1.0) == (-6.0, -2.0)
    # a warm-up model that gives UC images the lower energy: m_out above the CC mean
    assert margins_from_means(-5.0, -7.0, 1.0) == (-6.0, -4.0)
    m_in, m_out = margins_from_means(-5.0, -5.0, 0.0)
    assert m_in < m_out


# ---------------------------------------------------------------------------- threshold choice
def test_threshold_counts_and_choice_hand_computed():
    e_in, e_out = [-5.0, -4.0, -3.0, -1.0], [-2.0, 0.0, 1.0]
    grid = [-6.0, -4.5, -3.5, -2.5, -1.5, -0.5, 0.5, 1.5]
    c = threshold_counts(e_in, e_out, grid)
    assert c["in_above"] == [4, 3, 2, 1, 1, 0, 0, 0]
    assert c["out_below"] == [0, 0, 0, 0, 1, 1, 2, 3]
    assert (c["n_in"], c["n_out"]) == (4, 3)
    best = choose_threshold(grid, c["in_above"], c["out_below"], 4, 3)
    # errors 4 3 2 1 2 1 2 3: the first minimum is at -2.5 (one in image, E=-1, is flagged)
    assert best["threshold"] == -2.5
    assert best["errors"] == 1 and best["accuracy"] == pytest.approx(6 / 7)
    assert best["balanced_accuracy"] == pytest.approx((3 / 4 + 1) / 2)
    balanced = choose_threshold(grid, c["in_above"], c["out_below"], 4, 3, "balanced")
    assert balanced["threshold"] == -2.5  # 1/4 at -2.5 beats 1/3 at -0.5


def test_threshold_is_the_middle_of_the_best_interval_and_weighting_matters():
    grid = [-6.0, -4.0, -3.0, -2.0, 1.0]
    c = threshold_counts([-5.0], [0.0], grid)  # errors 1 0 0 0 1
    assert choose_threshold(grid, c["in_above"], c["out_below"], 1, 1)["threshold"] == -3.0
    # 9 in images at -1, one UC image at 0 and one at -2: counting prefers to flag only E > -1
    e_in, e_out = [-1.0] * 9, [0.0, -2.0]
    grid = [-3.0, -1.5, -0.5, 0.5]
    c = threshold_counts(e_in, e_out, grid)
    assert c["in_above"] == [9, 9, 0, 0] and c["out_below"] == [0, 1, 1, 2]
    assert choose_threshold(grid, c["in_above"], c["out_below"], 9, 2)["threshold"] == -0.5
    # balanced: flagging all in images costs 9/9 = 1, missing one UC image 1/2: still -0.5
    assert choose_threshold(grid, c["in_above"], c["out_below"], 9, 2, "balanced")["threshold"] == -0.5


def test_site_counts_add_up_to_the_pooled_counts():
    rng = np.random.default_rng(0)
    a_in, a_out, b_in, b_out = rng.normal(-4, 1, 30), rng.normal(-1, 1, 5), rng.normal(-4, 1, 20), rng.normal(-1, 1, 7)
    grid = threshold_grid(-8, 3, 64)
    ca, cb = threshold_counts(a_in, a_out, grid), threshold_counts(b_in, b_out, grid)
    pooled = threshold_counts(np.r_[a_in, b_in], np.r_[a_out, b_out], grid)
    assert np.array_equal(np.add(ca["in_above"], cb["in_above"]), pooled["in_above"])
    assert np.array_equal(np.add(ca["out_below"], cb["out_below"]), pooled["out_below"])


def test_threshold_grid_covers_the_range_with_a_step_outside():
    g = threshold_grid(-4.0, 0.0, 7)
    assert g.tolist() == pytest.approx([-5.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0])
    assert len(threshold_grid(-1.0, -1.0, 5)) == 5
    with pytest.raises(ValueError):
        threshold_grid(1.0, 0.0, 5)


# ------------------------------------------------------------------------------- prototypes
def test_dual_prototype_means_and_unknown_labels_left_out():
    f = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 0.0], [100.0, 100.0]])
    p = dual_prototype("Hernia", f, np.array([1, 1, 0, 0, np.nan]), min_images=2)
    assert p.positive.tolist() == [0.5, 0.5] and p.negative.tolist() == [1.5, 0.5]
    assert (p.n_positive, p.n_negative) == (2, 2)


def test_dual_prototype_refused_below_the_minimum():
    f = np.ones((12, 4))
    labels = np.array([1, 1] + [0] * 10)
    with pytest.raises(PrototypeRefused, match=r"only 2 positive training image\(s\).*at least 3 images"):
        dual_prototype("Hernia", f, labels, min_images=3)
    with pytest.raises(PrototypeRefused, match="only 2 positive and 2 negative"):
        dual_prototype("Hernia", f[:4], labels[:4], min_images=3)


def test_cosine_distance_hand_computed():
    assert cosine_distance(np.array([1.0, 0.0]), np.array([0.0, 1.0])) == pytest.approx(1.0)
    assert cosine_distance(np.array([1.0, 1.0]), np.array([1.0, 0.0])) == pytest.approx(1 - 1 / math.sqrt(2))
    assert cosine_distance(np.array([2.0, 2.0]), np.array([1.0, 1.0])) == pytest.approx(0.0)
    assert cosine_distance(np.zeros(2), np.array([1.0, 0.0])) == pytest.approx(1.0)


def _pair(pos, neg, uc="Hernia"):
    return DualPrototype(uc, np.array(pos, float), np.array(neg, float), 10, 10)


def test_match_to_the_nearer_prototype():
    m = match_prototypes(np.array([[2.0, 1.0], [1.0, 3.0]]), [_pair([1, 0], [0, 1])])
    # x = (2, 1): d+ = 1 - 2/sqrt5, d- = 1 - 1/sqrt5 -> positive with margin 1/sqrt5
    assert m["positive"].tolist() == [True, False]
    assert m["margin"][0] == pytest.approx(1 / math.sqrt(5))
    # x = (1, 3): d+ = 1 - 1/sqrt10, d- = 1 - 3/sqrt10 -> negative with margin -2/sqrt10
    assert m["margin"][1] == pytest.approx(-2 / math.sqrt(10))


def test_majority_vote_across_sites():
    x = np.array([[2.0, 1.0]])
    a, b, c = _pair([1, 0], [0, 1]), _pair([1, 0], [0, 1]), _pair([0, 1], [1, 0])
    m = match_prototypes(x, [a, b, c])
    assert m["votes"].tolist() == [2] and m["pairs"] == 3 and m["positive"].tolist() == [True]
    assert match_prototypes(x, [a, c, _pair([0, 1], [1, 0])])["positive"].tolist() == [False]  # 1 of 3
    # a tie goes to the summed margins: +1/sqrt5 (a) against (1 - 3/sqrt10) - (1 - 1/sqrt5) (d)
    d = _pair([0, 1], [1, 1])
    tie = match_prototypes(x, [a, d])
    assert tie["votes"].tolist() == [1]
    expected = (1 / math.sqrt(5) + (1 - 3 / math.sqrt(10)) - (1 - 1 / math.sqrt(5))) / 2
    assert tie["margin"][0] == pytest.approx(expected)
    assert tie["positive"].tolist() == [expected > 0] == [False]


def test_uc_predicted_only_above_the_energy_threshold():
    f = np.array([[2.0, 1.0], [2.0, 1.0], [1.0, 3.0]])
    out = predict_ucs(f, np.array([-5.0, -1.0, -1.0]), -2.0, {"Hernia": [_pair([1, 0], [0, 1])]})
    assert out["Hernia"]["flagged"].tolist() == [False, True, True]
    assert out["Hernia"]["positive"].tolist() == [False, True, False]


def test_prototype_payload_round_trip_and_checks():
    p = _pair([1, 2], [3, 4])
    q = DualPrototype.from_payload(json.loads(json.dumps(p.to_payload())))
    assert q.positive.tolist() == [1, 2] and q.uc == "Hernia" and q.n_positive == 10
    with pytest.raises(ValueError):
        DualPrototype.from_payload({**p.to_payload(), "negative": [1.0]})
    with pytest.raises(ValueError):
        DualPrototype.from_payload({**p.to_payload(), "positive": [float("nan"), 1.0]})


# ----------------------------------------------------------------------------------- SimSiam
def test_simsiam_loss_and_stop_gradient():
    p = torch.tensor([[1.0, 0.0]], requires_grad=True)
    z = torch.tensor([[1.0, 1.0]], requires_grad=True)
    loss = negative_cosine(p, z)
    assert loss.item() == pytest.approx(-1 / math.sqrt(2))
    loss.backward()
    assert z.grad is None and p.grad is not None  # stop-gradient on the projection
    same = torch.randn(4, 8)
    assert simsiam_loss(same, same, same, same).item() == pytest.approx(-1.0)


def test_simsiam_encoder_keys_match_the_network():
    net = CXRNet(MODEL, 3)
    ssl = SimSiam(net, 64, 16)
    enc = {k for k in ssl.state_dict() if k.startswith("backbone.")}
    assert enc == {k for k in net.state_dict() if k.startswith("backbone.")}
    x = torch.randn(2, 3, 32, 32)
    p1, p2, z1, z2 = ssl(x, x)
    assert p1.shape == z1.shape == (2, 64)


# ------------------------------------------------------------------------------- config, plan
def test_config_validation():
    cfg = FedFewConfig()
    assert cfg.temperature == 1.0 and cfg.min_prototype_images == 10 and not cfg.margins_given
    assert FedFewConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ConfigError, match="unknown fedfew setting"):
        FedFewConfig.from_dict({"tmperature": 1})
    with pytest.raises(ConfigError, match="m_in"):
        FedFewConfig(m_in=-1.0, m_out=-2.0)
    with pytest.raises(ConfigError, match="min_prototype_images"):
        FedFewConfig(min_prototype_images=0)
    with pytest.raises(
        ConfigError, match="fedfew.uc_negatives 'in' pushes .* fedfew.uc_energy_on 'all' pushes them up"
    ):
        FedFewConfig(uc_negatives="in", uc_energy_on="all")
    with pytest.raises(ConfigError, match="uc_negatives"):
        FedFewConfig(uc_negatives="out")


def _info(classes, pos, neg, n_labelled=100, n_ssl=120):
    return {
        "classes": classes,
        "n_labelled": n_labelled,
        "n_ssl": n_ssl,
        "positives": dict(zip(classes, pos)),
        "negatives": dict(zip(classes, neg)),
    }


def test_split_classes_into_ccs_and_ucs():
    cc = ["Atelectasis", "Cardiomegaly"]
    infos = {
        "cc-1": _info(cc, [30, 40], [70, 60]),
        "cc-2": _info(cc, [20, 10], [80, 90]),
        "uc-1": _info(["Hernia"], [14], [140]),
        "uc-2": _info(["Edema"], [4], [150]),
        "big": _info(["Fracture"], [500], [500]),  # one site but many positives: a CC
        "blank": _info(["Mass"], [0], [0], n_labelled=0),
    }
    plan = split_classes(infos, FedFewConfig())
    assert plan.cc_classes == ["Atelectasis", "Cardiomegaly", "Fracture"]
    assert plan.uc_classes == ["Edema", "Hernia"]
    assert plan.uc_sites == {"Edema": ["uc-2"], "Hernia": ["uc-1"]}
    assert plan.site_ucs["uc-1"] == ["Hernia"] and plan.site_ucs["cc-1"] == []
    assert "blank" not in plan.stage2_sites and "blank" in plan.ssl_sites
    assert plan.cc_sites == ["big", "cc-1", "cc-2"]
    notes = "\n".join(plan.notes)
    assert "site blank has no labelled training image" in notes
    assert "site uc-2 labels UC 'Edema' with 4 positive" in notes and "refuse to send that prototype" in notes
    explicit = split_classes(infos, FedFewConfig(uc_classes=("Hernia",)))
    assert explicit.uc_classes == ["Hernia"] and "Edema" in explicit.cc_classes


def test_stage2_outputs_end_with_no_cc():
    assert stage2_classes(["A", "B"]) == ["A", "B", NO_CC]


# ------------------------------------------------------------------- a tiny site on disk
def _csv_site(
    tmp: Path, name: str, labels: dict[str, list[float]], n: int, seed: int = 0, split: SplitConfig | None = None
) -> SiteData:
    rng = np.random.default_rng(seed)
    folder = tmp / name
    (folder / "images").mkdir(parents=True)
    rows = []
    for i in range(n):
        path = f"images/{i}.png"
        Image.fromarray((rng.random((32, 32)) * 255).astype(np.uint8)).save(folder / path)
        rows.append({"path": path, "patient_id": f"p{i}", **{c: v[i] for c, v in labels.items()}})
    pd.DataFrame(rows).to_csv(folder / "labels.csv", index=False)
    cfg = site_config_from_dict(
        {
            "site": name,
            "dataset": {"format": "csv", "labels": "labels.csv", "images": ".", "patient_column": "patient_id"},
            "split": (split or SplitConfig(train=0.8, val=0.2, test=0.0)).__dict__,
        },
        base_dir=folder,
    )
    return load_site(cfg, check_images=False)


def _site(data: SiteData, cfg: FedFewConfig, uc=("Hernia",), cc=("Atelectasis",)) -> FedFewSite:
    site = FedFewSite(data, model_config=MODEL, config=cfg)
    site.set_roles(list(cc), [u for u in uc if u in data.classes])
    return site


def _params(n_out: int = 2) -> dict[str, np.ndarray]:
    torch.manual_seed(0)
    return {k: v.numpy() for k, v in build_model(MODEL, n_out).state_dict().items()}


def test_site_refuses_prototypes_below_the_minimum(tmp_path):
    labels = {"Hernia": [1.0] * 4 + [0.0] * 16}  # ~3 positives in the training split
    data = _csv_site(tmp_path, "uc-few", labels, 20)
    n_pos = data.positives("train")["Hernia"]
    assert 0 < n_pos < 5
    site = _site(data, FedFewConfig(min_prototype_images=5))
    params = _params()
    params_out, answer = P.handle_task(
        site, P.DETECTORS, params, {"cc_classes": ["Atelectasis"], "uc_classes": ["Hernia"]}
    )
    assert params_out == {}
    assert answer["prototypes"] == []  # nothing about the class leaves the site
    msg = answer["refused"]["Hernia"]
    assert "site uc-few" in msg and f"only {n_pos} positive" in msg and "at least 5 images" in msg and "not sent" in msg
    wire = json.dumps(answer)
    assert 'positive"' not in wire and 'negative"' not in wire
    # with a lower minimum the same site sends both means, and only the means
    site = _site(data, FedFewConfig(min_prototype_images=2))
    _, ok = P.handle_task(site, P.DETECTORS, params, {"cc_classes": ["Atelectasis"], "uc_classes": ["Hernia"]})
    assert ok["refused"] == {}
    (proto,) = ok["prototypes"]
    assert proto["uc"] == "Hernia" and proto["n_positive"] == n_pos and proto["n_negative"] >= 2
    assert len(proto["positive"]) == len(proto["negative"]) == build_model(MODEL, 1).num_features
    assert set(proto) == {"uc", "positive", "negative", "n_positive", "n_negative", "source"}


def test_site_sends_a_scorer_rule_only_and_refuses_below_the_minimum(tmp_path):
    labels = {"Hernia": [1.0, 0.0, 0.0, 0.0, 0.0] * 16}  # 16 positives, ~13 in the training split
    data = _csv_site(tmp_path, "uc-scored", labels, 80)
    n_pos, n_train = data.positives("train")["Hernia"], len(data.split_table("train"))
    assert 10 <= n_pos < 16
    meta = {"cc_classes": ["Atelectasis"], "uc_classes": ["Hernia"]}
    site = _site(data, FedFewConfig(detector="scorer", min_prototype_images=10, scorer_folds=3))
    _, answer = P.handle_task(site, P.DETECTORS, _params(), meta)
    (scorer,) = answer["scorers"]
    assert "prototypes" not in answer and answer["refused"] == {}
    assert (scorer["n_positive"], scorer["n_negative"]) == (n_pos, n_train - n_pos)
    assert len(scorer["weights"]) == build_model(MODEL, 1).num_features  # one weight per feature
    assert np.isfinite(scorer["weights"]).all()
    # the rule, applied to the site's own features, is what the site would decide
    feats, _, table = site.embed(_params(), "train")
    rule = UCScorer.from_payload(scorer)
    assert rule.margin(feats).shape == (len(table),)
    # scorer_model: prototype: the config reaches the site, and its rule is the two unit-length means' difference
    site = _site(
        data, FedFewConfig(detector="scorer", scorer_model="prototype", min_prototype_images=10, scorer_folds=3)
    )
    _, answer = P.handle_task(site, P.DETECTORS, _params(), meta)
    (proto,) = answer["scorers"]
    y = table["Hernia"].to_numpy() == 1.0
    means = [f / np.linalg.norm(f) for f in (feats[y].mean(0), feats[~y].mean(0))]
    assert proto["unit_input"] and proto["bias"] == 0.0
    np.testing.assert_allclose(proto["weights"], means[0] - means[1], rtol=1e-4, atol=1e-6)
    site = _site(data, FedFewConfig(detector="scorer", min_prototype_images=n_pos + 1))
    _, refused = P.handle_task(site, P.DETECTORS, _params(), meta)
    assert refused["scorers"] == [] and f"only {n_pos} positive" in refused["refused"]["Hernia"]


def test_site_without_labelled_images_gets_a_clear_message(tmp_path):
    data = _csv_site(tmp_path, "blank", {"Atelectasis": [float("nan")] * 10}, 10)
    site = _site(data, FedFewConfig(), uc=())
    info = site.info()
    assert info["n_labelled"] == 0 and info["n_ssl"] == 10
    with pytest.raises(DataError, match="site blank: no labelled training image; it cannot take part in stage 2"):
        site.train_round(_params(), 1, energy_weight=0.0, m_in=None, m_out=None)


def test_site_roles_losses_and_threshold_examples(tmp_path):
    cc = _csv_site(tmp_path, "cc", {"Atelectasis": [1.0, 0.0] * 6}, 12, seed=1)
    uc = _csv_site(tmp_path, "uc", {"Hernia": [1.0] * 4 + [0.0] * 8}, 12, seed=2)
    cfg = FedFewConfig(batch_size=4, min_prototype_images=1, augment=False)
    cc_site, uc_site = _site(cc, cfg, uc=()), _site(uc, cfg)
    t = uc_site.role_table("train")
    assert t["Atelectasis"].isna().all()  # a CC the UC site does not label: unknown, never negative
    assert (t["__fedfew_out__"] == (t["Hernia"] == 1.0)).all() and (t["__fedfew_in__"] == 0).all()
    params = _params()
    upd = cc_site.train_round(params, 1, energy_weight=0.1, m_in=-3.0, m_out=-1.0)
    assert upd.num_samples == len(cc.split_table("train")) and upd.metrics["steps"] > 0
    assert upd.metrics["train_hinge_out"] == 0.0
    upd = uc_site.train_round(params, 1, energy_weight=0.1, m_in=-3.0, m_out=-1.0)
    assert upd.metrics["train_bce"] == 0.0 and upd.metrics["train_hinge_out"] > 0  # at init E ~ -1.39 < m_out
    assert upd.num_samples == len(uc.split_table("train"))
    # warm-up (lambda 0): a UC site has no loss term at all
    assert uc_site.train_round(params, 1, energy_weight=0.0, m_in=None, m_out=None).metrics["steps"] == 0
    # threshold examples: UC-labelled images only by default; CC images too with "all"
    assert cc_site.energy_range(params)["n_in"] == 0
    r = uc_site.energy_range(params)
    assert (r["n_in"], r["n_out"]) == (
        (uc.split_table("train")["Hernia"] == 0).sum(),
        (uc.split_table("train")["Hernia"] == 1).sum(),
    )
    all_site = _site(cc, FedFewConfig(threshold_examples="all"), uc=())
    assert all_site.energy_range(params)["n_in"] == len(cc.split_table("train"))
    means = cc_site.energy_means(params)
    assert means["n_in"] == len(cc.split_table("train")) and means["n_out"] == 0


def test_stage2_round_reports_the_mean_energy_of_each_role_from_the_weights_it_received(tmp_path):
    """One batch (no augmentation, float32): the energies it reports are those of the received weights on
    that batch in training mode, -sum softplus(logits), averaged over the UC positives and negatives."""
    uc = _csv_site(tmp_path, "uc", {"Hernia": [1.0] * 4 + [0.0] * 8}, 12, seed=2)
    site = _site(uc, FedFewConfig(batch_size=64, augment=False, precision="fp32"))
    params = _params()
    metrics = site.train_round(params, 1, energy_weight=0.1, m_in=-3.0, m_out=-1.0).metrics
    table = site.stage2_table()
    net = build_model(MODEL, 2)
    net.load_state_dict({k: torch.as_tensor(v) for k, v in params.items()})
    net.train()
    ((x, _, _),) = make_loader(table, [], image_size=32, train=False, batch_size=64)
    with torch.no_grad():
        energy = -torch.nn.functional.softplus(net(x)).sum(dim=1).numpy()
    pos = table["Hernia"].to_numpy() == 1.0
    assert 0 < pos.sum() < len(pos)
    assert metrics["train_energy_out"] == pytest.approx(float(energy[pos].mean()), abs=1e-4)
    assert metrics["train_energy_uc_neg"] == pytest.approx(float(energy[~pos].mean()), abs=1e-4)
    assert metrics["train_energy_in"] is None and metrics["train_hinge_in"] == 0.0
    # uc_negatives "in": the same negatives are also "in" images, pushed below m_in (E ~ -1.4 > -3 at init)
    site = _site(uc, FedFewConfig(batch_size=64, augment=False, precision="fp32", uc_negatives="in"))
    t = site.role_table("train")
    assert (t["__fedfew_in__"] == (t["Hernia"] == 0.0)).all() and (t["__fedfew_out__"] == (t["Hernia"] == 1.0)).all()
    metrics = site.train_round(params, 1, energy_weight=0.1, m_in=-3.0, m_out=-1.0).metrics
    assert metrics["train_energy_in"] == pytest.approx(float(energy[~pos].mean()), abs=1e-4)
    assert metrics["train_hinge_in"] == pytest.approx(float(((energy[~pos] + 3.0) ** 2).mean()), rel=1e-3)
    assert site.energy_means(params)["n_in"] == (~pos).sum()


# ------------------------------------------------------------------------------ model file
@pytest.fixture()
def fedfew_checkpoint(tmp_path):
    torch.manual_seed(0)
    net = build_model(MODEL, 3)
    rng = np.random.default_rng(0)
    protos = {"Hernia": [DualPrototype("Hernia", *rng.random((2, net.num_features)).astype(np.float32), 12, 120)]}
    extra = fedfew_extra(
        cc_classes=["Atelectasis", "Cardiomegaly"],
        threshold=-100.0,
        temperature=1.0,
        energy_outputs="all",
        detector="paper",
        detectors=protos,
        min_prototype_images=10,
    )
    path = tmp_path / "fedfew.pt"
    save_checkpoint(path, net, classes=stage2_classes(["Atelectasis", "Cardiomegaly"]), model_config=MODEL, extra=extra)
    image = tmp_path / "x.png"
    Image.fromarray((rng.random((40, 40)) * 255).astype(np.uint8)).save(image)
    return path, image


def test_fedfew_checkpoint_is_an_ordinary_checkpoint(fedfew_checkpoint):
    path, _ = fedfew_checkpoint
    net, classes, cfg = model_from_checkpoint(path)
    assert classes == ["Atelectasis", "Cardiomegaly", NO_CC] and cfg == MODEL
    ff = FedFewModel.from_checkpoint(path)
    assert ff.cc_classes == ["Atelectasis", "Cardiomegaly"] and ff.uc_classes == ["Hernia"] and ff.threshold == -100.0
    torch.manual_seed(1)
    x = torch.randn(6, 3, 32, 32)
    out = ff.predict(x)
    net.eval()
    with torch.no_grad():
        logits = net(x)
    energy = -torch.nn.functional.softplus(logits).sum(dim=1).numpy()  # joint energy over all 3 outputs, T = 1
    np.testing.assert_allclose(out["energy"], energy, rtol=1e-5)
    np.testing.assert_allclose(out["cc_probabilities"], torch.sigmoid(logits[:, :2]).numpy(), rtol=1e-5)
    assert out["flagged"].all() and out["uc"]["Hernia"]["positive"].shape == (6,)  # nothing is below -100
    # issue 44 point 3: -100 flags every image; a threshold inside the batch's energies must split it
    mid = float(np.median(energy))
    extra = fedfew_extra(
        cc_classes=["Atelectasis", "Cardiomegaly"],
        threshold=mid,
        temperature=1.0,
        energy_outputs="all",
        detector="paper",
        detectors={},
        min_prototype_images=10,
    )
    save_checkpoint(path.with_name("mid.pt"), net, classes=classes, model_config=cfg, extra=extra)
    flagged = FedFewModel.from_checkpoint(path.with_name("mid.pt")).predict(x)["flagged"]
    assert flagged.tolist() == (energy > mid).tolist() and 0 < flagged.sum() < len(x)


def test_predict_prints_the_uc_outputs_of_a_fedfew_model(fedfew_checkpoint, capsys):
    path, image = fedfew_checkpoint
    assert main(["predict", "--model", str(path), str(image), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert list(row["probabilities"]) == ["Atelectasis", "Cardiomegaly"]  # "no CC" is not a finding
    assert set(row["underrepresented"]) == {"Hernia"}
    assert row["underrepresented"]["Hernia"]["pairs"] == 1 and row["energy_threshold"] == -100.0
    assert main(["predict", "--model", str(path), str(image)]) == 0
    text = capsys.readouterr().out
    assert "may hold a rare class" in text and "Hernia" in text and "prototype vote" in text
    assert main(["predict", "--model", str(path), str(image), "--csv"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert (
        header == "image,Atelectasis,Cardiomegaly,energy,Hernia,error"
    )  # the error column is empty for readable images


def test_predict_reports_the_scorers_vote_without_an_energy_gate(tmp_path, fedfew_checkpoint, capsys):
    old, image = fedfew_checkpoint
    net, classes, cfg = model_from_checkpoint(old)
    w = np.zeros(net.num_features, np.float32)
    scorer = UCScorer("Hernia", w, 1.0, 0.25, 12, 120, 0.8)  # margin 0.75 for every image: present
    extra = fedfew_extra(
        cc_classes=["Atelectasis", "Cardiomegaly"],
        threshold=1e9,  # the energy flags nothing; the scorer does not look at it
        temperature=1.0,
        energy_outputs="all",
        detector="scorer",
        detectors={"Hernia": [scorer]},
        min_prototype_images=10,
    )
    path = tmp_path / "scorer.pt"
    save_checkpoint(path, net, classes=classes, model_config=cfg, extra=extra)
    assert main(["predict", "--model", str(path), str(image), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["detector"] == "scorer"
    assert row["underrepresented"]["Hernia"] == {"present": True, "votes": 1, "pairs": 1, "margin": 0.75}
    assert main(["predict", "--model", str(path), str(image)]) == 0
    text = capsys.readouterr().out
    assert "Hernia" in text and "1/1 scorer vote(s), margin +0.7500" in text and "energy" not in text


def test_plain_checkpoint_still_predicts_every_class(tmp_path, fedfew_checkpoint, capsys):
    _, image = fedfew_checkpoint
    path = tmp_path / "plain.pt"
    save_checkpoint(path, build_model(MODEL, 2), classes=["Atelectasis", "Hernia"], model_config=MODEL)
    assert main(["predict", "--model", str(path), str(image), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert list(row) == ["image", "probabilities"] and list(row["probabilities"]) == ["Atelectasis", "Hernia"]


def test_malformed_fedfew_entry_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.pt"
    save_checkpoint(
        path,
        build_model(MODEL, 3),
        classes=["A", "B", NO_CC],
        model_config=MODEL,
        extra={"fedfew": {"cc_classes": ["A"]}},
    )
    with pytest.raises(ConfigError, match="malformed FedFew entry"):
        FedFewModel.from_checkpoint(path)


def test_job_tasks_match_the_protocol():
    from cxrfl.jobs import FEDFEW_TASKS, JOBS

    assert FEDFEW_TASKS == P.TASKS
    spec = next(j for j in JOBS if j.name == "fedfew")
    assert spec.tasks == P.TASKS and spec.controller == "cxrfl.fl.fedfew.FedFew"
    FedFewConfig.from_dict(spec.controller_args["fedfew_config"])
