"""NVFlare's privacy filters applied to what a site sends back, in the form they are made for.

Sites return FULL weights (the server stitches head rows per class), but NVFlare's
``PercentilePrivacy`` and ``SVTPrivacy`` work on weight *differences*: given full weights they
would zero or clip the weights themselves (``gamma`` = 0.01 clips every weight to +-0.01).
:class:`UpdatePrivacy` therefore wraps them: it is listed twice in a job's client config,

- as a task **data** filter on the update tasks (``train``; FedFew's ``fedfew_ssl`` and
  ``fedfew_train``): it only remembers the parameters the site received (keyed by task id, in
  this process);
- as a task **result** filter on the same tasks: it turns the site's result into ``result - received``,
  runs NVFlare's filter on that WEIGHT_DIFF, and sends ``received + filtered difference``.

Parameters the server did not send (the head rows a site creates in the head warm-up) have no
previous value: they are filtered as differences from zero, so nothing leaves unfiltered (choose
``gamma`` accordingly for the percentile method). Integer buffers (BatchNorm's
``num_batches_tracked``) are passed through. The job's JSON names the method and its arguments;
``cxrfl deploy job ... --privacy percentile`` writes it (see README, "Deploy across hospitals").

The settings are checked when the filter is built at the site (:func:`cxrfl.common.privacy.check_privacy`:
settings that destroy every update are refused, lossy ones warned about). Every filtered result is
measured against the true update (:func:`cxrfl.common.privacy.fidelity`: cosine similarity, norm,
share of changes kept, per part) and logged in one line with the SVT privacy spent; a part whose
update the filter destroyed gets a warning line instead.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.filter import Filter, FilterChainType, FilterContextKey
from nvflare.apis.fl_constant import FLContextKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable

from cxrfl.common.privacy import METHODS, check_privacy, destroyed, fidelity
from cxrfl.nn.models import HEAD_PREFIX

SVT_BUDGET, SVT_ACCOUNTANT = "svt_privacy_budget", "svt_privacy_accountant"
"""DXO meta keys where NVFlare's SVTPrivacy puts the epsilon of one call and of the run so far."""

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
        self._args = dict(args or {})  # not ``self.args``: NVFlare's job exporter skips attributes named args
        check_privacy({"method": method, "args": self._args}, "UpdatePrivacy", warn=self.logger.warning)
        self.inner = make_inner_filter(method, self._args)

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
        filtered, meta = privatize_update(
            self.inner, dxo.data, received, meta=dxo.meta, shareable=shareable, fl_ctx=fl_ctx
        )
        report = fidelity(dxo.data, received, filtered, HEAD_PREFIX)
        line = (
            f"{self.method} privacy applied to {sum(1 for v in filtered.values() if _is_float(v))} parameter arrays "
            f"({sum(1 for k in filtered if k not in received)} without a received value, filtered from zero); "
            f"{describe(report, meta)}"
        )
        lost = destroyed(report)
        if lost:
            self.log_warning(
                fl_ctx,
                f"{line}. The filter DESTROYS this update's {', '.join(lost)}: change its "
                "settings (README, 'Privacy filters')",
            )
        else:
            self.log_info(fl_ctx, line)
        dxo.data = filtered
        dxo.meta.update(meta)
        return dxo.update_shareable(shareable)


def _is_float(v: Any) -> bool:
    return np.issubdtype(np.asarray(v).dtype, np.floating)


def svt_epsilon(meta: dict) -> tuple[float | None, float | None]:
    """The epsilon NVFlare's SVT accountant spent on one call and over the run so far (None: no SVT).

    Args:
        meta: the meta :func:`privatize_update` returned.
    """
    call, run = meta.get(SVT_BUDGET) or {}, meta.get(SVT_ACCOUNTANT) or {}
    return call.get("epsilon_total"), run.get("epsilon_total")


def describe(report: dict[str, dict[str, Any]], meta: dict) -> str:
    """One phrase: cosine, norm and share kept per part, and the SVT epsilon.

    Args:
        report: :func:`cxrfl.common.privacy.fidelity` of the filtered update.
        meta: the meta :func:`privatize_update` returned.
    """
    parts = [
        f"{part}: cosine {_num(m['cosine'])}, norm {_num(m['relative_norm'])}, kept {_num(m['kept'])}"
        for part, m in report.items()
        if m["entries"]
    ]
    call, run = svt_epsilon(meta)
    eps = f"; SVT epsilon {call:.4g} this round, {run:.4g} in this run" if call is not None else ""
    return "vs the true update: " + ("; ".join(parts) or "no change") + eps


def _num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def privatize_update(
    inner: Any,
    result: dict[str, Any],
    received: dict[str, Any],
    *,
    meta: dict | None = None,
    shareable: Shareable | None = None,
    fl_ctx: FLContext | None = None,
    current_round: int | None = None,
) -> tuple[dict[str, np.ndarray], dict]:
    """``received + inner(result - received)`` for every floating-point array of ``result``.

    Args:
        inner: an NVFlare DXO filter working on WEIGHT_DIFF (percentile, SVT).
        result: the site's full parameters.
        received: the parameters the site received for this task (missing: zero).
        meta: DXO meta passed to the inner filter.
        shareable: the result shareable (the SVT accountant reads its round header).
        fl_ctx: the context (logging).
        current_round: the round for the SVT accountant when no ``shareable`` is given.

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
        if shareable is None:
            shareable = Shareable()
            if current_round is not None:
                shareable.set_header(MetaKey.CURRENT_ROUND, int(current_round))
        filtered = inner.process_dxo(diff_dxo, shareable, fl_ctx or FLContext())
        new_diffs = (filtered.data if filtered is not None else diffs) or {}
        for k in diffs:
            d = np.asarray(new_diffs.get(k, np.zeros_like(diffs[k])))
            out[k] = (out[k] + d).astype(np.asarray(result[k]).dtype, copy=False)
        if filtered is not None:
            new_meta = {k: v for k, v in (filtered.meta or {}).items() if k not in (meta or {})}
    return out, new_meta
