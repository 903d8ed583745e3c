"""Numeric precision and memory format of training and inference, chosen per device.

Settings (in every method's training config: :class:`cxrfl.nn.training.TrainConfig`,
:class:`cxrfl.cwt.config.CWTConfig`, :class:`cxrfl.fedfew.config.FedFewConfig`): ``precision`` =
``auto | fp32 | bf16 | fp16`` and ``channels_last`` = ``auto | true | false``. :func:`resolve`
turns them into a :class:`Compute` for the device a site actually has:

- ``auto`` on CUDA: bfloat16 autocast where the GPU supports it, else float16 autocast with a
  gradient scaler; channels-last.
- ``auto`` on a CPU with native bfloat16 (AVX-512 BF16 or AMX: Intel Sapphire Rapids and later,
  AMD Zen 4/5): bfloat16 autocast and channels-last (1.9x float32 NCHW measured on Zen 5; see
  BENCHMARKS.md); on other CPUs float32, channels-last (issue 44: 1.16x float32 NCHW with PyTorch and
  oneDNN limited to AVX2, 1.29x with AVX-512; ``benchmarks/cpu_isa_training.py``).
- ``fp16`` asked for on a CPU falls back to float32 (with a warning): CPU float16 autocast is
  slower than float32 there. ``bf16`` on a CPU without native support is honoured (emulated, slow).

Autocast computes in the low precision; the weights, the optimiser state, BatchNorm statistics and
everything that leaves a site stay float32 (:func:`cxrfl.common.io.to_numpy` also makes
channels-last tensors C-contiguous arrays). The old ``amp`` key (true/false) is read for one
release through :data:`LEGACY_AMP`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cxrfl.common.config import LegacyKey

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
CHANNELS_LAST = ("auto", True, False)
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_WARNED: set[str] = set()

LEGACY_AMP = {
    "amp": LegacyKey(
        bool,
        lambda on: {"precision": "auto" if on else "fp32"},
        "write precision: auto (was amp: true) or fp32 (was amp: false)",
    )
}
"""The ``amp`` key of configs exported before ``precision`` (``LEGACY`` of the training configs)."""


def precision_field() -> Any:
    """The ``precision`` field of a training config (default ``auto``)."""
    return dataclasses.field(default="auto", metadata={"choices": PRECISIONS})


def channels_last_field() -> Any:
    """The ``channels_last`` field of a training config (default ``auto``)."""
    return dataclasses.field(default="auto", metadata={"choices": CHANNELS_LAST})


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX-512 BF16 or AMX tiles) and PyTorch's kernels use it.

    False where PyTorch dispatches below AVX-512 (``torch.backends.cpu.get_cpu_capability()``), also when
    ``ATEN_CPU_CAPABILITY`` limits it, as ``benchmarks/cpu_isa_training.py`` does to emulate an AVX2-only CPU.
    """
    capability = torch.backends.cpu.get_cpu_capability()
    if "AVX512" not in capability and "AMX" not in capability:
        return False
    cpu = getattr(torch, "cpu", None)
    checks = [getattr(cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if any(callable(c) for c in checks):
        return any(bool(c()) for c in checks if callable(c))
    try:  # older torch: the kernel's view of the CPU
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning(message)


@dataclass(frozen=True)
class Compute:
    """How a loop runs on its device.

    Args:
        device: the torch device.
        precision: ``fp32``, ``bf16`` or ``fp16`` (resolved, never ``auto``).
        channels_last: images and convolution weights in channels-last memory format.
    """

    device: torch.device
    precision: str = "fp32"
    channels_last: bool = False

    @property
    def dtype(self) -> torch.dtype | None:
        """The autocast dtype (None: plain float32)."""
        return _DTYPES.get(self.precision)

    @property
    def needs_scaler(self) -> bool:
        """float16 gradients need loss scaling (bfloat16 has float32's range)."""
        return self.precision == "fp16"

    def describe(self) -> str:
        """One phrase for logs, e.g. ``bf16 autocast, channels-last on cpu``."""
        math = "fp32" if self.dtype is None else f"{self.precision} autocast"
        return f"{math}, {'channels-last' if self.channels_last else 'NCHW'} on {self.device}"

    def autocast(self) -> contextlib.AbstractContextManager:
        """The autocast context of a forward pass (a no-op for float32)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def scaler(self) -> torch.amp.GradScaler | None:
        """A gradient scaler for float16 training, else None."""
        return torch.amp.GradScaler(self.device.type) if self.needs_scaler else None

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move a model to the device and memory format (in place, parameters keep their
        identity so optimisers stay valid; returns it).

        Args:
            model: the network.
        """
        model.to(self.device)
        if self.channels_last:
            model.to(memory_format=torch.channels_last)
        return model

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """A batch of images on the device in the memory format.

        Args:
            x: images [B, C, H, W].
        """
        x = x.to(self.device, non_blocking=True)
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last and x.dim() == 4 else x


def backward_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
    """Backpropagate ``loss`` and step ``optimizer`` (through ``scaler`` for float16).

    Args:
        loss: the float32 loss.
        optimizer: the optimiser (float32 master weights).
        scaler: :meth:`Compute.scaler` (None: no loss scaling).
    """
    if scaler is None:
        loss.backward()
        optimizer.step()
        return
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def resolve(precision: str = "auto", channels_last: str | bool = "auto", device: torch.device | str = "cpu") -> Compute:
    """The :class:`Compute` for the settings on ``device``.

    Args:
        precision: one of :data:`PRECISIONS`.
        channels_last: one of :data:`CHANNELS_LAST`.
        device: where the loop runs.

    Raises:
        ValueError: an unknown setting.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    if not (channels_last == "auto" or isinstance(channels_last, bool)):
        raise ValueError(f"channels_last must be 'auto', true or false, got {channels_last!r}")
    device = torch.device(device)
    cuda = device.type == "cuda"
    fast_cpu = not cuda and cpu_has_native_bf16()
    if precision == "auto":
        if cuda:
            precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        else:
            precision = "bf16" if fast_cpu else "fp32"
    elif precision == "fp16" and not cuda:
        _warn_once(f"precision fp16 needs a CUDA device; this {device.type} site trains in fp32")
        precision = "fp32"
    elif precision == "bf16" and not cuda and not fast_cpu:
        _warn_once("precision bf16 on a CPU without native bfloat16 is emulated and slow; consider fp32")
    if channels_last == "auto":  # emulated bfloat16 (asked for on a CPU without it) was not measured: NCHW
        channels_last = cuda or fast_cpu or precision == "fp32"
    return Compute(device=device, precision=precision, channels_last=bool(channels_last))


def compute_for(config: Any, device: torch.device | str) -> Compute:
    """:func:`resolve` of a training config's ``precision`` and ``channels_last``.

    Args:
        config: a settings object with ``precision`` and ``channels_last``.
        device: where the loop runs.
    """
    return resolve(config.precision, config.channels_last, device)


def as_compute(where: Compute | torch.device | str) -> Compute:
    """A :class:`Compute` as given, or the default (``auto``) one of a device.

    Args:
        where: a Compute, or a device.
    """
    return where if isinstance(where, Compute) else resolve("auto", "auto", where)
