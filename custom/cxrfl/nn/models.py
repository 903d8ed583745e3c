"""The network (DenseNet feature extractor + linear head), BatchNorm handling and checkpoints.

The model is ``F`` (the ``features`` of torchvision's DenseNet121, the product's network, or of
its small test variant ``densenet-tiny``; then ReLU and global average pooling)
followed by an optional hidden layer (``Dense(hidden, relu)``, the authors' variant) and dropout,
and the head ``G = classifier`` (``nn.Linear``). Row ``i`` of ``classifier.weight`` plus
``classifier.bias[i]`` is the classifier of class ``i``: the unit that surgical aggregation
stitches per class.

Weights are never downloaded: the network trains from scratch unless ``ModelConfig.pretrained``
names a local file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from cxrfl.common.config import Config
from cxrfl.common.io import torch_load, torch_save
from cxrfl.errors import ConfigError

_DENSENETS: dict[str, dict[str, Any]] = {
    "densenet121": {"growth_rate": 32, "block_config": (6, 12, 24, 16), "num_init_features": 64},
    "densenet-tiny": {"growth_rate": 8, "block_config": (2, 2, 2, 2), "num_init_features": 16, "bn_size": 2},
}
"""``torchvision.models.DenseNet`` settings of each arch (``densenet121`` is torchvision's own)."""

ARCHS: tuple[str, ...] = tuple(_DENSENETS)
"""Supported feature extractors."""

HEAD_PREFIX = "classifier."
"""State-dict prefix of the classification head (``classifier.weight`` [K, N], ``classifier.bias`` [K])."""

HIDDEN_PREFIX = "hidden."
"""State-dict prefix of the optional hidden layer (trained with the head during warm-up)."""

CHECKPOINT_FORMAT = "cxrfl-checkpoint-v1"
"""Value of the ``format`` entry of a cxrfl checkpoint."""

_RESERVED_CHECKPOINT_KEYS = ("model", "classes", "model_config", "format")
_OLD_DENSENET_KEY = re.compile(
    r"^(.*denselayer\d+\.(?:norm|relu|conv))\.((?:[12])\.(?:weight|bias|running_mean|running_var))$"
)
_FROZEN_REASONS = "_cxrfl_bn_frozen_reasons"


@dataclass(frozen=True)
class ModelConfig(Config):
    """Architecture settings, stored in every checkpoint.

    Args:
        arch: feature extractor, a torchvision ``DenseNet`` built without weights: ``densenet121``
            (the default and the product's network, 7 M parameters, 1024 features) or
            ``densenet-tiny`` (the same module names and roles, about 17 k parameters, 32 features;
            for tests and quick experiments, not for clinical use; no ImageNet weights exist for it).
        in_channels: image channels (3, or 1 for grey-scale input: ``conv0`` is rebuilt).
        image_size: square input side in pixels (the data pipeline resizes to it; >= 32).
        hidden: 0 for a linear head on the pooled features; > 0 adds ``Dense(hidden, relu)``.
        dropout: dropout probability before the classifier (0 <= p < 1).
        pretrained: path of a local checkpoint for the feature extractor: a torchvision
            DenseNet state_dict of the same arch (old ``norm.1`` key names accepted) or a cxrfl checkpoint.
    """

    SECTION: ClassVar[str] = "model"
    arch: str = field(default="densenet121", metadata={"choices": ARCHS})
    in_channels: int = field(default=3, metadata={"ge": 1})
    image_size: int = field(default=224, metadata={"ge": 32})
    hidden: int = field(default=0, metadata={"ge": 0})
    dropout: float = field(default=0.0, metadata={"ge": 0.0, "lt": 1.0})
    pretrained: str | None = None

    def __post_init__(self) -> None:
        for name in ("in_channels", "image_size", "hidden"):  # numpy integers from arrays are fine
            value = getattr(self, name)
            if isinstance(value, np.integer):
                object.__setattr__(self, name, int(value))
        if isinstance(self.pretrained, os.PathLike):
            object.__setattr__(self, "pretrained", str(self.pretrained))
        if self.pretrained == "":
            self.fail("pretrained", "must be a file path or null, got ''")
        super().__post_init__()
        object.__setattr__(self, "dropout", float(self.dropout))


class CXRNet(nn.Module):
    """DenseNet features (``config.arch``) -> ReLU -> global average pool -> [hidden] -> dropout -> classifier.

    Args:
        config: architecture settings (``pretrained`` is not loaded here; see :func:`build_model`).
        num_classes: number of outputs K (rows of ``classifier.weight``), >= 1.
    """

    def __init__(self, config: ModelConfig, num_classes: int) -> None:
        super().__init__()
        if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
            raise ConfigError(f"num_classes must be an integer >= 1, got {num_classes!r}")
        self.config = config
        self.num_classes = int(num_classes)
        self.backbone: nn.Sequential = torchvision.models.DenseNet(**_DENSENETS[config.arch]).features
        if config.in_channels != 3:
            old = self.backbone.conv0
            self.backbone.conv0 = nn.Conv2d(
                config.in_channels, old.out_channels, old.kernel_size, old.stride, old.padding, bias=False
            )
            nn.init.kaiming_normal_(self.backbone.conv0.weight)
        pooled = self.backbone.norm5.num_features
        self.hidden: nn.Module = (
            nn.Sequential(nn.Linear(pooled, config.hidden), nn.ReLU(inplace=True)) if config.hidden else nn.Identity()
        )
        self.dropout: nn.Module = nn.Dropout(config.dropout) if config.dropout else nn.Identity()
        self.num_features = config.hidden or pooled
        self.classifier = nn.Linear(self.num_features, self.num_classes)
        nn.init.zeros_(self.classifier.bias)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Pooled feature vectors of F, shape [B, D] (D = ``backbone.norm5.num_features``, 1024 for densenet121).

        Args:
            x: images [B, in_channels, H, W].
        """
        return torch.flatten(F.adaptive_avg_pool2d(F.relu(self.backbone(x)), 1), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [B, K].

        Args:
            x: images [B, in_channels, H, W].
        """
        return self.classifier(self.dropout(self.hidden(self.features(x))))


def build_model(config: ModelConfig, num_classes: int) -> CXRNet:
    """Create the network and load ``config.pretrained`` into its feature extractor.

    Args:
        config: architecture settings.
        num_classes: number of outputs K.

    Raises:
        ConfigError: bad settings, or a pretrained file that is missing or does not fit.
    """
    model = CXRNet(config, num_classes)
    if config.pretrained:
        _load_pretrained_backbone(model, Path(config.pretrained))
    return model


def _load_pretrained_backbone(model: CXRNet, path: Path) -> None:
    obj = torch_load(
        path,
        "pretrained checkpoint (model.pretrained)",
        "give a DenseNet state_dict or a cxrfl checkpoint saved with torch.save",
    )
    if isinstance(obj, Mapping) and isinstance(obj.get("model"), Mapping):
        obj = obj["model"]  # cxrfl checkpoint or NVFlare persistor layout
    elif isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping):
        raise ConfigError(f"{path}: expected a state_dict (a mapping of tensors), got {type(obj).__name__}")
    state: dict[str, torch.Tensor] = {}
    for key, value in obj.items():
        key = str(key).removeprefix("module.")
        match = _OLD_DENSENET_KEY.match(key)
        if match:
            key = match.group(1) + match.group(2)
        for prefix in ("features.", "backbone."):
            if key.startswith(prefix):
                state[key.removeprefix(prefix)] = value
    arch = model.config.arch
    found = _arch_of(state, "")
    if found not in (None, arch):
        raise ConfigError(
            f"{path} holds a {found} feature extractor but model.arch is {arch!r}: give weights of that arch"
        )
    own = model.backbone.state_dict()
    for k in own:  # checkpoints older than torch 0.4.1 (e.g. the ImageNet file) lack these counters
        if k.endswith("num_batches_tracked"):
            state.setdefault(k, own[k])
    missing = [k for k in own if k not in state]
    if missing:
        raise ConfigError(
            f"{path} does not hold a {arch} feature extractor: {len(missing)} of {len(own)} "
            f"weights missing (e.g. features.{missing[0]}); expected a torchvision {arch} "
            "state_dict or a cxrfl checkpoint"
        )
    conv = state["conv0.weight"]
    if conv.shape[1] == 3 and model.config.in_channels == 1:
        state["conv0.weight"] = conv.sum(dim=1, keepdim=True)  # grey-scale input: sum the RGB filters
    bad = [k for k in own if tuple(state[k].shape) != tuple(own[k].shape)]
    if bad:
        k = bad[0]
        raise ConfigError(
            f"{path}: weight features.{k} has shape {tuple(state[k].shape)}, the model needs "
            f"{tuple(own[k].shape)} (model.in_channels={model.config.in_channels})"
        )
    model.backbone.load_state_dict({k: state[k] for k in own})


