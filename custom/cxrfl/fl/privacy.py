"""NVFlare's privacy filters applied to what a site sends back, in the form they are made for.

Sites return FULL weights (the server stitches head rows per class), but NVFlare's
``PercentilePrivacy`` and ``SVTPrivacy`` work on weight *differences*: given full weights they
would zero or clip the weights themselves (``gamma`` = 0.01 clips every weight to +-0.01).
:class:`UpdatePrivacy` therefore wraps them: it is listed twice in a job's client config,

- as a task **data** filter on ``train``: it only remembers the parameters the site received
  (keyed by task id, in this process);
- as a task **result** filter on ``train``: it turns the site's result into ``result - received``,
  runs NVFlare's filter on that WEIGHT_DIFF, and sends ``received + filtered difference``.

Parameters the server did not send (the head rows a site creates in the head warm-up) have no
previous value: they are filtered as differences from zero, so nothing leaves unfiltered (choose
``gamma`` accordingly for the percentile method). Integer buffers (BatchNorm's
``num_batches_tracked``) are passed through. The job's JSON names the method and its arguments;
``cxrfl deploy job ... --privacy percentile`` writes it (see README, "Deploy across hospitals").
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.filter import Filter, FilterChainType, FilterContextKey
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable

METHODS = ("percentile", "svt")

_lock = threading.Lock()
_received: dict[str, dict[str, np.ndarray]] = {}
_MAX_REMEMBERED = 8


def make_inner_filter(method: str, args: dict[str, Any]):
    """NVFlare's own filter object for ``method`` (``percentile`` or ``svt``) with ``args``."""
    if method == "percentile":
        from nvflare.app_common.filters.percentile_privacy import PercentilePrivacy

        return PercentilePrivacy(**args)
    if method == "svt":
        from nvflare.app_common.filters.svt_privacy import SVTPrivacy

        return SVTPrivacy(**args)
    raise ValueError(f"privacy method must be one of {METHODS}, got {method!r}")


class UpdatePrivacy(Filter):
    """Apply NVFlare's percentile or SVT privacy filter to a site's weight update.

    Args:
        method: ``percentile`` (:class:`nvflare.app_common.filters.percentile_privacy.PercentilePrivacy`)
            or ``svt`` (:class:`nvflare.app_common.filters.svt_privacy.SVTPrivacy`).
        args: that filter's arguments (e.g. ``{"percentile": 10, "gamma": 0.01}``).
    """

    def __init__(self, method: str = "percentile", args: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.method = method
        self.args = dict(args or {})
        self.inner = make_inner_filter(method, self.args)

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        if self.get_prop(FilterContextKey.CHAIN_TYPE) == FilterChainType.TASK_DATA_CHAIN:
            self._remember(shareable, fl_ctx)
            return shareable
        return self._filter_result(shareable, fl_ctx)

    # ------------------------------------------------------------ data chain
    def _remember(self, shareable: Shareable, fl_ctx: FLContext) -> None:
        task_id = str(fl_ctx.get_prop(FLContextKey.TASK_ID, ""))
        try:
            dxo = from_shareable(shareable)
        except Exception:  # not a DXO: nothing to remember
            return
        if dxo.data_kind not in (DataKind.WEIGHTS, DataKind.WEIGHT_DIFF) or not isinstance(dxo.data, dict):
            return
        copy = {k: np.array(v, copy=True) for k, v in dxo.data.items()}
        with _lock:
            _received[task_id] = copy
            while len(_received) > _MAX_REMEMBERED:
                _received.pop(next(iter(_received)))

    # ---------------------------------------------------------- result chain
    def _filter_result(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        if shareable.get_return_code(ReturnCode.OK) != ReturnCode.OK:
            return shareable
        task_id = str(fl_ctx.get_prop(FLContextKey.TASK_ID, ""))
        with _lock:
            received = _received.pop(task_id, {})
        dxo = from_shareable(shareable)
        if dxo.data_kind != DataKind.WEIGHTS or not dxo.data:
            return shareable
        filtered, meta = privatize_update(self.inner, dxo.data, received, meta=dxo.meta, shareable=shareable, fl_ctx=fl_ctx)
        dxo.data = filtered
        dxo.meta.update(meta)
        self.log_info(
            fl_ctx,
            f"{self.method} privacy applied to {sum(1 for v in filtered.values() if _is_float(v))} parameter arrays "
            f"({sum(1 for k in filtered if k not in received)} without a received value, filtered from zero)",
        )
        return dxo.update_shareable(shareable)


def _is_float(v: Any) -> bool:
    return np.issubdtype(np.asarray(v).dtype, np.floating)


def privatize_update(
    inner: Any,
    result: dict[str, Any],
    received: dict[str, Any],
    *,
    meta: dict | None = None,
    shareable: Shareable | None = None,
    fl_ctx: FLContext | None = None,
) -> tuple[dict[str, np.ndarray], dict]:
    """``received + inner(result - received)`` for every floating-point array of ``result``.

    Args:
        inner: an NVFlare DXO filter working on WEIGHT_DIFF (percentile, SVT).
        result: the site's full parameters.
        received: the parameters the site received for this task (missing: zero).
        meta: DXO meta passed to the inner filter.
        shareable: the result shareable (the SVT accountant reads its round header).
        fl_ctx: the context (logging).

    Returns:
        The filtered full parameters (integer arrays unchanged) and the meta the inner filter set
        (the SVT privacy accountant).
    """
    diffs: dict[str, np.ndarray] = {}
    out: dict[str, np.ndarray] = {}
    new_meta: dict = {}
    for k, v in result.items():
        v = np.asarray(v)
        if not _is_float(v):
            out[k] = v
            continue
        ref = received.get(k)
        ref = np.asarray(ref, dtype=v.dtype) if ref is not None and np.shape(ref) == v.shape else np.zeros_like(v)
        diffs[k] = (v - ref).astype(v.dtype, copy=False)
        out[k] = ref
    if diffs:
        diff_dxo = DXO(data_kind=DataKind.WEIGHT_DIFF, data=diffs, meta=dict(meta or {}))
        filtered = inner.process_dxo(diff_dxo, shareable if shareable is not None else Shareable(), fl_ctx or FLContext())
        new_diffs = (filtered.data if filtered is not None else diffs) or {}
        for k in diffs:
            d = np.asarray(new_diffs.get(k, np.zeros_like(diffs[k])))
            out[k] = (out[k] + d).astype(np.asarray(result[k]).dtype, copy=False)
        if filtered is not None:
            new_meta = {k: v for k, v in (filtered.meta or {}).items() if k not in (meta or {})}
    return out, new_meta
