"""Numeric precision and memory format of training and inference, chosen per device.

Settings (in every method's training config): ``precision`` = ``auto | fp32 | bf16 | fp16`` and
``channels_last`` = ``auto | true | false``. :func:`resolve` turns them into a :class:`Compute`
for the device a site actually has:

- ``auto`` on CUDA: bfloat16 autocast where the GPU supports it, else float16 autocast with a
  gradient scaler; channels-last.
- ``auto`` on a CPU with native bfloat16 (AVX-512 BF16 or AMX: Intel Sapphire Rapids and later,
  AMD Zen 4/5): bfloat16 autocast and channels-last (1.9x float32 NCHW measured on Zen 5; see
  BENCHMARKS.md); on other CPUs float32, NCHW.
- ``fp16`` asked for on a CPU falls back to float32 (with a warning): CPU float16 autocast is
  slower than float32 there. ``bf16`` on a CPU without native support is honoured (emulated, slow).

Autocast computes in the low precision; the weights, the optimiser state, BatchNorm statistics and
everything that leaves a site stay float32.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
CHANNELS_LAST = ("auto", True, False)
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX-512 BF16 or AMX tiles)."""
    cpu = getattr(torch, "cpu", None)
    checks = [getattr(cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if any(callable(c) for c in checks):
        return any(bool(c()) for c in checks if callable(c))
    try:  # older torch: the kernel's view of the CPU
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


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

    def autocast(self) -> contextlib.AbstractContextManager:
        """The autocast context of a forward pass (a no-op for float32)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def scaler(self) -> torch.amp.GradScaler | None:
        """A gradient scaler for float16 training, else None."""
        return torch.amp.GradScaler(self.device.type) if self.needs_scaler else None

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move a model to the device and memory format (in place; returns it).

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
    if channels_last not in ("auto", True, False) or isinstance(channels_last, int) and not isinstance(channels_last, bool):
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
        log.warning("precision fp16 needs a CUDA device; this %s site trains in fp32", device.type)
        precision = "fp32"
    elif precision == "bf16" and not cuda and not fast_cpu:
        log.warning("precision bf16 on a CPU without native bfloat16 is emulated and slow; consider fp32")
    if channels_last == "auto":
        channels_last = cuda or fast_cpu
    return Compute(device=device, precision=precision, channels_last=bool(channels_last))
