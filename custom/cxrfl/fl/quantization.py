"""Smaller messages: NVFlare's quantization filters on what the server sends and what the sites return.

A job with ``quantize`` set (:data:`cxrfl.fl.job_settings.QUANTIZE_TYPES`) carries four filters on every task:
the server quantizes its task data (:class:`ExactQuantizer`) and dequantizes the sites' results
(:class:`ExactDequantizer`); each site dequantizes what it receives and quantizes what it returns.
They are NVFlare 2.9's ``ModelQuantizer`` / ``ModelDequantizer`` (``nvflare.app_opt.pt.quantization``,
which needs ``bitsandbytes``: ``pip install 'cxrfl[quantization]'``) with two changes:

- **Kept exact** (sent as they are, listed in no quantization state): BatchNorm running statistics
  (``*.running_mean``, ``*.running_var``, ``*.num_batches_tracked``: the server refuses an update whose
  running variance has a negative entry, and a quantized nonnegative array can come back slightly
  negative; they are also a few hundred KB of a DenseNet121); every array that is not float32, float16 or
  bfloat16 (integers, bool, float64: NVFlare's quantizer refuses them, and an integer counter must stay
  exact); 0-d and empty arrays; any array whose quantized form with its state is not smaller than it
  (an 8-bit array below about 350 values: its code table alone is 1 KB). Everything else (weights,
  BatchNorm's own weight and bias, the surgical head rows) is quantized. Message metadata (class lists,
  counts) is DXO meta and never touched; every array comes back in its own dtype and shape, so the
  server's exact dtype check against the previous global model still holds.
- **On the CPU**: NVFlare's filters move each array to CUDA for the 8- and 4-bit formats (``.cuda()``),
  which fails on a server or site without a GPU. Here those formats call the same bitsandbytes
  functions (``quantize_blockwise``, ``quantize_4bit`` and their inverses) on the CPU tensors and keep
  NVFlare's message layout (``quant_state``, ``source_datatype``); ``float16`` is NVFlare's own code.

:func:`round_trip` runs the two filters without a transport (benchmarks and tests).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch
from bitsandbytes.functional import QuantState, dequantize_4bit, dequantize_blockwise, quantize_4bit, quantize_blockwise
from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_opt.pt.quantization.constant import DATA_TYPE
from nvflare.app_opt.pt.quantization.dequantizer import ModelDequantizer
from nvflare.app_opt.pt.quantization.quantizer import ModelQuantizer

from cxrfl.fl.job_settings import QUANTIZE_TYPES

EXACT_SUFFIXES = (".running_mean", ".running_var", ".num_batches_tracked")
"""State-dict suffixes of BatchNorm's running statistics: never quantized."""

_FOUR_BIT = {"float4": "fp4", "normfloat4": "nf4"}
_SOURCE_TYPES = frozenset(t.lower() for t in DATA_TYPE)


def _dtype(v: Any) -> str:
    return v.dtype.name if isinstance(v, np.ndarray) else str(v.dtype).removeprefix("torch.")


def quantizable(key: str, value: Any) -> bool:
    """Whether one parameter may be quantized (see the module docstring for what is kept exact).

    Args:
        key: its state-dict name.
        value: its value.
    """
    if key.endswith(EXACT_SUFFIXES) or not isinstance(value, (np.ndarray, torch.Tensor)):
        return False
    return _dtype(value) in _SOURCE_TYPES and value.ndim > 0 and math.prod(value.shape) > 0


def _nbytes(value: Any) -> int:
    return int(value.nbytes) if isinstance(value, (np.ndarray, torch.Tensor)) else 0


def _like(source: Any, tensor: Any) -> Any:
    """``tensor`` as numpy when ``source`` is numpy (the message keeps its arrays' kind)."""
    return tensor.numpy() if isinstance(source, np.ndarray) and isinstance(tensor, torch.Tensor) else tensor


def _bnb_quantize(value: np.ndarray | torch.Tensor, quantization_type: str) -> tuple[Any, dict[str, Any]]:
    """One array quantized by bitsandbytes on the CPU, in NVFlare's layout (values, quant_state entry)."""
    tensor = torch.as_tensor(np.require(value, requirements=["C", "W"]) if isinstance(value, np.ndarray) else value)
    if quantization_type == "blockwise8":
        quantized, state = quantize_blockwise(tensor.cpu())
        entry: dict[str, Any] = {"absmax": state.absmax, "code": state.code}
    else:
        quantized, state = quantize_4bit(tensor.cpu(), quant_type=_FOUR_BIT[quantization_type])
        entry = state.as_dict()
    return _like(value, quantized), {k: _like(value, v) for k, v in entry.items()}


