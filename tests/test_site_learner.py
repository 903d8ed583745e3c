"""SiteLearner: warm-up, rounds, state on disk across rebuilds, FedBN locality (real NIH images)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cxrfl.common.io import to_numpy
from cxrfl.data.site import SiteData, load_site
from cxrfl.nn.models import HEAD_PREFIX, ModelConfig, batchnorm_keys, build_model
from cxrfl.nn.training import TrainConfig
from cxrfl.surgical.learner import SiteLearner
from cxrfl.surgical.site_state import OPTIMIZER_ROUNDS

MODEL = ModelConfig(arch="densenet-tiny", image_size=32)  # the network is not the subject here
TRAIN = TrainConfig(lr=1e-3, warmup_lr=5e-3, warmup_epochs=1, batch_size=8, max_steps_per_epoch=2, augment=False)


@pytest.fixture(scope="module")
def small_site(shared_data, repo_root) -> SiteData:
    full = load_site(repo_root / "site_configs" / "nih1000.yaml", check_images=False)
    parts = [full.table[full.table["split"] == s].head(n) for s, n in (("train", 24), ("val", 16), ("test", 16))]
    table = __import__("pandas").concat(parts).reset_index(drop=True)
    classes = ["Atelectasis", "Pleural Effusion", "Infiltration"]
    return SiteData(site="nih-small", classes=classes, table=table[["path", "patient", "split", *classes]])


def backbone() -> dict[str, np.ndarray]:
    torch.manual_seed(1)
    init = build_model(MODEL, 1)
    return {k: v for k, v in to_numpy(init.state_dict()).items() if not k.startswith(HEAD_PREFIX)}


def learner(site: SiteData, state_dir, batchnorm: str = "fedavg") -> SiteLearner:
    return SiteLearner(site, state_dir, model_config=MODEL, train_config=TRAIN, batchnorm=batchnorm)


def test_warmup_trains_only_the_head_and_returns_own_rows(small_site, tmp_path):
    init = backbone()
    site = learner(small_site, tmp_path)
    update = site.warmup(init)
    assert update.classes == small_site.classes
    assert update.params["classifier.weight"].shape == (3, site.model.num_features)
    assert update.num_samples == 24
    for k, v in init.items():  # frozen feature extractor, BatchNorm statistics included
        np.testing.assert_array_equal(update.params[k], v, err_msg=k)
    assert np.isfinite(update.metrics["val_loss"])


def optimizer_rounds(state_dir) -> dict[int, dict]:
    folder = state_dir / OPTIMIZER_ROUNDS
    return {int(p.stem.split("_")[1]): torch.load(p, weights_only=True) for p in folder.glob("round_*.pt")}


def test_optimizer_state_survives_a_rebuilt_learner(small_site, tmp_path):
    first = learner(small_site, tmp_path)
    u1 = first.train_round(first.warmup(backbone()).params, 1)
    assert set(optimizer_rounds(tmp_path)) == {1}
    rebuilt = learner(small_site, tmp_path)  # what the simulator does with -t 1
    rebuilt.train_round(u1.params, 3)  # round 2 skipped (the site was away): round 3 starts from round 1's state
    stored = optimizer_rounds(tmp_path)
    assert set(stored) == {1, 3}
    steps = {int(s["step"]) for s in stored[3]["state"].values()}
    assert steps == {2 * TRAIN.max_steps_per_epoch}
    moved = [k for k in u1.params if not np.array_equal(u1.params[k], rebuilt.outgoing_params()[k])]
    assert any(k.startswith("backbone") or "features" in k for k in moved)
    learner(small_site, tmp_path).train_round(u1.params, 4)
    assert set(optimizer_rounds(tmp_path)) == {3, 4}  # only the latest two are kept


def test_a_redone_round_trains_exactly_as_the_first_time(small_site, tmp_path):
    first = learner(small_site, tmp_path)
    u1 = first.train_round(first.warmup(backbone()).params, 1)
    u2 = first.train_round(u1.params, 2)
    redone = learner(small_site, tmp_path).train_round(u1.params, 2)  # interrupted before aggregation, resumed
    assert set(redone.params) == set(u2.params)
    for k, v in u2.params.items():
        np.testing.assert_array_equal(redone.params[k], v, err_msg=k)


def test_fedbn_keeps_batchnorm_local(small_site, tmp_path):
    site = learner(small_site, tmp_path, "fedbn")
    bn = set(batchnorm_keys(site.model))
    warm = site.warmup(backbone())
    assert not bn & set(warm.params)
    trained = site.train_round(warm.params, 1)
    assert not bn & set(trained.params)
    local = torch.load(tmp_path / "local_bn.pt", weights_only=True)
    assert set(local) == bn
    rebuilt = learner(small_site, tmp_path, "fedbn")
    rebuilt.load_params(trained.params)  # payload without BatchNorm: the site's own statistics come back
    state = rebuilt.model.state_dict()
    for k in bn:
        torch.testing.assert_close(state[k], local[k], msg=k)


def test_received_params_of_wrong_shape_are_refused(small_site, tmp_path):
    site = learner(small_site, tmp_path)
    params = site.outgoing_params()
    params["classifier.weight"] = np.zeros((5, site.model.num_features), np.float32)
    with pytest.raises(ValueError, match="classifier.weight"):
        site.load_params(params)


def test_a_kept_training_loader_gives_each_round_the_batches_of_a_fresh_one(small_site, tmp_path, monkeypatch):
    # augmenting on the device (CUDA sites) keeps one training loader, so its workers start once; a kept
    # loader must still give every round the order and augmentations of a loader made for that round
    import functools

    import cxrfl.surgical.learner as learner_module
    from cxrfl.data.dataset import DeviceLoader, make_loader

    monkeypatch.setattr(learner_module, "make_loader", functools.partial(make_loader, device_transforms=True))
    augmenting = TrainConfig(lr=1e-3, batch_size=8, augment=True)

    def site_learner(state_dir):
        return SiteLearner(small_site, state_dir, model_config=MODEL, train_config=augmenting)

    def batches(loader):
        return [(x.clone(), y.clone()) for x, y, _ in loader]

    kept = site_learner(tmp_path / "kept")
    first = kept.train_loader(1)
    assert isinstance(first, DeviceLoader)
    round_1 = batches(first)
    assert kept.train_loader(2) is first
    round_2 = batches(first)
    for round_num, seen in ((2, round_2), (1, round_1)):
        fresh = batches(site_learner(tmp_path / f"fresh{round_num}").train_loader(round_num))
        assert len(fresh) == len(seen)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(fresh, seen)), round_num
    assert not torch.equal(round_1[0][0], round_2[0][0])  # rounds differ
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches(kept.train_loader(1)), round_1))  # and repeat
