"""NVFlare aggregator around :func:`cxrfl.surgical.aggregation.surgical_aggregate`.

Works inside our :class:`cxrfl.fl.controller.SurgicalAggregation` and, on its own, inside
NVFlare's standard ``FedAvg`` (``aggregator=``) or ``ScatterAndGather`` workflows. Each site
result must carry ``meta["classes"]`` (its head's row order) and ``meta["num_samples"]``.
Invalid results are rejected with one log line naming the site and the reason; the others
are aggregated. For the plain mean (``robust`` off) each accepted result's feature extractor is
added to a running sum while it is checked for NaN/Inf (:class:`cxrfl.surgical.aggregation.RunningSum`),
so every update is read once; the head rows are stitched at :meth:`aggregate_model`.
"""

from __future__ import annotations

from collections.abc import Sequence

from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.aggregators.model_aggregator import ModelAggregator

from cxrfl.surgical.aggregation import RunningSum, first_nonfinite, normalize_shapes, surgical_aggregate, validate_update
from cxrfl.errors import UpdateRejected
from cxrfl.nn.models import HEAD_PREFIX


class SurgicalAggregator(ModelAggregator):
    """Surgical aggregation as an NVFlare ``ModelAggregator``.

    Args:
        weighting: ``uniform`` (the papers) or ``samples`` (weighted by ``num_samples``).
        batchnorm: ``fedavg``, ``fedbn`` or ``fedbn+`` (see the core function).
        bn_keys: BatchNorm parameter and buffer names (from :func:`cxrfl.nn.models.batchnorm_keys`).
        robust: None, ``median`` or ``clip`` (off by default). ``clip`` bounds each update relative
            to the previous global model, so the first aggregation (no reference yet) is a plain mean.
        clip_norm: update norm bound for ``clip``.
        head_prefix: state-dict prefix of the classification head.
    """

    def __init__(
        self,
        weighting: str = "uniform",
        batchnorm: str = "fedavg",
        bn_keys: Sequence[str] = (),
        robust: str | None = None,
        clip_norm: float | None = None,
        head_prefix: str = HEAD_PREFIX,
    ) -> None:
        super().__init__()
        if weighting not in ("uniform", "samples"):
            raise ValueError(f"weighting must be 'uniform' or 'samples', got {weighting!r}")
        if robust not in (None, "median", "clip"):
            raise ValueError(f"robust must be null, 'median' or 'clip', got {robust!r}")
        if robust == "clip" and not clip_norm:
            raise ValueError("robust='clip' needs a positive clip_norm")
        self.weighting = weighting
        self.batchnorm = batchnorm
        self.bn_keys = tuple(bn_keys)
        self.robust = robust
        self.clip_norm = clip_norm
        self.head_prefix = head_prefix
        self.expected_shapes: dict[str, tuple] | None = None
        self.announced: dict[str, list[str]] = {}
        self.classes: list[str] | None = None
        self.reference: dict | None = None
        self.rejected: dict[str, str] = {}
        self._updates: list[dict] = []
        self._running: RunningSum | None = None  # the plain mean's sum, fed at accept time

    def expect(
        self,
        shapes: dict[str, tuple] | None,
        announced: dict[str, list[str]] | None = None,
        classes: list[str] | None = None,
        reference: dict | None = None,
    ) -> None:
        """Set what valid results look like for the next aggregation.

        Args:
            shapes: non-head parameter name -> shape every site must send.
            announced: site -> the classes it announced; rows for other classes are rejected.
            classes: the global class order; a class no valid site sent keeps its ``reference`` row.
            reference: the previous global parameters (needed with ``classes`` and for ``clip``).
        """
        self.expected_shapes = normalize_shapes(shapes) if shapes is not None else None  # once, not per result
        self.announced = dict(announced or {})
        self.classes = list(classes) if classes is not None else None
        self.reference = reference
        self._running = None

    def accept_model(self, model: FLModel) -> bool:
        """Validate one site's result and keep it for aggregation.

        Args:
            model: the site's FLModel (``meta``: client_name, classes, num_samples).

        Returns:
            True if accepted, False if rejected (logged with the site and reason).
        """
        meta = model.meta or {}
        site = str(meta.get("client_name", "unknown-site"))
        update = {
            "site": site,
            "classes": list(meta.get("classes") or []),
            "params": model.params or {},
            "num_samples": meta.get("num_samples"),
        }
        streaming = self.robust is None  # the plain mean: sum while checking, each array read once
        try:
            validate_update(
                update,
                expected_shapes=self.expected_shapes,
                head_prefix=self.head_prefix,
                announced_classes=self.announced.get(site) if self.announced else None,
                check_finite=not streaming,
            )
            if streaming:
                self._add_checked(update)
        except UpdateRejected as exc:
            self.rejected[site] = str(exc)
            self.warning(f"rejected result: {exc}")
            return False
        self._updates.append(update)
        return True

    def _add_checked(self, update: dict) -> None:
        """NaN/Inf check of a structurally valid update, adding it to the running sum on the way."""
        params = update["params"]
        drop = set(self.bn_keys) if self.batchnorm != "fedavg" else set()
        keys = [k for k in params if not k.startswith(self.head_prefix) and k not in drop]
        if self._running is None:
            self._running = RunningSum(keys, self.head_prefix)
        running = self._running
        if running.usable and running.keys != keys:  # no expected shapes given: aggregation will say why
            running.usable = False
        weight = float(update["num_samples"]) if self.weighting == "samples" else 1.0
        bad = running.add(update["site"], params, weight, check_finite=True) if running.usable else first_nonfinite(params.items())
        if bad is not None:
            raise UpdateRejected(f"site {update['site']}: non-finite values (NaN or Inf) in {bad!r}")

    @property
    def accepted_sites(self) -> list[str]:
        return [u["site"] for u in self._updates]

    def contributors(self) -> dict[str, list[str]]:
        """class -> the sites whose rows were averaged into it (accepted results only)."""
        out: dict[str, list[str]] = {}
        for u in self._updates:
            for c in u["classes"]:
                out.setdefault(c, []).append(u["site"])
        return {c: sorted(s) for c, s in sorted(out.items())}

    def aggregate_model(self) -> FLModel:
        """Stitch the accepted results; ``meta`` carries ``classes`` and ``contributors``."""
        if not self._updates:
            raise UpdateRejected("no valid site result to aggregate")
        params, classes = surgical_aggregate(
            self._updates,
            head_prefix=self.head_prefix,
            classes=self.classes,
            weighting=self.weighting,
            batchnorm=self.batchnorm,
            bn_keys=self.bn_keys,
            robust=None if self.robust == "clip" and self.reference is None else self.robust,
            clip_norm=self.clip_norm if self.reference is not None else None,
            reference=self.reference,
            running=self._running,
        )
        meta = {"classes": classes, "contributors": self.contributors(), "sites": sorted(self.accepted_sites)}
        self.reset_stats()
        return FLModel(params_type=ParamsType.FULL, params=params, meta=meta)

    def reset_stats(self) -> None:
        """Forget the accepted results and rejections of the current round."""
        self._updates = []
        self.rejected = {}
        self._running = None
