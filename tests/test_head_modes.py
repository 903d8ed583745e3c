"""Head modes (the papers' federated baselines): payloads, aggregation, site learners, and the
surgical-aggregation server loop run in process for each mode (small synthetic sites, 32x32)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from cxrfl.common.io import to_numpy
from cxrfl.data.site import SiteData, load_site
from cxrfl.nn.models import HEAD_PREFIX, ModelConfig, batchnorm_keys, build_model, load_checkpoint, save_checkpoint
from cxrfl.nn.threads import torch_threads
from cxrfl.nn.training import TrainConfig
from cxrfl.surgical.aggregation import aggregate
from cxrfl.surgical.config import SurgicalConfig
from cxrfl.surgical.head_modes import payload_for
from cxrfl.surgical.inprocess import global_model, run_surgical
from cxrfl.surgical.learner import SiteLearner
from cxrfl.synth import write_profile

MODEL = ModelConfig(arch="densenet-tiny", image_size=32)  # the network is not the subject here
TRAIN = TrainConfig(
    lr=1e-3, warmup_lr=5e-3, warmup_epochs=1, batch_size=8, max_steps_per_epoch=1, augment=False, seed=0
)
W, B = HEAD_PREFIX + "weight", HEAD_PREFIX + "bias"


def initial_state(model: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """The initial feature extractor the server builds for ``seed`` (what the warm-up receives)."""
    torch.manual_seed(seed)
    return {k: v for k, v in to_numpy(build_model(model, 1).state_dict()).items() if not k.startswith(HEAD_PREFIX)}


def fake(site: str, classes: list[str], body: float, rows: list[float] | None = None) -> dict:
    rows = rows if rows is not None else [float(i) for i in range(len(classes))]
    return {
        "site": site,
        "classes": classes,
        "num_samples": 10,
        "params": {
            "body.w": np.full(3, body, np.float32),
            W: np.array([[r, r] for r in rows], np.float32),
            B: np.array(rows, np.float32),
        },
    }


# ------------------------------------------------------------------ server side, pure functions
def test_payloads_per_head_mode():
    global_params = {
        "body.w": np.ones(3, np.float32),
        W: np.arange(6, dtype=np.float32).reshape(3, 2),
        B: np.arange(3, dtype=np.float32),
    }
    classes = ["x", "y", "z"]
    p, sent = payload_for(global_params, classes, ["z", "x"], head_mode="surgical")
    assert sent is None and p[W].tolist() == [[4, 5], [0, 1]]  # own rows, in the site's order
    p, sent = payload_for(global_params, classes, ["z", "x"], head_mode="union")
    assert sent == classes and p[W].shape == (3, 2)  # every row and every class name
    p, sent = payload_for(global_params, classes, ["z", "x"], head_mode="local", exclude={"body.w"})
    assert sent is None and p == {}  # no head, no excluded key
    p, _ = payload_for(global_params, classes, ["x"], head_mode="local")
    assert set(p) == {"body.w"}


def test_local_aggregation_averages_the_feature_extractor_only():
    updates = [fake("a", ["x"], 1.0), fake("b", ["y", "z"], 3.0)]
    for u in updates:
        del u["params"][W], u["params"][B]
    params, classes = aggregate(updates, head_mode="local")
    assert classes == [] and set(params) == {"body.w"}
    np.testing.assert_allclose(params["body.w"], 2.0)


def test_union_aggregation_is_fedavg_and_needs_equal_class_sets():
    a, b = fake("a", ["x", "y"], 1.0, [1.0, 2.0]), fake("b", ["x", "y"], 3.0, [3.0, 6.0])
    params, classes = aggregate([a, b], head_mode="union")
    assert classes == ["x", "y"]
    # issue 44 point 3: every entry against the hand-computed mean, not against the function union mode calls
    assert set(params) == {"body.w", W, B}
    np.testing.assert_allclose(params["body.w"], [2.0, 2.0, 2.0])  # (1 + 3) / 2
    np.testing.assert_allclose(params[W], [[2.0, 2.0], [4.0, 4.0]])  # x: (1 + 3) / 2, y: (2 + 6) / 2
    np.testing.assert_allclose(params[B], [2.0, 4.0])
    with pytest.raises(ValueError, match="same classes"):
        aggregate([a, fake("c", ["x"], 0.0)], head_mode="union")


# ------------------------------------------------------------------ sites
@pytest.fixture(scope="module")
def sites(tmp_path_factory) -> list[SiteData]:
    root = tmp_path_factory.mktemp("heads")
    cfgs = write_profile("two-hospitals", root, n_per_site=40, image_size=32, sites=["hospital-a", "hospital-b"])
    return [load_site(p, check_images=False) for p in cfgs]


def restricted(site: SiteData, classes: list[str], name: str | None = None) -> SiteData:
    table = site.table[["path", "patient", "split", *classes]].copy()
    return SiteData(site=name or site.site, classes=list(classes), table=table)


def test_union_head_labels_missing_classes_as_told(sites, tmp_path):
    a = sites[0]
    union = sorted(set(sites[0].classes) | set(sites[1].classes))
    foreign = [c for c in union if c not in a.classes]
    for missing, fill in (("negative", 0.0), ("ignore", None)):
        learner = SiteLearner(
            a, tmp_path / missing, model_config=MODEL, train_config=TRAIN, head_mode="union", missing=missing
        )
        learner.set_head_classes(union)
        table = learner.split_table("train")
        assert list(learner.model.classifier.weight.shape) == [len(union), learner.model.num_features]
        for c in foreign:
            assert table[c].isna().all() if fill is None else (table[c] == fill).all()
        pd.testing.assert_series_equal(table[a.classes[0]], a.split_table("train")[a.classes[0]])


def test_a_vanilla_site_is_selected_on_its_own_classes_unless_told_otherwise(sites, tmp_path):
    # issue 41 point 4: vanilla FL trains on other sites' classes as negatives; its validation
    # loss, which selects the global model, counts them only under the old rule (selection="head")
    a = sites[0]
    union = sorted(set(sites[0].classes) | set(sites[1].classes))
    foreign = [c for c in union if c not in a.classes]
    losses = {}
    for selection in ("annotated", "head"):
        learner = SiteLearner(
            a, tmp_path / selection, model_config=MODEL, train_config=TRAIN, head_mode="union", selection=selection
        )
        learner.set_head_classes(union)
        assert all((learner.split_table("train")[c] == 0.0).all() for c in foreign)  # trained as negatives
        val = learner.split_table("val")
        assert all(val[c].isna().all() if selection == "annotated" else (val[c] == 0.0).all() for c in foreign)
        torch.manual_seed(0)
        learner.model.load_state_dict(build_model(MODEL, len(union)).state_dict())
        losses[selection] = learner.validate("val")
    # by hand: BCE over the site's own labels only, from the probabilities the model gave
    res = losses["head"]
    own = [union.index(c) for c in a.classes]
    y, p = res.y_true[:, own], np.clip(res.scores[:, own].astype(np.float64), 1e-7, 1 - 1e-7)
    m = res.mask[:, own]
    by_hand = float(-(m * (y * np.log(p) + (1 - y) * np.log(1 - p))).sum() / m.sum())
    assert losses["annotated"].loss == pytest.approx(by_hand, rel=1e-4)
    assert losses["annotated"].mask[:, [union.index(c) for c in foreign]].sum() == 0
    # the old rule counts the foreign zeros too: by hand over the own labels and every foreign entry as a negative
    far = [union.index(c) for c in foreign]
    q = np.clip(res.scores[:, far].astype(np.float64), 1e-7, 1 - 1e-7)
    by_hand_head = float(
        (-(m * (y * np.log(p) + (1 - y) * np.log(1 - p))).sum() - np.log(1 - q).sum()) / (m.sum() + q.size)
    )
    assert losses["head"].loss == pytest.approx(by_hand_head, rel=1e-4)
    assert res.mask[:, far].all() and by_hand_head != pytest.approx(by_hand, rel=1e-6)
    with pytest.raises(ValueError, match="selection must be one of"):
        SiteLearner(a, tmp_path / "bad", model_config=MODEL, train_config=TRAIN, selection="all")


def test_union_site_trains_and_sends_every_row(sites, tmp_path):
    a = sites[0]
    union = sorted(set(sites[0].classes) | set(sites[1].classes))
    learner = SiteLearner(a, tmp_path, model_config=MODEL, train_config=TRAIN, head_mode="union", missing="ignore")
    warm = learner.warmup(initial_state(MODEL, 0))
    assert warm.classes == a.classes  # the warm-up is the same in every mode: own rows
    d = learner.model.num_features
    params, _ = payload_for(
        {**warm.params, W: np.zeros((len(union), d), np.float32), B: np.zeros(len(union), np.float32)},
        union,
        a.classes,
        head_mode="union",
    )
    with pytest.raises(ValueError, match="needs the class order"):
        learner.train_round(params, 1)
    upd = learner.train_round(params, 1, classes=union)
    assert upd.classes == union and upd.params[W].shape == (len(union), d)
    foreign = [union.index(c) for c in union if c not in a.classes]
    # partial loss: rows of classes the site does not annotate get no gradient (Adam from zero state: no step)
    np.testing.assert_array_equal(upd.params[W][foreign], 0.0)
    own = [union.index(c) for c in a.classes]
    assert np.abs(upd.params[W][own]).sum() > 0


def test_personalized_site_never_sends_or_accepts_head_rows(sites, tmp_path):
    a = sites[0]
    init = initial_state(MODEL, 0)
    learner = SiteLearner(a, tmp_path, model_config=MODEL, train_config=TRAIN, head_mode="local")
    warm = learner.warmup(init)
    assert not any(k.startswith(HEAD_PREFIX) for k in warm.params)
    head = {k: v.clone() for k, v in learner.model.state_dict().items() if k.startswith(HEAD_PREFIX)}
    upd = learner.train_round(warm.params, 1)
    assert not any(k.startswith(HEAD_PREFIX) for k in upd.params)
    trained_head = {k: v.clone() for k, v in learner.model.state_dict().items() if k.startswith(HEAD_PREFIX)}
    assert not torch.equal(trained_head[W], head[W])  # the head did train, at the site
    rebuilt = SiteLearner(a, tmp_path, model_config=MODEL, train_config=TRAIN, head_mode="local")  # simulator -t 1
    rebuilt.load_params(upd.params)
    for k, v in trained_head.items():
        torch.testing.assert_close(rebuilt.model.state_dict()[k], v)
    with pytest.raises(ValueError, match="never received"):
        rebuilt.train_round({**upd.params, W: trained_head[W].numpy(), B: trained_head[B].numpy()}, 2)


def test_surgical_site_refuses_a_head_for_other_classes(sites, tmp_path):
    learner = SiteLearner(sites[0], tmp_path, model_config=MODEL, train_config=TRAIN)
    params = learner.outgoing_params()
    with pytest.raises(ValueError, match="other classes"):
        learner.train_round(params, 1, classes=["Hernia"])


# ------------------------------------------------------------------ the server loop, in process
def _run(sites, tmp_path, rounds: int = 1, train: TrainConfig = TRAIN, **kw):
    config = SurgicalConfig(
        num_rounds=rounds,
        min_clients=len(sites),
        model_config=MODEL,
        train_config=train,
        min_clients_timeout=0,
        evaluate_test=False,
        seed=0,
        **kw,
    )
    return run_surgical(sites, config, tmp_path)


def test_vanilla_fl_with_identical_label_sets_equals_surgical_aggregation(sites, tmp_path):
    shared = sorted(set(sites[0].classes) & set(sites[1].classes))  # sorted: own order = union order
    same = [restricted(s, shared) for s in sites]
    surgical = _run(same, tmp_path / "s")
    for missing in ("negative", "ignore"):  # vanilla FL and FL with partial loss
        union = _run(same, tmp_path / missing, head_mode="union", missing=missing)
        assert union.classes == surgical.classes == shared
        assert union.curve("mean_val_loss") == pytest.approx(surgical.curve("mean_val_loss"), abs=1e-6)
        assert union.best_round == surgical.best_round
        for k, v in surgical.outcome.best_params.items():
            np.testing.assert_allclose(union.outcome.best_params[k], v, rtol=1e-5, atol=1e-6, err_msg=k)


def test_personalized_fl_sends_only_the_feature_extractor(sites, tmp_path):
    res = _run(sites, tmp_path / "pfl", head_mode="local", batchnorm="fedbn")
    assert res.classes == [] and not any(k.startswith(HEAD_PREFIX) for k in res.outcome.best_params)
    assert set(res.site_states) == {s.site for s in sites}
    for s in sites:
        assert res.site_states[s.site][W].shape[0] == len(s.classes)
    surgical = _run(sites, tmp_path / "sa")
    row_bytes = (build_model(MODEL, 1).num_features + 1) * 4  # one float32 head row and its bias
    head_bytes = {s.site: len(s.classes) * row_bytes for s in sites}
    for s in sites:  # surgical sends the same feature extractor plus its own rows; personalized FL without them
        bn = surgical.comm[s.site]["down"] - res.comm[s.site]["down"] - head_bytes[s.site]
        assert bn > 0  # FedBN keeps BatchNorm at the site as well
        assert res.comm[s.site]["up"] == res.comm[s.site]["down"]


def test_one_site_run_is_local_training_and_selects_the_lowest_validation_loss(sites, tmp_path):
    with torch_threads(1):  # the trajectory below is this arithmetic's (2 threads sum in another order)
        res = _run(sites[:1], tmp_path, rounds=3, train=TRAIN.replace(lr=5e-2), min_delta=0.0, patience=5)
    assert res.classes == sorted(sites[0].classes)
    losses = res.curve("mean_val_loss")
    assert [p["round"] for p in res.outcome.curve] == [0, 1, 2, 3]  # the models of rounds 0 to 3 were scored
    assert res.best_round == int(np.argmin(losses))
    # issue 44 point 3: the weights were compared only if best_round > 0. Seed 0's large learning rate lowers
    # the validation loss in round 1 and overshoots far from round 2 on (measured 0.62, 0.56, 1.3, 5.1 here;
    # 0.62, 0.50, 3.0, 13.9 with 2 threads): the lowest is neither the warm-up's nor the last round's, so
    # keeping the first or the last model fails
    assert res.best_round == 1 and losses[1] < losses[0] - 0.02 and min(losses[2:]) > losses[1] + 0.2
    best = load_checkpoint(tmp_path / "best_FL_global_model.pt")
    assert best["round"] == 1 and best["mean_val_loss"] == pytest.approx(losses[1])
    rounds = {r: load_checkpoint(tmp_path / "cxrfl" / "checkpoints" / f"round_{r:03d}.pt")["model"] for r in (1, 2, 3)}
    assert best["model"].keys() == rounds[1].keys()
    for k, v in rounds[1].items():
        assert torch.equal(best["model"][k], v), k
    for r in (2, 3):  # the rounds' weights tell apart
        assert not all(torch.equal(best["model"][k], rounds[r][k]) for k in rounds[r]), r


def test_fedbn_plus_global_model_keeps_the_pretrained_statistics(sites, tmp_path):
    torch.manual_seed(7)
    pre = build_model(MODEL, 1)
    for m in pre.modules():  # pretrained statistics, not torch's initial ones (FedBN+ needs a pretrained network)
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    save_checkpoint(tmp_path / "pre.pt", pre, classes=["x"], model_config=MODEL)
    pretrained = MODEL.replace(pretrained=str(tmp_path / "pre.pt"))
    config = SurgicalConfig(
        num_rounds=1,
        min_clients=len(sites),
        model_config=pretrained,
        train_config=TRAIN,
        min_clients_timeout=0,
        evaluate_test=False,
        seed=0,
        batchnorm="fedbn+",
    )
    state = global_model(run_surgical(sites, config, tmp_path / "run"), pretrained).state_dict()
    saved = pre.state_dict()
    keys = [k for k in batchnorm_keys(pre) if k in saved]
    assert keys
    for k in keys:
        np.testing.assert_array_equal(state[k].numpy(), saved[k].numpy(), err_msg=k)