def batchnorm_keys(model: nn.Module) -> list[str]:
    """State-dict names of every BatchNorm module's parameters and buffers.

    Selected by module type (``torch.nn`` BatchNorm1d/2d/3d, SyncBatchNorm, lazy variants), never
    by name: torchvision calls DenseNet's layers ``norm0``, ``norm1``, ``norm2``, ``norm5``.

    Args:
        model: any module.

    Returns:
        ``weight``, ``bias``, ``running_mean``, ``running_var`` and ``num_batches_tracked`` entries,
        in state-dict order.
    """
    bn_modules = {name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    return [k for k in model.state_dict() if k.rpartition(".")[0] in bn_modules]


def _keep_frozen_bn_in_eval(module: nn.Module, args: tuple[Any, ...]) -> None:
    if module.__dict__.get(_FROZEN_REASONS):
        module.training = False


def _set_bn_frozen(module: nn.Module, reason: str, frozen: bool) -> None:
    if _FROZEN_REASONS not in module.__dict__:
        module.__dict__[_FROZEN_REASONS] = set()
        module.register_forward_pre_hook(_keep_frozen_bn_in_eval)
    reasons: set[str] = module.__dict__[_FROZEN_REASONS]
    if frozen:
        reasons.add(reason)
        module.training = False
    else:
        reasons.discard(reason)
    for p in module.parameters(recurse=False):
        p.requires_grad_(not reasons)


def set_batchnorm_frozen(model: nn.Module) -> None:
    """FedBN+: every BatchNorm runs in inference mode and its affine parameters are not trained.

    Survives ``model.train()``: each BatchNorm module gets a forward pre-hook that puts it back
    in eval mode before every forward, so running statistics (and ``num_batches_tracked``) stay
    at the values they had when this was called (e.g. the pretrained statistics). The flag
    lives on the module instances, so it also survives ``load_state_dict``, ``to()`` and deepcopy.

    Args:
        model: any module; all BatchNorm modules (by type) inside it are frozen.
    """
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            _set_bn_frozen(m, "fedbn+", True)


def freeze_backbone(model: nn.Module, frozen: bool = True) -> None:
    """Head warm-up: freeze (or unfreeze) everything but ``classifier.*`` and ``hidden.*``.

    Frozen means no gradients and BatchNorm in inference mode (running statistics fixed, as
    Keras does for a non-trainable base model), so F is a fixed function while the head trains.
    Unfreezing leaves BatchNorm frozen by :func:`set_batchnorm_frozen` frozen; call
    ``model.train()`` afterwards to put unfrozen BatchNorm back in training mode.

    Args:
        model: a :class:`CXRNet` (or any module whose head is named ``classifier``/``hidden``).
        frozen: True to freeze, False to undo.
    """
    head = (HEAD_PREFIX, HIDDEN_PREFIX)
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not f"{name}.".startswith(head):
            _set_bn_frozen(m, "backbone", frozen)
    bn_params = {
        id(p) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) for p in m.parameters()
    }
    for name, p in model.named_parameters():
        if not name.startswith(head) and id(p) not in bn_params:
            p.requires_grad_(not frozen)


