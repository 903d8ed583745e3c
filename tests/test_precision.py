"""Training precision and memory format per device (cxrfl.nn.precision): what ``auto`` becomes on
each kind of device (capability checks mocked), float32 master weights and C-contiguous outgoing
arrays after bf16/channels-last steps, loss scaling for fp16, bad values, the legacy ``amp`` key."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import ClassVar

import cxrfl.common.config as config_module
import numpy as np
import pytest
import torch
from cxrfl.common.config import Config, LegacyKey
from cxrfl.common.io import to_numpy
from cxrfl.common.transport import copy_params
from cxrfl.cwt.config import CWTConfig
from cxrfl.errors import ConfigError
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.nn import precision
from cxrfl.nn.precision import Compute, resolve
from cxrfl.nn.training import TrainConfig, adam, evaluate, train_epochs
from torch import nn

CONFIGS = (TrainConfig, CWTConfig, FedFewConfig)


@pytest.fixture
def cpu_bf16(monkeypatch):
    """Set whether the (mocked) CPU has native bfloat16."""

    def set_to(value: bool) -> None:
        monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: value)

    return set_to


@pytest.fixture
def cuda_bf16(monkeypatch):
    """Set whether the (mocked) GPU supports bfloat16."""

    def set_to(value: bool) -> None:
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: value)

    return set_to


# ------------------------------------------------------------------ resolution
@pytest.mark.parametrize("gpu_bf16, want", [(True, "bf16"), (False, "fp16")])
def test_auto_on_cuda_is_low_precision_autocast_and_channels_last(cuda_bf16, gpu_bf16, want):
    cuda_bf16(gpu_bf16)
    c = resolve("auto", "auto", "cuda")
    assert (c.device.type, c.precision, c.channels_last) == ("cuda", want, True)
    assert c.needs_scaler is (want == "fp16")  # bfloat16 has float32's range: no loss scaling
    assert c.dtype is {"bf16": torch.bfloat16, "fp16": torch.float16}[want]


@pytest.mark.parametrize("native, want", [(True, ("bf16", True)), (False, ("fp32", True))])
def test_auto_on_cpu_depends_on_native_bfloat16(cpu_bf16, native, want):
    cpu_bf16(native)
    c = resolve("auto", "auto", "cpu")
    assert (c.precision, c.channels_last) == want
    assert not c.needs_scaler and c.scaler() is None
    assert (c.dtype is None) is (want[0] == "fp32")


def test_explicit_settings_win_and_fp16_on_cpu_falls_back_to_fp32(cpu_bf16, caplog):
    cpu_bf16(True)
    assert resolve("fp32", "auto", "cpu") == Compute(torch.device("cpu"), "fp32", True)
    assert resolve("bf16", False, "cpu") == Compute(torch.device("cpu"), "bf16", False)
    precision._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="cxrfl.nn.precision"):
        assert resolve("fp16", True, "cpu").precision == "fp32"
    assert "fp16 needs a CUDA device" in caplog.text
    cpu_bf16(False)
    assert resolve("bf16", "auto", "cpu") == Compute(torch.device("cpu"), "bf16", False)  # honoured, emulated


def test_cpu_capability_checks(monkeypatch):
    cpu = torch.cpu
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    assert precision.cpu_has_native_bf16()
    # issue 44: PyTorch's kernels limited to AVX2 (an AVX2-only CPU, or ATEN_CPU_CAPABILITY=avx2 emulating one)
    # cannot use the CPU's bfloat16 instructions, whatever the CPU has
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not precision.cpu_has_native_bf16()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert precision.cpu_has_native_bf16()  # AMX alone is enough (Sapphire Rapids)
    monkeypatch.setattr(cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert not precision.cpu_has_native_bf16()
    monkeypatch.delattr(cpu, "_is_avx512_bf16_supported")
    monkeypatch.delattr(cpu, "_is_amx_tile_supported")

    class FakePath:  # an older torch: the kernel's cpuinfo flags decide
        text = "flags: fpu avx2 avx512f avx512_bf16"

        def __init__(self, *_):
            pass

        def read_text(self):
            return FakePath.text

    monkeypatch.setattr(precision, "Path", FakePath)
    assert precision.cpu_has_native_bf16()
    FakePath.text = "flags: fpu avx2 avx512f"
    assert not precision.cpu_has_native_bf16()


@pytest.mark.parametrize("cls", CONFIGS)
def test_every_training_config_has_the_settings_with_auto_defaults(cls):
    cfg = cls()
    assert (cfg.precision, cfg.channels_last) == ("auto", "auto")
    assert "amp" not in cfg.to_dict()
    assert cls.from_dict({"precision": "bf16", "channels_last": False}).to_dict()["channels_last"] is False


@pytest.mark.parametrize("cls", CONFIGS)
@pytest.mark.parametrize(
    "key, value, allowed",
    [
        ("precision", "half", "['auto', 'fp32', 'bf16', 'fp16']"),
        ("channels_last", "yes", "['auto', True, False]"),
        ("channels_last", 1, "a text or true or false"),
    ],
)
def test_invalid_values_are_one_clear_line(cls, key, value, allowed):
    with pytest.raises(ConfigError) as err:
        cls.from_dict({key: value}, where="job.json")
    msg = str(err.value)
    assert msg.startswith(f"{cls.SECTION}.{key} must be") and allowed in msg and repr(value) in msg
    assert msg.endswith("(in job.json)") and "\n" not in msg


def test_resolve_rejects_unknown_values():
    with pytest.raises(ValueError, match="precision must be one of"):
        resolve("half", "auto", "cpu")
    with pytest.raises(ValueError, match="channels_last must be 'auto', true or false"):
        resolve("auto", 1, "cpu")


# ------------------------------------------------------------------ the legacy amp key
@pytest.mark.parametrize("cls", CONFIGS)
def test_legacy_amp_key_is_read_with_one_deprecation_line(cls, caplog):
    config_module._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="cxrfl.common.config"):
        assert cls.from_dict({"amp": False}).precision == "fp32"
        assert cls.from_dict({"amp": True}).precision == "auto"
        assert cls.from_dict({"amp": False, "precision": "bf16"}).precision == "bf16"  # the new key wins
    lines = [r.getMessage() for r in caplog.records]
    assert (
        len(lines) == 1
        and lines[0].startswith(f"{cls.SECTION}.amp is deprecated")
        and "precision: auto (was amp: true) or fp32" in lines[0]
    )
    with pytest.raises(ConfigError, match=rf"^{cls.SECTION}\.amp must be true or false, got 'yes' \(in job\.json\)$"):
        cls.from_dict({"amp": "yes"}, where="job.json")


def test_legacy_key_hook_is_general():
    @dataclass(frozen=True)
    class Box(Config):
        SECTION: ClassVar[str] = "box"
        LEGACY = {"size_cm": LegacyKey(float, lambda cm: {"size_mm": cm * 10}, "write size_mm")}
        size_mm: float = field(default=1.0, metadata={"gt": 0})
        label: str = "x"

    assert Box.from_dict({"size_cm": 2, "label": "y"}) == Box(size_mm=20, label="y")
    with pytest.raises(ConfigError, match=r"box.size_mm must be > 0, got -10"):
        Box.from_dict({"size_cm": -1})
    with pytest.raises(ConfigError, match="unknown box setting"):
        Box.from_dict({"size_in": 1})


# ------------------------------------------------------------------ training steps
class TinyNet(nn.Module):
    """Conv + BatchNorm + linear head: the layer kinds of DenseNet that autocast and formats touch."""

    def __init__(self, k: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.classifier = nn.Linear(8, k)

    def forward(self, x):
        return self.classifier(torch.relu(self.norm(self.conv(x))).mean(dim=(2, 3)))


def batches(n: int = 3, k: int = 3):
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(4, 3, 16, 16, generator=g), (torch.rand(4, k, generator=g) > 0.5).float(), torch.ones(4, k))
        for _ in range(n)
    ]


def test_bf16_channels_last_step_keeps_float32_weights_and_sends_c_contiguous_arrays():
    torch.manual_seed(0)
    model = TinyNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = adam(model, 1e-2)
    compute = Compute(torch.device("cpu"), "bf16", True)
    seen = []
    model.conv.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    stats = train_epochs(model, batches(), opt, compute)
    assert stats.steps == 3 and np.isfinite(stats.loss)
    assert set(seen) == {torch.bfloat16}  # the convolution really ran in bfloat16
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last) and not model.conv.weight.is_contiguous()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(t.dtype == torch.float32 for s in opt.state.values() for t in s.values() if t.dim() > 0)
    assert not torch.equal(model.conv.weight, before["conv.weight"])
    for out in (to_numpy(model.state_dict()), copy_params(model.state_dict())):
        assert all(a.flags.c_contiguous for a in out.values())
        assert {a.dtype for k, a in out.items() if "num_batches" not in k} == {np.dtype(np.float32)}
        np.testing.assert_array_equal(out["conv.weight"], model.conv.weight.detach().numpy())  # same values, NCHW
    res = evaluate(model, batches(1), ["a", "b", "c"], compute)
    assert res.scores.dtype == np.float32 and res.scores.shape == (4, 3) and np.isfinite(res.loss)


def test_fp16_training_goes_through_the_gradient_scaler(monkeypatch):
    """fp16 (CUDA's fallback where bf16 is missing) scales the loss; on this CPU-only machine the
    CPU's GradScaler stands in for CUDA's."""
    calls = []

    class SpyScaler(torch.amp.GradScaler):
        def scale(self, outputs):
            calls.append("scale")
            return super().scale(outputs)

        def step(self, optimizer, *args, **kwargs):
            calls.append("step")
            return super().step(optimizer, *args, **kwargs)

        def update(self, new_scale=None):
            calls.append("update")
            return super().update(new_scale)

    compute = Compute(torch.device("cpu"), "fp16", False)
    assert compute.needs_scaler and isinstance(compute.scaler(), torch.amp.GradScaler)
    monkeypatch.setattr(Compute, "scaler", lambda self: SpyScaler("cpu", init_scale=2.0**8))
    torch.manual_seed(0)
    model = TinyNet()
    w0 = model.classifier.weight.detach().clone()
    train_epochs(model, batches(2), adam(model, 1e-2), compute)
    assert calls == ["scale", "step", "update"] * 2
    assert model.classifier.weight.dtype == torch.float32 and not torch.equal(model.classifier.weight, w0)


def test_a_cuda_fp16_site_builds_a_cuda_scaler(cuda_bf16):
    cuda_bf16(False)
    compute = resolve("auto", "auto", "cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # without a GPU torch disables the scaler, with a warning
        scaler = compute.scaler()
    assert isinstance(scaler, torch.amp.GradScaler) and scaler._device == "cuda"


def test_a_site_learner_trains_in_bf16_and_sends_float32_c_contiguous_params(tmp_path):
    from cxrfl.data.site import load_site
    from cxrfl.nn.models import HEAD_PREFIX, ModelConfig, build_model
    from cxrfl.surgical.learner import SiteLearner
    from cxrfl.synth import write_profile

    (path,) = write_profile("two-hospitals", tmp_path / "data", n_per_site=20, image_size=32, sites=["hospital-a"])
    data = load_site(path, check_images=False)
    model_config = ModelConfig(image_size=32)
    train = TrainConfig(
        lr=1e-3, batch_size=4, max_steps_per_epoch=1, augment=False, precision="bf16", channels_last=True
    )
    learner = SiteLearner(data, tmp_path / "state", model_config=model_config, train_config=train)
    assert learner.compute == Compute(torch.device("cpu"), "bf16", True)
    torch.manual_seed(0)
    init = to_numpy(build_model(model_config, len(data.classes)).state_dict())
    update = learner.train_round(init, 1)
    assert all(a.dtype == init[k].dtype and a.flags.c_contiguous for k, a in update.params.items())
    conv = "backbone.conv0.weight"
    assert learner.model.state_dict()[conv].is_contiguous(memory_format=torch.channels_last)
    assert not np.array_equal(update.params[conv], init[conv])
    assert update.params[HEAD_PREFIX + "weight"].shape[0] == len(data.classes)
