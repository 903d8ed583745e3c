"""Surgical aggregation as an NVFlare ``ModelAggregator``, for NVFlare's own workflows.

A thin wrapper over :class:`cxrfl.surgical.round_aggregator.RoundAggregator` (validation and the
streaming mean of the shared core, :mod:`cxrfl.core`; head stitching): usable inside NVFlare's
standard ``FedAvg`` (``aggregator=``) or ``ScatterAndGather`` workflows. Each site result must
carry ``meta["classes"]`` (its head's row order) and ``meta["num_samples"]``. Invalid results are
rejected with one log line naming the site and the reason; the others are aggregated. (cxrfl's own
workflow, :class:`cxrfl.fl.surgical.SurgicalAggregation`, uses ``RoundAggregator`` directly.)
"""

from __future__ import annotations

from collections.abc import Sequence

from nvflare.apis.event_type import EventType
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.aggregators.model_aggregator import ModelAggregator

from cxrfl.fl.base import class_names_refusal
from cxrfl.nn.models import HEAD_PREFIX
from cxrfl.surgical.round_aggregator import RoundAggregator


class SurgicalAggregator(ModelAggregator):
    """Surgical aggregation as an NVFlare ``ModelAggregator``.

    Args:
        weighting: ``uniform`` (the papers) or ``samples`` (weighted by ``num_samples``).
        batchnorm: ``fedavg``, ``fedbn`` or ``fedbn+``.
        bn_keys: BatchNorm parameter and buffer names (from :func:`cxrfl.nn.models.batchnorm_keys`).
        robust: None, ``median`` or ``clip`` (off by default). Both need the previous global model
            (:meth:`expect`'s ``reference``): an aggregation without one fails, never a plain mean.
        clip_norm: update norm bound for ``clip`` (and for ``median`` groups of fewer than 3 sites); None:
            each round's lower median update norm.
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
        self.core = RoundAggregator(
            weighting=weighting,
            batchnorm=batchnorm,
            bn_keys=bn_keys,
            robust=robust,
            clip_norm=clip_norm,
            head_prefix=head_prefix,
            warning=self.warning,
        )

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        """At the job's start, refuse a job of a role that may not learn every site's classes: NVFlare's
        workflows send the aggregated model's ``classes`` and ``contributors`` to every site."""
        if event_type == EventType.START_RUN:
            refusal = class_names_refusal(fl_ctx, type(self).__name__)
            if refusal:
                self.system_panic(refusal, fl_ctx)
        super().handle_event(event_type, fl_ctx)

    def expect(
        self,
        shapes: dict[str, tuple] | None,
        announced: dict[str, list[str]] | None = None,
        classes: list[str] | None = None,
        reference: dict | None = None,
    ) -> None:
        """Set what valid results look like (see :meth:`RoundAggregator.expect`).

        Args:
            shapes: non-head parameter name -> shape every site must send.
            announced: site -> the classes it announced; rows for other classes are rejected.
            classes: the global class order; a class no valid site sent keeps its ``reference`` row.
            reference: the previous global parameters (needed with ``classes`` and for ``clip``).
        """
        self.core.expect(shapes, announced, classes, reference)

    def accept_model(self, model: FLModel) -> bool:
        """Validate one site's result and keep it for aggregation.

        Args:
            model: the site's FLModel (``meta``: client_name, classes, num_samples).

        Returns:
            True if accepted, False if rejected (logged with the site and reason).
        """
        meta = model.meta or {}
        return self.core.accept(
            {
                "site": str(meta.get("client_name", "unknown-site")),
                "classes": meta.get("classes"),
                "params": model.params or {},
                "num_samples": meta.get("num_samples"),
            }
        )

    @property
    def rejected(self) -> dict[str, str]:
        """site -> why its result of the current round was rejected."""
        return self.core.rejected

    @property
    def accepted_sites(self) -> list[str]:
        """The sites whose results of the current round were accepted."""
        return self.core.accepted_sites

    def contributors(self) -> dict[str, list[str]]:
        """class -> the sites whose rows were averaged into it (accepted results only)."""
        return self.core.contributors()

    def aggregate_model(self) -> FLModel:
        """Stitch the accepted results; ``meta`` carries ``classes``, ``contributors`` and ``sites``."""
        result = self.core.aggregate()
        return FLModel(
            params_type=ParamsType.FULL,
            params=result.params,
            meta={"classes": result.classes, "contributors": result.contributors, "sites": result.sites},
        )

    def reset_stats(self) -> None:
        """Forget the accepted results and rejections of the current round."""
        self.core.reset()
