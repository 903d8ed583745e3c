"""The ``densenet-tiny`` arch (issue 44): torchvision's DenseNet with small settings, for tests and quick
experiments. Same module names and roles as DenseNet121, so BatchNorm selection, surgical stitching,
checkpoints, ``cxrfl predict`` and the MONAI bundle work on it unchanged."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import torchvision
from cxrfl.cli import main
from cxrfl.data.site import load_site
from cxrfl.errors import ConfigError
from cxrfl.nn.models import (
    HEAD_PREFIX,
    ModelConfig,
    batchnorm_keys,
    build_model,
    load_checkpoint,
    model_from_checkpoint,
    save_checkpoint,
)
from cxrfl.nn.training import TrainConfig
from cxrfl.predict import predict_images
from cxrfl.surgical.config import SurgicalConfig
from cxrfl.surgical.inprocess import run_surgical
from cxrfl.synth import write_profile
from PIL import Image
from torch import nn

TINY = ModelConfig(arch="densenet-tiny", image_size=32)
CLASSES = ["Atelectasis", "Edema", "Pneumonia"]

pytestmark = pytest.mark.usefixtures("one_thread")


def roles(model: nn.Module) -> set[tuple[str, str]]:
    """(module name with its block and layer numbers blanked, module type) of every module."""
    return {(re.sub(r"\d+", "N", name), type(m).__name__) for name, m in model.named_modules()}


def test_tiny_is_a_small_densenet_with_densenet121s_module_names_and_roles():
    tiny, full = build_model(TINY, 3), build_model(ModelConfig(image_size=32), 3)
    n_tiny = sum(p.numel() for p in tiny.parameters())
    assert n_tiny < sum(p.numel() for p in full.parameters()) / 100  # about 17 k against 7 M
    assert roles(tiny) == roles(full)  # conv0, norm0, denseblockN.denselayerN.*, transitionN, norm5, classifier
    names = [name for name, _ in tiny.backbone.named_children()]
    assert names == [name for name, _ in full.backbone.named_children()]
    assert names[:4] == ["conv0", "norm0", "relu0", "pool0"] and names[-1] == "norm5"
    assert isinstance(tiny.classifier, nn.Linear) and tiny.classifier.weight.shape == (3, 32)
    assert tiny.num_features == tiny.backbone.norm5.num_features == 32
    # FedBN finds the BatchNorm entries by module type, with the same roles as in DenseNet121
    bn = batchnorm_keys(tiny)
    bn_modules = {name for name, m in tiny.named_modules() if isinstance(m, nn.BatchNorm2d)}
    assert set(bn) == {k for k in tiny.state_dict() if k.rpartition(".")[0] in bn_modules} and len(bn) > 5
    assert {re.sub(r"\d+", "N", k) for k in bn} == {re.sub(r"\d+", "N", k) for k in batchnorm_keys(full)}
    assert {"backbone.norm0.running_mean", "backbone.norm5.running_var"} <= set(bn)


def test_tiny_forward_and_backward():
    torch.manual_seed(0)
    model = build_model(ModelConfig(arch="densenet-tiny", image_size=32, in_channels=1, hidden=8, dropout=0.2), 2)
    x = torch.randn(4, 1, 32, 32)
    model.eval()
    assert model.features(x).shape == (4, 32)
    model.train()
    logits = model(x)
    assert logits.shape == (4, 2)
    nn.functional.binary_cross_entropy_with_logits(logits, torch.ones_like(logits)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    assert model.backbone.norm0.num_batches_tracked == 1  # BatchNorm statistics moved


def test_tiny_checkpoint_round_trip_and_inferred_arch(tmp_path):
    torch.manual_seed(0)
    model = build_model(TINY, 3)
    path = tmp_path / "tiny.pt"
    save_checkpoint(path, model, classes=CLASSES, model_config=TINY, extra={"round": 2})
    assert path.stat().st_size < 500_000  # DenseNet121's is 28 MB
    loaded, classes, config = model_from_checkpoint(path)
    assert classes == CLASSES and config == TINY and config.arch == "densenet-tiny"
    x = torch.randn(2, 3, 32, 32)
    model.eval()
    loaded.eval()
    assert torch.equal(model(x), loaded(x))
    persisted = tmp_path / "FL_global_model.pt"  # NVFlare's layout: no model_config, the arch read from the weights
    torch.save({"model": model.state_dict(), "classes": CLASSES}, persisted)
    assert model_from_checkpoint(persisted)[2].arch == "densenet-tiny"


def test_pretrained_weights_must_be_of_the_models_arch(tmp_path):
    donor = build_model(TINY, 2)
    path = tmp_path / "tiny.pt"
    save_checkpoint(path, donor, classes=["a", "b"], model_config=TINY)
    model = build_model(ModelConfig(arch="densenet-tiny", image_size=32, pretrained=str(path)), 3)
    assert torch.equal(model.backbone.norm5.weight, donor.backbone.norm5.weight)
    imagenet_like = tmp_path / "densenet121.pth"
    torch.save(torchvision.models.densenet121(weights=None).state_dict(), imagenet_like)
    with pytest.raises(ConfigError, match=r"densenet121.pth holds a densenet121 feature extractor but model.arch is "):
        build_model(ModelConfig(arch="densenet-tiny", pretrained=str(imagenet_like)), 2)
    with pytest.raises(ConfigError, match=r"tiny.pt holds a densenet-tiny feature extractor but model.arch is "):
        build_model(ModelConfig(pretrained=str(path)), 2)


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_sites")
    paths = write_profile("two-hospitals", root, n_per_site=40, image_size=32, sites=["hospital-a", "hospital-b"])
    return [load_site(p, check_images=False) for p in paths]


def test_a_surgical_run_on_tiny_stitches_each_sites_rows_and_saves_a_tiny_model(sites, tmp_path):
    train = TrainConfig(lr=1e-3, warmup_lr=5e-3, warmup_epochs=1, batch_size=8, max_steps_per_epoch=1, augment=False)
    config = SurgicalConfig.from_dict(
        {"num_rounds": 2, "min_clients": 2, "model_config": TINY, "train_config": train, "evaluate_test": False}
    )
    out = tmp_path / "run"
    res = run_surgical(sites, config, out)
    ckpt = load_checkpoint(out / "FL_global_model.pt")
    assert ckpt["model_config"]["arch"] == "densenet-tiny" and ckpt["round"] == 2
    assert ckpt["model"][HEAD_PREFIX + "weight"].shape == (len(ckpt["classes"]), 32)
    assert set(ckpt["classes"]) == {c for s in sites for c in s.classes}
    assert res.outcome is not None and (out / "best_FL_global_model.pt").stat().st_size < 500_000
    model, classes, _ = model_from_checkpoint(out / "best_FL_global_model.pt")
    assert model.config.arch == "densenet-tiny" and classes == ckpt["classes"]


def test_predict_and_the_monai_bundle_on_a_tiny_checkpoint(tmp_path, capsys):
    from monai.bundle import ConfigParser

    torch.manual_seed(0)
    path = tmp_path / "best_FL_global_model.pt"
    save_checkpoint(path, build_model(TINY, len(CLASSES)), classes=CLASSES, model_config=TINY)
    image = tmp_path / "x.png"
    Image.fromarray((np.random.default_rng(0).random((40, 36)) * 255).astype(np.uint8)).save(image)
    assert main(["predict", "--model", str(path), str(image), "--json", "--precision", "fp32"]) == 0
    expected = json.loads(capsys.readouterr().out)[0]["probabilities"]
    assert list(expected) == CLASSES
    bundle = tmp_path / "bundle"
    assert main(["export", "bundle", "--model", str(path), "--out", str(bundle)]) == 0
    assert "densenet-tiny" in json.loads((bundle / "configs" / "metadata.json").read_text())["description"]
    parser = ConfigParser()
    parser.read_config(bundle / "configs" / "inference.json")
    parser["bundle_root"], parser["device"] = str(bundle), "$torch.device('cpu')"
    network = parser.get_parsed_content("network_def")
    assert network.config.arch == "densenet-tiny"
    network.load_state_dict(torch.load(bundle / "models" / "model.pt", weights_only=True))
    network.eval()
    x = parser.get_parsed_content("preprocessing")({"image": str(image)})["image"]
    with torch.no_grad():
        probs = parser.get_parsed_content("postprocessing")(network(x.unsqueeze(0)))[0]
    assert [float(p) for p in probs] == pytest.approx([expected[c] for c in CLASSES], abs=1e-4)
    assert predict_images(path, [image], precision="fp32")[0]["probabilities"] == pytest.approx(expected, abs=1e-6)