def select_device(requested: str = "auto") -> torch.device:
    """The torch device to run on.

    Args:
        requested: ``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``.

    Raises:
        ConfigError: unknown name, or CUDA asked for but not available / no such GPU index.
    """
    name = str(requested).strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    match = re.fullmatch(r"cuda(?::(\d+))?", name)
    if not match:
        raise ConfigError(f"unknown device {requested!r}; use 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device {requested!r} requested but CUDA is not available on this machine "
            "(no GPU or a CPU-only torch); use device: auto or cpu"
        )
    index = int(match.group(1) or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError(f"device {requested!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return torch.device("cuda", index)


def _cpu_state_dict(model_or_state_dict: nn.Module | Mapping[str, Any]) -> dict[str, torch.Tensor]:
    state = model_or_state_dict.state_dict() if isinstance(model_or_state_dict, nn.Module) else model_or_state_dict
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if isinstance(v, np.ndarray):
            out[k] = torch.from_numpy(np.array(v))
        elif isinstance(v, torch.Tensor):
            out[k] = v.detach().cpu().clone()  # clone: a view would save its whole storage
        else:
            raise TypeError(f"state_dict entry {k!r} is a {type(v).__name__}, not a tensor or array")
    return out


def _check_classes(classes: Any, state: Mapping[str, Any], where: str) -> list[str]:
    if isinstance(classes, (str, bytes)) or not all(isinstance(c, str) and c for c in classes):
        raise ConfigError(f"{where}: classes must be a list of non-empty strings, got {classes!r}")
    classes = list(classes)
    if len(set(classes)) != len(classes):
        dup = sorted({c for c in classes if classes.count(c) > 1})
        raise ConfigError(f"{where}: duplicate class names {dup}")
    head = state.get(HEAD_PREFIX + "weight")
    if head is not None and head.shape[0] != len(classes):
        raise ConfigError(f"{where}: the head has {head.shape[0]} rows but {len(classes)} classes are named")
    return classes


def save_checkpoint(
    path: str | os.PathLike[str],
    model_or_state_dict: nn.Module | Mapping[str, Any],
    *,
    classes: list[str],
    model_config: ModelConfig,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write a cxrfl checkpoint atomically (temporary file in the same folder, then ``os.replace``).

    Layout: ``{'model': state_dict (CPU tensors), 'classes': [...], 'model_config': {...},
    'format': 'cxrfl-checkpoint-v1', **extra}``. A crash mid-write leaves any previous file intact.

    Args:
        path: destination file (parent folders are created).
        model_or_state_dict: a module or a state_dict (tensors or numpy arrays).
        classes: class names in head row order.
        model_config: the architecture.
        extra: further entries (e.g. round, metrics); they may not reuse the reserved keys.
    """
    path = Path(path)
    state = _cpu_state_dict(model_or_state_dict)
    classes = _check_classes(classes, state, str(path))
    if not isinstance(model_config, ModelConfig):
        raise TypeError(f"model_config must be a ModelConfig, got {type(model_config).__name__}")
    extra = dict(extra or {})
    clash = sorted(set(extra) & set(_RESERVED_CHECKPOINT_KEYS))
    if clash:
        raise ValueError(f"extra may not contain the reserved checkpoint keys {clash}")
    payload = {
        "model": state,
        "classes": classes,
        "model_config": model_config.to_dict(),
        "format": CHECKPOINT_FORMAT,
        **extra,
    }
    torch_save(path, payload)


def _arch_of(state: Mapping[str, torch.Tensor], prefix: str) -> str | None:
    """The arch whose ``conv0`` has as many filters as ``state[prefix + 'conv0.weight']`` (None: unknown)."""
    conv = state.get(prefix + "conv0.weight")
    widths = {s["num_init_features"]: arch for arch, s in _DENSENETS.items()}
    return widths.get(int(conv.shape[0])) if conv is not None and conv.ndim == 4 else None


def _infer_model_config(state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    conv = state.get("backbone.conv0.weight")
    hidden = state.get(HIDDEN_PREFIX + "0.weight")
    return ModelConfig(
        arch=_arch_of(state, "backbone.") or ModelConfig.arch,
        in_channels=int(conv.shape[1]) if conv is not None else 3,
        hidden=int(hidden.shape[0]) if hidden is not None else 0,
    ).to_dict()


def _check_finite(state: Mapping[str, torch.Tensor], path: Path) -> None:
    """Refuse a model whose weights hold NaN or infinite values (a diverged run): it predicts nothing usable."""
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise ConfigError(
            f"{path}: weights are not finite (NaN or infinite) in {len(bad)} tensor(s), e.g. {bad[0]}; a diverged or "
            "damaged model is not used: take an earlier checkpoint (best_FL_global_model.pt) or train again"
        )


def load_checkpoint(path: str | os.PathLike[str], map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read and validate a cxrfl checkpoint.

    Also accepts NVFlare's persisted ``FL_global_model.pt`` layout ``{'model': state_dict, ...}``
    when it carries ``classes`` (top level or in ``meta_props``); a missing ``model_config`` is
    then inferred from the state_dict (arch, input channels, hidden size).

    Args:
        path: the file.
        map_location: where tensors are loaded (``torch.load``'s argument).

    Returns:
        The checkpoint dict with ``model``, ``classes``, ``model_config`` and ``format`` filled in.

    Raises:
        ConfigError: missing file, unreadable file, not a cxrfl checkpoint, or weights that are
            not finite (the message names the file).
    """
    path = Path(path)
    obj = torch_load(
        path, "checkpoint", "give a cxrfl checkpoint (FL_global_model.pt, best_FL_global_model.pt)", map_location
    )
    if not isinstance(obj, dict) or not isinstance(obj.get("model"), Mapping):
        keys = sorted(map(str, obj))[:8] if isinstance(obj, Mapping) else type(obj).__name__
        raise ConfigError(f"{path} is not a cxrfl checkpoint: no 'model' state_dict (found {keys})")
    fmt = obj.get("format")
    if fmt is not None and fmt != CHECKPOINT_FORMAT:
        raise ConfigError(f"{path}: unsupported checkpoint format {fmt!r} (this version reads {CHECKPOINT_FORMAT!r})")
    meta = obj.get("meta_props") if isinstance(obj.get("meta_props"), Mapping) else {}
    classes = obj.get("classes", meta.get("classes"))
    if classes is None:
        raise ConfigError(
            f"{path} is not a cxrfl checkpoint: it names no classes (keys: {sorted(map(str, obj))}); "
            "a model without its class list cannot be used"
        )
    state = obj["model"]
    if not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"{path}: the 'model' state_dict holds values that are not tensors")
    _check_finite(state, path)
    ckpt = dict(obj)
    ckpt["classes"] = _check_classes(classes, state, str(path))
    ckpt["model_config"] = dict(obj.get("model_config", meta.get("model_config")) or _infer_model_config(state))
    ckpt["format"] = CHECKPOINT_FORMAT
    return ckpt


def model_from_checkpoint(
    path: str | os.PathLike[str], map_location: str | torch.device = "cpu"
) -> tuple[CXRNet, list[str], ModelConfig]:
    """Rebuild the network from a checkpoint (its ``pretrained`` path is not loaded again).

    Args:
        path: a file written by :func:`save_checkpoint` (or NVFlare's persisted global model).
        map_location: where tensors are loaded.

    Returns:
        (model on ``map_location``, class names in output order, the stored ModelConfig).
    """
    ckpt = load_checkpoint(path, map_location)
    try:
        config = ModelConfig.from_dict(ckpt["model_config"])
    except ConfigError as exc:
        raise ConfigError(f"{path}: bad model_config: {exc}") from exc
    model = CXRNet(config, len(ckpt["classes"])).to(map_location)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as exc:
        raise ConfigError(f"{path}: the weights do not fit the stored model config: {exc}") from exc
    return model, ckpt["classes"], config
