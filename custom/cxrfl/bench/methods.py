"""The methods the surgical-aggregation papers compare, as head modes of one training loop.

Every federated method is the surgical-aggregation server loop
(:class:`cxrfl.surgical.server.SurgicalServer`) with a head mode, a missing-label policy and a
BatchNorm strategy; the individually trained and centralized baselines are the same loop on one
site (each hospital alone, or every image pooled with missing labels as negatives). The NVFlare
job that runs a federated method is named in ``job``.

FedBN+ (BatchNorm frozen at the statistics of a pretrained feature extractor, the papers' choice
from ImageNet weights) is only defined from a pretrained checkpoint: those methods are run only
with one, and asking for them without one is an error.
"""

from __future__ import annotations

from dataclasses import dataclass

from cxrfl.errors import ConfigError


@dataclass(frozen=True)
class Method:
    """One method of the comparison.

    Args:
        name: identifier (results keys, ``--methods``).
        label: the papers' name for it (tables).
        kind: ``individual`` (one model per site, alone), ``central`` (pooled data) or ``federated``.
        head_mode: ``surgical``, ``union`` or ``local`` (see :mod:`cxrfl.surgical.head_modes`).
        missing: ``negative`` or ``ignore`` for classes a site (or the pooled data) lacks.
        batchnorm: ``fedavg``, ``fedbn`` or ``fedbn+``.
        job: the NVFlare job under ``jobs/`` that runs it, if any.
    """

    name: str
    label: str
    kind: str
    head_mode: str = "surgical"
    missing: str = "negative"
    batchnorm: str = "fedavg"
    job: str | None = None

    @property
    def per_site_models(self) -> bool:
        """Each site ends with a model of its own: a local head (personalized FL) or local BatchNorm (FedBN)."""
        return self.kind == "federated" and (self.head_mode == "local" or self.batchnorm == "fedbn")

    @property
    def selection_matters(self) -> bool:
        """Its validation loss differs between the selection rules: vanilla FL (other sites'
        classes are negatives) and centralized training (pooled data, the same)."""
        return self.kind == "central" or (
            self.kind == "federated" and self.head_mode == "union" and self.missing == "negative"
        )

    @property
    def single_global_model(self) -> bool:
        """One model that predicts every class of the federation."""
        return self.kind == "central" or (self.kind == "federated" and not self.per_site_models)

    @property
    def needs_pretrained(self) -> bool:
        """FedBN+: BatchNorm frozen at the statistics of a pretrained feature extractor."""
        return self.batchnorm == "fedbn+"


METHODS: tuple[Method, ...] = (
    Method("individual", "Individually trained", "individual"),
    Method("pfl-fedavg", "PFL (FedAvg)", "federated", "local", batchnorm="fedavg", job="personalized_fl"),
    Method("pfl-fedbn", "PFL (FedBN)", "federated", "local", batchnorm="fedbn", job="personalized_fl_fedbn"),
    Method("pfl-fedbn+", "PFL (FedBN+)", "federated", "local", batchnorm="fedbn+"),
    Method("centralized", "Centralized", "central", "surgical", "negative"),
    Method("vanilla-fedavg", "FL (FedAvg)", "federated", "union", "negative", job="vanilla_fl"),
    Method("vanilla-fedbn+", "FL (FedBN+)", "federated", "union", "negative", "fedbn+"),
    Method("partial-fedavg", "FL + PL (FedAvg)", "federated", "union", "ignore", job="fl_partial_loss"),
    Method("partial-fedbn+", "FL + PL (FedBN+)", "federated", "union", "ignore", "fedbn+"),
    Method("surgical-fedavg", "FL + SA (FedAvg)", "federated", "surgical", job="surgical_agg"),
    Method("surgical-fedbn", "FL + SA (FedBN)", "federated", "surgical", batchnorm="fedbn", job="surgical_agg_fedbn"),
    Method("surgical-fedbn+", "FL + SA (FedBN+)", "federated", "surgical", batchnorm="fedbn+"),
)
"""Every method, in the papers' table order."""

BY_NAME = {m.name: m for m in METHODS}
REFERENCE = "surgical-fedavg"
"""The method p-values are computed against (surgical aggregation as the default job runs it)."""

DEFAULT_METHODS: tuple[str, ...] = (
    "individual",
    "pfl-fedavg",
    "centralized",
    "vanilla-fedavg",
    "partial-fedavg",
    "surgical-fedavg",
    "surgical-fedbn",
)
"""What a comparison runs by default (issue 14): the baselines, the existing methods and surgical
aggregation with FedAvg and with FedBN."""

PRETRAINED_METHODS: tuple[str, ...] = ("vanilla-fedbn+", "partial-fedbn+", "surgical-fedbn+")
"""Added to the defaults when the feature extractor starts from a pretrained checkpoint (the
papers' FedBN+ rows of the global models)."""

ABLATION_METHODS: tuple[str, ...] = ("vanilla-fedavg", "partial-fedavg", "surgical-fedavg")
"""The ablations' methods (the papers leave the baselines without one global model out)."""


def select(names: list[str] | tuple[str, ...] | None, *, pretrained: bool = False) -> list[Method]:
    """The methods to run, in table order; the reference is always included.

    Args:
        names: method names (None: :data:`DEFAULT_METHODS`, plus :data:`PRETRAINED_METHODS` when
            ``pretrained``).
        pretrained: the feature extractor starts from a pretrained checkpoint.

    Raises:
        ConfigError: an unknown name, or a FedBN+ method without a pretrained checkpoint.
    """
    if not names:
        names = DEFAULT_METHODS + (PRETRAINED_METHODS if pretrained else ())
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ConfigError(f"unknown method(s) {unknown}; available: {', '.join(BY_NAME)}")
    needs = [n for n in names if BY_NAME[n].needs_pretrained]
    if needs and not pretrained:
        raise ConfigError(
            f"method(s) {', '.join(needs)} use FedBN+, BatchNorm frozen at the statistics of a pretrained "
            "feature extractor: give --pretrained CHECKPOINT (e.g. ImageNet DenseNet121 weights), or use "
            "the FedAvg / FedBN variants when training from scratch"
        )
    wanted = set(names) | {REFERENCE}
    return [m for m in METHODS if m.name in wanted]