def _bnb_dequantize(value: Any, entry: dict[str, Any], quantization_type: str, source: str) -> Any:
    """The inverse of :func:`_bnb_quantize`, in the array's source dtype (the sender names the dtypes: only
    the float types it may quantize are looked up, never an arbitrary ``torch`` attribute)."""
    named = [source, *([entry.get("dtype")] if quantization_type in _FOUR_BIT else [])]
    if not all(isinstance(d, str) and d in _SOURCE_TYPES for d in named):
        raise ValueError(f"quantized array of dtype {named!r}; expected one of {sorted(_SOURCE_TYPES)}")
    tensor = torch.as_tensor(value)
    state: dict[str, Any] = {k: torch.as_tensor(v) if isinstance(v, np.ndarray) else v for k, v in entry.items()}
    if quantization_type == "blockwise8":
        out = dequantize_blockwise(tensor, absmax=state["absmax"], code=state["code"])
    else:
        quant_state = QuantState(
            quant_type=state["quant_type"],
            absmax=state["absmax"],
            blocksize=state["blocksize"],
            code=state["quant_map"],
            dtype=getattr(torch, state["dtype"]),
            shape=torch.Size(state["shape"]),
        )
        out = dequantize_4bit(tensor, quant_state, quant_type=_FOUR_BIT[quantization_type])
    shape = state["shape"] if quantization_type in _FOUR_BIT else tensor.shape  # bnb's CPU kernel returns 1-D as 2-D
    return _like(value, out.reshape(tuple(shape)).to(getattr(torch, source)))


class ExactQuantizer(ModelQuantizer):
    """NVFlare's ``ModelQuantizer`` keeping exact what must stay exact, its 8- and 4-bit formats on the CPU.

    Args:
        quantization_type: ``float16``, ``blockwise8``, ``float4`` or ``normfloat4``.
    """

    def __init__(self, quantization_type: str = "float16") -> None:
        if quantization_type not in QUANTIZE_TYPES:
            raise ValueError(
                f"ExactQuantizer: quantization_type must be one of {list(QUANTIZE_TYPES)}, got {quantization_type!r}"
            )
        super().__init__(quantization_type=quantization_type)

    def quantization(self, params: dict, fl_ctx: FLContext) -> tuple[dict, dict, dict]:
        """Quantize the quantizable arrays; the others, and those that would not shrink, travel as they are.

        Args:
            params: the message's arrays (not changed).
            fl_ctx: the context (NVFlare's logging).

        Returns:
            The arrays to send, and NVFlare's ``quant_state`` and ``source_datatype`` of the quantized ones.
        """
        todo = {k: v for k, v in params.items() if quantizable(k, v)}
        if self.quantization_type == "float16":
            quantized, state, source = super().quantization(dict(todo), fl_ctx)
        else:
            quantized, state, source = {}, {}, {}
            for k, v in todo.items():
                quantized[k], state[k] = _bnb_quantize(v, self.quantization_type)
                source[k] = _dtype(v)
        for k, v in todo.items():
            if _nbytes(quantized[k]) + sum(_nbytes(s) for s in state[k].values()) >= _nbytes(v):
                del quantized[k], state[k], source[k]
        return {k: quantized.get(k, v) for k, v in params.items()}, state, source


class ExactDequantizer(ModelDequantizer):
    """NVFlare's ``ModelDequantizer`` for :class:`ExactQuantizer`'s messages: only the arrays listed in
    ``source_datatype`` are dequantized, every other one passes as it came."""

    def dequantization(
        self, params: dict, quant_state: dict, quantization_type: str, source_datatype: dict, fl_ctx: FLContext
    ) -> dict:
        """The arrays back in their source dtypes.

        Args:
            params: the received arrays.
            quant_state: NVFlare's per-array quantization state.
            quantization_type: the format.
            source_datatype: each quantized array's dtype before quantization.
            fl_ctx: the context (NVFlare's logging).
        """
        todo = {k: params[k] for k in source_datatype}
        if quantization_type == "float16":
            restored = super().dequantization(todo, quant_state, quantization_type, source_datatype, fl_ctx)
        else:
            restored = {
                k: _bnb_dequantize(v, quant_state[k], quantization_type, source_datatype[k]) for k, v in todo.items()
            }
        return {k: restored.get(k, v) for k, v in params.items()}


class RoundTrip(NamedTuple):
    """One message through :func:`round_trip`."""

    params: dict[str, Any]
    """The arrays as the receiver gets them (dequantized)."""
    bytes_before: int
    """Bytes of the message's arrays unquantized."""
    bytes_after: int
    """Bytes of the arrays the quantizer puts in the DXO: values and their quantization state."""


def dxo_bytes(dxo: DXO) -> int:
    """Bytes of a DXO's arrays: its data and the arrays of its ``quant_state`` meta.

    Args:
        dxo: the message.
    """
    state = dxo.get_meta_prop("quant_state") or {}
    return sum(_nbytes(v) for v in dxo.data.values()) + sum(
        _nbytes(s) for entry in state.values() for s in entry.values()
    )


def round_trip(params: Mapping[str, Any], quantize: str) -> RoundTrip:
    """Quantize then dequantize a parameter dict as a job's filters do, without a transport.

    Args:
        params: name -> numpy array or torch tensor (not changed).
        quantize: the format (``float16``, ``blockwise8``, ``float4``, ``normfloat4``).
    """
    fl_ctx = FLContext()
    sent = ExactQuantizer(quantize).process_dxo(DXO(DataKind.WEIGHTS, data=dict(params)), Shareable(), fl_ctx)
    size = dxo_bytes(sent)
    back = ExactDequantizer().process_dxo(sent, Shareable(), fl_ctx)
    return RoundTrip(dict(back.data), sum(_nbytes(v) for v in params.values()), size)
