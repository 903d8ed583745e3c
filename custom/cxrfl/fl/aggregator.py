"""Surgical aggregation as an NVFlare ``ModelAggregator``: the surgical job's ``aggregator`` component.

A thin wrapper over :class:`cxrfl.surgical.round_aggregator.RoundAggregator` (validation and the
streaming mean of the shared core, :mod:`cxrfl.core`; head stitching), with two uses of one class:

- **In cxrfl's surgical job**, a component of ``config_fed_server.json`` that the workflow
  (:class:`cxrfl.fl.surgical.SurgicalAggregation`) looks up by its ``aggregator_id``, as NVFlare's
  ``ScatterAndGather`` does: the aggregation policy (``weighting``, ``robust``, ``clip_norm``) is
  declared here, and the workflow has the component build each run's round aggregator
  (:meth:`SurgicalAggregator.bind`) with what it derives from the job (BatchNorm keys, head mode).
  An operator sees the aggregation in the job and can swap it: other arguments, or a subclass
  whose ``bind`` returns another ``RoundAggregator``.
- **Inside NVFlare's own workflows** (``FedAvg(aggregator=...)``, ``ScatterAndGather``). Each site
  result must carry ``meta["classes"]`` (its head's row order) and ``meta["num_samples"]``; invalid
  results are rejected with one log line naming the site and the reason, the others aggregated.
  What these workflows give up against cxrfl's own: every site receives the whole head and its
  ``meta`` (every site's class names and contributors), not the rows of its own classes, so only a
  lead or project admin may submit such a job (refused at the workflow's first call otherwise); no
  head warm-up, no expected shapes (:meth:`expect` is never called), no per-class selection or
  evaluation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nvflare.apis.event_type import EventType
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.aggregators.model_aggregator import ModelAggregator

from cxrfl.fl.base import class_names_refusal
from cxrfl.nn.models import HEAD_PREFIX
from cxrfl.surgical.round_aggregator import RoundAggregator

AGGREGATION_POLICY = ("weighting", "robust", "clip_norm")
"""The :class:`cxrfl.surgical.config.SurgicalConfig` settings that a job naming an aggregator component
declares on that component only (the workflow refuses them as its own arguments then)."""


class SurgicalAggregator(ModelAggregator):
    """Surgical aggregation as an NVFlare ``ModelAggregator`` (see the module docstring for its two uses).

    Args:
        weighting: ``uniform`` (the papers) or ``samples`` (weighted by ``num_samples``).
        batchnorm: ``fedavg``, ``fedbn`` or ``fedbn+`` (NVFlare's workflows; cxrfl's passes the job's).
        bn_keys: BatchNorm parameter and buffer names (from :func:`cxrfl.nn.models.batchnorm_keys`;
            NVFlare's workflows; cxrfl's passes the model's).
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
        # kept under their own names: NVFlare's job exporter reads the arguments back from them
        self.weighting = weighting
        self.batchnorm = batchnorm
        self.bn_keys = tuple(bn_keys)
        self.robust = robust
        self.clip_norm = clip_norm
        self.head_prefix = head_prefix
        self.refusal: str | None = None
        self.panicked = False
        self.core = self.bind(batchnorm=batchnorm, bn_keys=self.bn_keys, warning=self.warning)

    def policy(self) -> dict[str, Any]:
        """The aggregation settings this component declares (:data:`AGGREGATION_POLICY`)."""
        return {name: getattr(self, name) for name in AGGREGATION_POLICY}

    def bind(self, **job: Any) -> RoundAggregator:
        """A new round aggregator of this component's policy, for the run about to start; it is also the
        one :meth:`accept_model` and :meth:`aggregate_model` use from now on.

        Args:
            job: the other :class:`RoundAggregator` arguments, from the job (cxrfl's workflow:
                ``batchnorm``, ``bn_keys``, ``head_mode``, ``max_num_samples``, ``warning``).
        """
        self.core = RoundAggregator(**self.policy(), head_prefix=self.head_prefix, **job)
        return self.core

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        """At the job's start, note whether the submitter's role may learn every site's classes. NVFlare's
        workflows send the aggregated model's ``classes`` and ``contributors`` to every site, so their
        first call (:meth:`reset_stats` or :meth:`accept_model`) refuses such a job; cxrfl's workflow,
        which sends each site its own rows, binds the component and never makes those calls."""
        if event_type == EventType.START_RUN:
            self.refusal = class_names_refusal(fl_ctx, type(self).__name__)
        super().handle_event(event_type, fl_ctx)

    def _refused(self) -> bool:
        """Whether this job is refused (see :meth:`handle_event`); the first time, stop it with the line why."""
        if self.refusal and not self.panicked:
            self.panicked = True
            self.system_panic(self.refusal, self.fl_ctx)
        return bool(self.refusal)

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
        if self._refused():
            return False
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
        self._refused()
        self.core.reset()
