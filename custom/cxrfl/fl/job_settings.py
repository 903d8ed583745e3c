"""What every cxrfl recipe takes beside its method's settings (:class:`JobSettings`): name, sites,
resources, device and threads, tracking, privacy, quantization, what ``app/custom`` holds.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from nvflare.apis.job_def import ALL_SITES
from nvflare.utils.job_launcher_utils import validate_portable_resource_spec

from cxrfl.common.config import Config
from cxrfl.common.privacy import check_privacy
from cxrfl.data.dataset import resolve_workers
from cxrfl.errors import ConfigError
from cxrfl.fl.packaging import PACKAGING, packaging
from cxrfl.fl.resources import DEFAULT_KEY, PORTABLE_KEYS

TRACKERS = ("tensorboard", "mlflow")
"""Experiment trackers a recipe can send metrics to (both at once is fine)."""

QUANTIZE_TYPES = ("float16", "blockwise8", "float4", "normfloat4")
"""NVFlare's quantization formats a job's ``quantize`` may name (:mod:`cxrfl.fl.quantization`)."""

ANALYTIC_SENDER = "analytic_sender"
"""Component id of the analytics writer on the server and on every site."""


@dataclass(frozen=True)
class JobSettings(Config):
    """What every cxrfl recipe takes beside its method's settings.

    Args:
        name: job name (and the folder an export writes).
        min_clients: sites that must be connected for the job to start (``meta.json``).
        description: one line for ``meta.json``.
        resources: what every site must offer before NVFlare gives it the job (``resource_spec``'s
            ``@default``): ``num_of_gpus``, ``num_of_cpus``, ``memory`` (``"32Gi"``); see
            :mod:`cxrfl.fl.resources`.
        site_resources: one site's request over ``resources`` (``{"hospital-a": {"num_of_gpus": 2}}``),
            which may also name keys of that site's resource manager (``mem_per_gpu_in_GiB``).
        device: the sites' torch device: ``auto`` (CUDA when available), ``cpu``, ``cuda``, ``cuda:N``.
        num_workers: data-loader worker processes per site loader, or ``auto`` (one per core the
            site process is given, less one; :func:`cxrfl.data.dataset.resolve_workers`).
        num_threads: CPU threads per site (0: every core the site process is given).
        tracking: experiment trackers (:data:`TRACKERS`); empty: none.
        tracking_uri: MLflow tracking server (``http://host:5000``, ``sqlite:///path.db``); None: an
            SQLite store ``mlflow.db`` in the job's server workspace folder (no server needed).
        privacy: None (off), or ``{"method": "percentile" | "svt", "args": {...}}``: NVFlare's
            ``PercentilePrivacy`` / ``SVTPrivacy`` on every ``train`` result, applied to the weight
            difference by :class:`cxrfl.fl.privacy.UpdatePrivacy` (checked, and its missing args
            written explicitly, by :mod:`cxrfl.common.privacy`).
        quantize: None (off), or an NVFlare quantization format of :data:`QUANTIZE_TYPES` for what the
            server sends and the sites return, BatchNorm statistics and integer arrays kept exact
            (:mod:`cxrfl.fl.quantization`; needs ``pip install 'cxrfl[quantization]'``).
        custom: how the job carries its code: ``readme`` or ``preinstalled`` (:data:`PACKAGING`).
        sites: the client sites by name. Named: the server's app (``config_fed_server.json``) goes to
            the server alone and each named site gets a client app; empty: one app to NVFlare's
            ``@ALL`` (the server and every site, so every site also receives the server's config).
    """

    SECTION: ClassVar[str] = "job"
    name: str
    min_clients: int = field(default=2, metadata={"ge": 1})
    description: str = ""
    resources: dict[str, Any] = field(default_factory=dict)
    site_resources: dict[str, dict[str, Any]] = field(default_factory=dict)
    device: str = "auto"
    num_workers: int | str = 0
    num_threads: int = field(default=1, metadata={"ge": 0})
    tracking: tuple[str, ...] = ("tensorboard",)
    tracking_uri: str | None = None
    privacy: dict[str, Any] | None = None
    quantize: str | None = field(default=None, metadata={"choices": QUANTIZE_TYPES})
    custom: str = field(default="readme", metadata={"choices": PACKAGING[:2]})
    sites: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "custom", packaging(self.custom, "job.custom"))  # an old name: mapped, with a warning
        super().__post_init__()
        if len(set(self.sites)) != len(self.sites) or any(not s or s in ("server", ALL_SITES) for s in self.sites):
            self.fail(
                "sites", f"must list distinct client site names (not 'server' or '{ALL_SITES}'), got {list(self.sites)}"
            )
        bad = [t for t in self.tracking if t not in TRACKERS]
        if bad or len(set(self.tracking)) != len(self.tracking):
            self.fail("tracking", f"must list distinct trackers of {list(TRACKERS)}, got {list(self.tracking)}")
        if self.tracking_uri is not None and "mlflow" not in self.tracking:
            self.fail("tracking_uri", "is MLflow's; add 'mlflow' to tracking")
        if "mlflow" in self.tracking and importlib.util.find_spec("mlflow") is None:
            self.fail("tracking", "'mlflow' needs MLflow: pip install 'cxrfl[mlflow]' (or leave 'mlflow' out)")
        if self.quantize is not None and importlib.util.find_spec("bitsandbytes") is None:
            self.fail("quantize", "needs bitsandbytes: pip install 'cxrfl[quantization]' (or leave quantize unset)")
        resolve_workers(self.num_workers)  # ConfigError naming num_workers
        check_privacy(self.privacy, f"job {self.name}")  # refuses update-destroying settings, warns about lossy ones
        self._check_resources()

    def _check_resources(self) -> None:
        """``resources`` and ``site_resources`` as NVFlare 2.9 reads them (its own validation), else one line."""
        bad = [s for s in self.site_resources if s.startswith("@") or s == "server"]
        if bad:
            self.fail(
                "site_resources",
                f"must be keyed by client site names, got {bad}; a request of every site "
                f"goes in resources (NVFlare's '{DEFAULT_KEY}')",
            )
        unknown = [s for s in self.site_resources if self.sites and s not in self.sites]
        if unknown:
            self.fail("site_resources", f"names {unknown}, not among the job's sites {list(self.sites)}")
        every_site = f" (it holds {list(PORTABLE_KEYS)}; a key of one site's resource manager goes in site_resources)"
        for key, spec, hint in (
            ("resources", {DEFAULT_KEY: self.resources}, every_site),
            ("site_resources", self.resource_spec, ""),
        ):
            try:
                validate_portable_resource_spec(spec)
            except ValueError as exc:
                self.fail(key, f"is not what NVFlare 2.9 reads: {exc}{hint}")

    @property
    def resource_spec(self) -> dict[str, dict[str, Any]]:
        """``meta.json``'s ``resource_spec``: ``resources`` as ``@default``, then each site's own request."""
        every = {DEFAULT_KEY: dict(self.resources)} if self.resources else {}
        return {**every, **{site: dict(spec) for site, spec in self.site_resources.items()}}

    @classmethod
    def split(cls, settings: Mapping[str, Any]) -> tuple[JobSettings, dict[str, Any]]:
        """The job settings among a recipe's keyword arguments, and the rest (the method's).

        Args:
            settings: the recipe's keyword arguments.
        """
        own = {f.name for f in fields(cls)}
        if "resource_spec" in settings:
            raise ConfigError(
                f"{cls.qualified('resource_spec')} is replaced by resources (every site: NVFlare's "
                f"'{DEFAULT_KEY}') and site_resources (one site's own), as NVFlare 2.9 reads them"
            )
        return (
            cls.from_dict({k: v for k, v in settings.items() if k in own}, where="the recipe's arguments"),
            {k: v for k, v in settings.items() if k not in own},
        )

    @property
    def sender_id(self) -> str:
        """The analytics writer's component id ("" when nothing is tracked)."""
        return ANALYTIC_SENDER if self.tracking else ""
