"""DenseNet121 model, BatchNorm selection/freezing, head warm-up, devices and checkpoints (64x64, batch 2)."""

from __future__ import annotations

import re
from pathlib import Path

import cxrfl.nn.models as models
import pytest
import torch
import torchvision
from cxrfl.errors import ConfigError, StorageError
from cxrfl.nn.losses import masked_bce
from cxrfl.nn.models import (
    CXRNet,
    ModelConfig,
    batchnorm_keys,
    build_model,
    freeze_backbone,
    load_checkpoint,
    model_from_checkpoint,
    save_checkpoint,
    select_device,
    set_batchnorm_frozen,
)
from torch import nn

CFG = ModelConfig(image_size=64)
BN_SUFFIXES = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


@pytest.fixture(scope="module")
def tv_state(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A randomly initialised torchvision densenet121 state_dict saved as a 'pretrained' file."""
    torch.manual_seed(1)
    state = torchvision.models.densenet121(weights=None).state_dict()
    for k, v in state.items():  # make the BN statistics distinctive
        if k.endswith("running_mean"):
            v.normal_()
    path = tmp_path_factory.mktemp("pre") / "densenet121.pth"
    torch.save(state, path)
    return path, state


def batch(model: nn.Module, n_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(2, model.config.in_channels, 64, 64)
    y = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])[:, :n_classes]
    return x, y


def train_step(model: CXRNet) -> None:
    x, y = batch(model, model.num_classes)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model.train()
    loss = masked_bce(model(x), y, torch.ones_like(y))
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_model_config_validation_and_round_trip():
    cfg = ModelConfig(hidden=256, dropout=0.3, in_channels=1, image_size=128, pretrained=Path("/x/w.pt"))
    assert cfg.pretrained == "/x/w.pt"
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    for bad, match in [
        ({"arch": "resnet50"}, "arch"),
        ({"hidden": -1}, "hidden"),
        ({"dropout": 1.0}, "dropout"),
        ({"image_size": 16}, "image_size"),
        ({"in_channels": 0}, "in_channels"),
    ]:
        with pytest.raises(ConfigError, match=match):
            ModelConfig(**bad)
    with pytest.raises(ConfigError, match=r"unknown model setting\(s\) \['hiden'\]"):
        ModelConfig.from_dict({"hiden": 3})


def test_shapes_and_head_keys():
    model = build_model(CFG, 3)
    x, _ = batch(model, 3)
    model.eval()
    assert model.features(x).shape == (2, 1024)
    assert model(x).shape == (2, 3)
    head = {k: tuple(v.shape) for k, v in model.state_dict().items() if k.startswith(models.HEAD_PREFIX)}
    assert head == {"classifier.weight": (3, 1024), "classifier.bias": (3,)}
    hidden = build_model(ModelConfig(image_size=64, hidden=16, dropout=0.3), 2)
    sd = hidden.state_dict()
    assert sd["hidden.0.weight"].shape == (16, 1024) and sd["classifier.weight"].shape == (2, 16)
    hidden.eval()
    assert hidden(x).shape == (2, 2)


def test_batchnorm_keys_on_torchvision_densenet121():
    net = torchvision.models.densenet121(weights=None)
    keys = batchnorm_keys(net)
    bn_modules = [name for name, m in net.named_modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(bn_modules) == 121 and len(keys) == 5 * len(bn_modules) == 605
    expected = {f"{name}.{s}" for name in bn_modules for s in BN_SUFFIXES}
    assert set(keys) == expected
    for k in keys:
        module, _, suffix = k.rpartition(".")
        assert re.search(r"\.norm[0125]?$", module), k  # norm0, norm1, norm2 (layers), norm (transitions), norm5
        assert suffix in BN_SUFFIXES
    others = [k for k in net.state_dict() if k not in expected]
    assert all(
        k.endswith(("conv0.weight", "conv1.weight", "conv2.weight", "conv.weight")) or k.startswith("classifier.")
        for k in others
    )
    assert not any("bn" in k for k in keys)  # a "bn" substring rule would find nothing here
    cx = build_model(CFG, 2)
    cx_keys = batchnorm_keys(cx)
    assert len(cx_keys) == 605 and all(k.startswith("backbone.") for k in cx_keys)


def test_batchnorm_keys_select_by_module_type_not_by_name():
    # issue 44 point 3: in DenseNet every BatchNorm is named norm*, so a name rule passed the test above;
    # here the BatchNorm names hold no "norm"/"bn" and the norm*-named modules are not BatchNorm
    net = nn.Sequential()
    net.add_module("stem", nn.Conv2d(1, 4, 3))
    net.add_module("stats", nn.BatchNorm2d(4))
    net.add_module("norm_proj", nn.Conv2d(4, 4, 1))
    net.add_module("norm", nn.GroupNorm(2, 4))
    net.add_module("norm5", nn.LayerNorm(4))
    net.add_module("tail", nn.Sequential(nn.Flatten(), nn.Linear(4, 4), nn.BatchNorm1d(4)))
    expected = [f"{m}.{s}" for m in ("stats", "tail.2") for s in BN_SUFFIXES]
    assert batchnorm_keys(net) == expected  # exactly the BatchNorm entries, in state-dict order


def test_fedbn_plus_keeps_bn_statistics_through_training():
    model = build_model(CFG, 3)
    set_batchnorm_frozen(model)
    model.train()  # must not undo the freeze
    bn = set(batchnorm_keys(model))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train_step(model)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in bn)
    changed = [k for k in before if k not in bn and not torch.equal(before[k], after[k])]
    assert "backbone.conv0.weight" in changed and "classifier.weight" in changed
    bn_modules = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert all(not m.training for m in bn_modules)
    assert all(not p.requires_grad for m in bn_modules for p in m.parameters())


def test_freeze_backbone_leaves_only_head_gradients():
    model = build_model(ModelConfig(image_size=64, hidden=8), 3)
    freeze_backbone(model)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train_step(model)
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad == {"hidden.0.weight", "hidden.0.bias", "classifier.weight", "classifier.bias"}
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in after if k.startswith("backbone."))  # BN stats too
    freeze_backbone(model, frozen=False)
    assert all(p.requires_grad for p in model.parameters())

    fedbn_plus = build_model(CFG, 2)
    set_batchnorm_frozen(fedbn_plus)
    freeze_backbone(fedbn_plus)
    freeze_backbone(fedbn_plus, frozen=False)  # un-freezing the backbone keeps FedBN+ BatchNorm frozen
    bn_params = {
        f"{n}.{s}" for n, m in fedbn_plus.named_modules() if isinstance(m, nn.BatchNorm2d) for s in ("weight", "bias")
    }
    assert {n for n, p in fedbn_plus.named_parameters() if not p.requires_grad} == bn_params
    fedbn_plus.train()
    fedbn_plus(batch(fedbn_plus, 2)[0])
    assert not any(m.training for m in fedbn_plus.modules() if isinstance(m, nn.BatchNorm2d))


def test_select_device(monkeypatch):
    assert select_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert select_device("auto") == torch.device("cpu")
    for name in ("cuda", "cuda:1"):
        with pytest.raises(ConfigError, match="CUDA is not available"):
            select_device(name)
    with pytest.raises(ConfigError, match="unknown device 'tpu'"):
        select_device("tpu")


def test_checkpoint_round_trip(tmp_path):
    cfg = ModelConfig(image_size=64, hidden=8, dropout=0.2)
    model = build_model(cfg, 3)
    path = tmp_path / "sub" / "global.pt"
    save_checkpoint(path, model, classes=["Edema", "Mass", "Hernia"], model_config=cfg, extra={"round": 4})
    ckpt = load_checkpoint(path)
    assert ckpt["format"] == "cxrfl-checkpoint-v1" and ckpt["round"] == 4
    assert ckpt["classes"] == ["Edema", "Mass", "Hernia"] and ckpt["model_config"] == cfg.to_dict()
    assert all(v.device.type == "cpu" for v in ckpt["model"].values())
    loaded, classes, loaded_cfg = model_from_checkpoint(path)
    assert classes == ["Edema", "Mass", "Hernia"] and loaded_cfg == cfg
    x, _ = batch(model, 3)
    model.eval()
    loaded.eval()
    assert torch.equal(model(x), loaded(x))
    assert list(tmp_path.joinpath("sub").iterdir()) == [path]  # no temporary file left behind
    with pytest.raises(ConfigError, match="2 classes are named"):
        save_checkpoint(tmp_path / "bad.pt", model, classes=["a", "b"], model_config=cfg)
    with pytest.raises(ValueError, match="reserved"):
        save_checkpoint(tmp_path / "bad.pt", model, classes=["a", "b", "c"], model_config=cfg, extra={"classes": 1})


def test_save_is_atomic(tmp_path, monkeypatch):
    model = build_model(CFG, 2)
    path = tmp_path / "model.pt"
    save_checkpoint(path, model, classes=["a", "b"], model_config=CFG)
    good = path.read_bytes()

    def crash(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(models.torch, "save", crash)
    with pytest.raises(StorageError, match=r"cannot write .*model.pt: disk full; check"):  # one line (issue 40 point 9)
        save_checkpoint(path, model, classes=["a", "b"], model_config=CFG)
    assert path.read_bytes() == good  # the previous checkpoint is intact
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def test_load_checkpoint_errors_name_the_file(tmp_path):
    text = tmp_path / "notes.pt"
    text.write_text("not a checkpoint")
    with pytest.raises(ConfigError, match=re.escape(str(text))):
        load_checkpoint(text)
    plain = tmp_path / "plain.pt"
    torch.save({"model": {"w": torch.zeros(1)}}, plain)  # no classes
    with pytest.raises(ConfigError, match=re.escape(str(plain)) + " is not a cxrfl checkpoint: it names no classes"):
        load_checkpoint(plain)
    torch.save([1, 2], plain)
    with pytest.raises(ConfigError, match="no 'model' state_dict"):
        load_checkpoint(plain)
    torch.save({"model": {}, "classes": ["a"], "model_config": {"hiden": 1}}, plain)
    with pytest.raises(ConfigError, match=re.escape(str(plain)) + r": bad model_config: .*'hiden'"):
        model_from_checkpoint(plain)
    with pytest.raises(ConfigError, match="checkpoint not found: .*missing.pt"):
        load_checkpoint(tmp_path / "missing.pt")


def test_nvflare_layout_with_classes_is_accepted(tmp_path):
    model = build_model(ModelConfig(image_size=64, hidden=8), 2)
    path = tmp_path / "FL_global_model.pt"
    torch.save({"model": model.state_dict(), "train_conf": {"train": {}}, "classes": ["a", "b"]}, path)
    loaded, classes, cfg = model_from_checkpoint(path)
    assert classes == ["a", "b"] and cfg.hidden == 8 and cfg.in_channels == 3  # inferred from the weights
    assert torch.equal(loaded.classifier.weight, model.classifier.weight)


def test_pretrained_torchvision_state_dict(tv_state, tmp_path):
    path, state = tv_state
    model = build_model(ModelConfig(image_size=64, pretrained=str(path)), 2)
    own = model.state_dict()
    for k, v in state.items():
        if k.startswith("features."):
            assert torch.equal(own["backbone." + k.removeprefix("features.")], v), k

    old_names = {  # the layout of torchvision's original ImageNet file: 'norm.1', no num_batches_tracked
        re.sub(r"(denselayer\d+\.(?:norm|conv))([12])\.", r"\1.\2.", k): v
        for k, v in state.items()
        if not k.endswith("num_batches_tracked")
    }
    assert "features.denseblock1.denselayer1.norm.1.weight" in old_names
    old_path = tmp_path / "old.pth"
    torch.save(old_names, old_path)
    old = build_model(ModelConfig(image_size=64, pretrained=str(old_path)), 2)
    assert torch.equal(
        old.backbone.denseblock1.denselayer1.norm1.running_mean,
        state["features.denseblock1.denselayer1.norm1.running_mean"],
    )

    grey = build_model(ModelConfig(image_size=64, in_channels=1, pretrained=str(path)), 2)
    assert torch.allclose(grey.backbone.conv0.weight, state["features.conv0.weight"].sum(1, keepdim=True))

    with pytest.raises(ConfigError, match="pretrained checkpoint .* not found: .*nowhere.pth"):
        build_model(ModelConfig(pretrained=str(tmp_path / "nowhere.pth")), 2)
    wrong = tmp_path / "resnet.pth"
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), wrong)
    with pytest.raises(ConfigError, match="does not hold a densenet121 feature extractor"):
        build_model(ModelConfig(pretrained=str(wrong)), 2)


def test_pretrained_from_cxrfl_checkpoint(tmp_path):
    donor = build_model(CFG, 5)
    path = tmp_path / "donor.pt"
    save_checkpoint(path, donor, classes=list("abcde"), model_config=CFG)
    model = build_model(ModelConfig(image_size=64, pretrained=str(path)), 2)
    assert torch.equal(model.backbone.conv0.weight, donor.backbone.conv0.weight)
    assert model.classifier.weight.shape == (2, 1024)  # the head is not taken from the donor
