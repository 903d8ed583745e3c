"""A site executor that sends malformed results on purpose (fault injection for tests).

It is copied into a test job's ``app/custom`` folder. Each site answers like
:class:`cxrfl.fl.executor.SiteExecutor`, except that in the rounds named in ``faults`` its
``train`` result is corrupted once (the first time that round is asked for; remembered in a
file of the site's workspace, since the simulator may rebuild the executor between tasks). Sites in ``echo``
do not train in the federated rounds: they send back what they received (a well-formed update
of their own classes), which keeps a test with many sites cheap.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.utils.fl_model_utils import FLModelUtils

from cxrfl.fl.executor import SiteExecutor

HEAD_W, HEAD_B = "classifier.weight", "classifier.bias"


def corrupt(params: dict, meta: dict, fault: str) -> None:
    """Apply one fault to a result in place."""
    body = sorted(k for k in params if not k.startswith("classifier.") and np.asarray(params[k]).ndim >= 1
                  and np.issubdtype(np.asarray(params[k]).dtype, np.floating))
    key = body[0]
    if fault in ("nan", "inf"):
        arr = np.array(params[key], dtype=np.float32, copy=True)
        arr.flat[0] = np.nan if fault == "nan" else np.inf
        params[key] = arr
    elif fault == "shape":
        params[key] = np.asarray(params[key])[:-1]
    elif fault == "missing_key":
        del params[key]
    elif fault == "extra_key":
        params["backbone.injected.weight"] = np.zeros(3, np.float32)
    elif fault == "unannounced":
        meta["classes"] = list(meta["classes"]) + ["Fracture"]
        params[HEAD_W] = np.vstack([params[HEAD_W], params[HEAD_W][:1]])
        params[HEAD_B] = np.concatenate([params[HEAD_B], params[HEAD_B][:1]])
    elif fault == "duplicate":
        meta["classes"] = [meta["classes"][0]] + list(meta["classes"][:-1])
    elif fault == "zero_samples":
        meta["num_samples"] = 0
    elif fault == "negative_samples":
        meta["num_samples"] = -5
    elif fault == "scale":
        params.update({k: np.asarray(v) * 1e6 for k, v in params.items()})
    else:
        raise ValueError(f"unknown fault {fault!r}")


class FaultyExecutor(SiteExecutor):
    """SiteExecutor with scheduled malformed results.

    Args:
        faults: site -> {round (as a string): fault}; faults: nan, inf, shape, missing_key,
            extra_key, unannounced, duplicate, zero_samples, negative_samples, scale, raise (an
            exception in the site's training).
        echo: sites that send back what they received instead of training.
        kwargs: :class:`cxrfl.fl.executor.SiteExecutor` arguments.
    """

    def __init__(self, faults: dict | None = None, echo: list | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.faults = {site: {str(r): f for r, f in rounds.items()} for site, rounds in (faults or {}).items()}
        self.echo = set(echo or ())

    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        site = fl_ctx.get_identity_name()
        incoming = FLModelUtils.from_shareable(shareable)
        meta = dict(incoming.meta or {})
        federated = task_name == "train" and meta.get("phase") == "train"
        if not federated:
            return super().execute(task_name, shareable, fl_ctx, abort_signal)
        rnd = str(meta.get("round"))
        fault = self.faults.get(site, {}).get(rnd)
        marker = Path(fl_ctx.get_engine().get_workspace().get_root_dir()) / f"fault_injected_round_{rnd}"
        if marker.exists():
            fault = None
        if fault == "raise":  # the site's own training fails: SiteExecutor must answer with an error
            marker.touch()

            def broken(meta: dict):
                raise RuntimeError(f"injected failure in round {rnd}")

            self._get_learner = broken
            try:
                return super().execute(task_name, shareable, fl_ctx, abort_signal)
            finally:
                del self._get_learner
        if site in self.echo:
            out = FLModel(params_type=ParamsType.FULL, params=dict(incoming.params or {}),
                          meta={"classes": list(meta.get("classes") or self.data.classes), "num_samples": 10, "metrics": {"phase": "train"}})
        else:
            out = FLModelUtils.from_shareable(super().execute(task_name, shareable, fl_ctx, abort_signal))
            out.params = dict(out.params or {})
        if fault:
            marker.touch()
            corrupt(out.params, out.meta, fault)
            self.log_warning(fl_ctx, f"fault injection: site {site} round {rnd} sends a result with fault {fault!r}")
        return FLModelUtils.to_shareable(out)
