"""One site's endpoint of surgical aggregation and its baselines: answers ``train`` and ``validate``.

:class:`SurgicalSiteHost` implements :class:`cxrfl.common.transport.SiteHost`. Every task carries
the run's settings in its meta (``model_config``, ``train_config``, ``batchnorm``, ``head_mode``,
``missing``, ``run_key``), so there is one source of truth per run; the host builds a
:class:`cxrfl.surgical.learner.SiteLearner` for them and reuses it while they stay the same.

Tasks (meta of the request -> meta of the answer):

- ``train`` with ``phase="warmup"``: head warm-up on the received initial feature extractor ->
  ``classes`` (the head's row order), ``num_samples``, ``metrics``; the params are the update.
- ``train`` with ``phase="train"``, ``round`` r, ``classes`` (the received head's row order,
  union heads), ``keep_rounds``: evaluate the received model of round r - 1 on the validation
  split, then train one round -> as above.
- ``validate`` with ``split``, ``model_round``, ``classes``, ``keep_rounds``: evaluate the
  received model on a split -> ``classes``, ``metrics``; no params.
- ``site_fit`` (evaluation-only runs that fit calibration or operating points) with ``keep`` (the
  site's classes the model has) and ``clinical`` (:meth:`cxrfl.clinical.fitted.ClinicalFit.to_dict` of
  those classes): write the received model, its head cut to ``keep``, with them to
  ``<state_root>/site_models/<run_key>.pt`` (owner-only) -> ``written``.

What a site keeps between tasks (optimizer state, local BatchNorm or head, their copies per
model round) lives in ``<state_root>/<run_key>``, so a run resumed by a new job finds it again;
the state of the last :data:`KEEP_STATES` runs is kept (the image cache and site models are never pruned).
"""

from __future__ import annotations

import shutil
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from cxrfl.clinical.fitted import CHECKPOINT_KEY, ClinicalFit
from cxrfl.common.io import owner_only, plain_name
from cxrfl.common.transport import Message
from cxrfl.data.cache import IMAGE_CACHE
from cxrfl.data.site import SiteData
from cxrfl.nn.models import HEAD_PREFIX, ModelConfig, save_checkpoint
from cxrfl.nn.training import TrainConfig
from cxrfl.surgical.learner import SiteLearner, SiteUpdate

TRAIN, VALIDATE, CLASSES, SITE_FIT = "train", "validate", "classes", "site_fit"
TASKS: tuple[str, ...] = (TRAIN, VALIDATE)
"""The tasks of a training job."""
EVALUATION_TASKS: tuple[str, ...] = (CLASSES, VALIDATE, SITE_FIT)
"""The tasks of an evaluation-only job (:mod:`cxrfl.fedeval`)."""
SITE_MODELS = "site_models"
"""Folder under a site's state root of the models an evaluation-only run calibrated for the site."""

KEEP_STATES = 3
"""Runs whose site state (optimizer, local BatchNorm or head) stays on disk."""


@dataclass(frozen=True)
class LearnerSettings:
    """What decides a site's learner: the run's settings from the task meta.

    Args:
        model_config: network settings (``pretrained`` is never read at the site: the weights arrive).
        train_config: local training settings.
        batchnorm: BatchNorm strategy.
        head_mode: head mode.
        missing: missing-label policy of union heads.
        selection: what a site's validation loss counts (:data:`cxrfl.surgical.head_modes.SELECTION_RULES`).
        run_key: names the run's state folder (the first job of a resumed chain).
    """

    model_config: ModelConfig
    train_config: TrainConfig
    batchnorm: str
    head_mode: str
    missing: str
    selection: str
    run_key: str

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any], train_overrides: Mapping[str, Any] | None = None) -> LearnerSettings:
        """The settings a task carries.

        Args:
            meta: the task meta.
            train_overrides: train settings this site replaces (e.g. a step cap).

        Raises:
            ConfigError: a ``run_key`` that is not a plain name (it names a folder of this site).
        """
        return cls(
            model_config=ModelConfig.from_dict({**(meta.get("model_config") or {}), "pretrained": None}),
            train_config=TrainConfig.from_dict({**(meta.get("train_config") or {}), **(train_overrides or {})}),
            batchnorm=str(meta.get("batchnorm", "fedavg")),
            head_mode=str(meta.get("head_mode", "surgical")),
            missing=str(meta.get("missing", "negative")),
            selection=str(meta.get("selection", "head")),  # a server from before issue 41 selects on the head
            run_key=plain_name(
                meta.get("run_key") or "run",
                "run_key",
                "the server sent a run key that is not a plain name; this site refuses the task",
            ),
        )


class Warmups(Protocol):
    """Head warm-ups done earlier in this process that a host takes over instead of training one
    (the benchmarks' ``cxrfl.bench.warmups.WarmupCache``: a benchmark's methods share one per seed)."""

    def key(self, site: str, params: Mapping[str, Any], settings: LearnerSettings) -> Hashable:
        """What a warm-up depends on.

        Args:
            site: the site name.
            params: the received initial feature extractor.
            settings: the learner's settings.
        """

    def get(self, key: Hashable) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """The model state and metrics of an earlier warm-up (None: none yet).

        Args:
            key: from :meth:`key`.
        """

    def put(self, key: Hashable, state: dict[str, torch.Tensor], metrics: dict[str, Any]) -> None:
        """Keep a warm-up.

        Args:
            key: from :meth:`key`.
            state: the full model state after it.
            metrics: its metrics.
        """


class SurgicalSiteHost:
    """A site of surgical aggregation (or of a baseline head mode).

    Args:
        data: the site's checked data.
        state_root: folder for state kept across tasks and jobs (one sub-folder per run key).
        device: torch device.
        num_workers: data-loader worker processes.
        warmups: warm-ups to take over instead of training them again (None: always train).
        train_overrides: train settings this site replaces (e.g. ``max_steps_per_epoch``).
    """

    tasks: tuple[str, ...] = (*TASKS, CLASSES, SITE_FIT)

    def __init__(
        self,
        data: SiteData,
        state_root: str | Path,
        *,
        device: torch.device | None = None,
        num_workers: int = 0,
        warmups: Warmups | None = None,
        train_overrides: Mapping[str, Any] | None = None,
    ) -> None:
        self.data = data
        self.state_root = Path(state_root)
        self.device = device or torch.device("cpu")
        self.num_workers = num_workers
        self.warmups = warmups
        self.train_overrides = dict(train_overrides or {})
        self.learner: SiteLearner | None = None
        self.settings: LearnerSettings | None = None

    def learner_for(self, meta: Mapping[str, Any]) -> SiteLearner:
        """The learner for the settings of a task (built when they change).

        Args:
            meta: the task meta.
        """
        settings = LearnerSettings.from_meta(meta, self.train_overrides)
        if self.learner is None or settings != self.settings:
            state_dir = self.state_root / settings.run_key
            if not state_dir.is_dir():
                prune_states(self.state_root, KEEP_STATES - 1)
            self.learner = SiteLearner(
                self.data,
                state_dir,
                model_config=settings.model_config,
                train_config=settings.train_config,
                batchnorm=settings.batchnorm,
                device=self.device,
                num_workers=self.num_workers,
                head_mode=settings.head_mode,
                missing=settings.missing,
                selection=settings.selection,
            )
            self.settings = settings
        return self.learner

    def handle(self, task: str, params: Mapping[str, Any], meta: Mapping[str, Any]) -> Message:
        """Answer one task (see the module docstring).

        Args:
            task: ``train``, ``validate`` (with ``counts`` in the meta: binned score counts too, see
                :meth:`SiteLearner.evaluate_params`) or ``classes`` (the site's class names, for an
                evaluation-only run; nothing else).
            params: the received parameters.
            meta: the task meta.

        Raises:
            ValueError: an unknown task; any error of the site's computation propagates.
        """
        if task == CLASSES:
            return {}, {"classes": list(self.data.classes)}
        learner = self.learner_for(meta)
        if task == TRAIN:
            update = self._train(learner, dict(params), meta)
            return update.params, {
                "classes": update.classes,
                "num_samples": update.num_samples,
                "metrics": update.metrics,
            }
        if task == VALIDATE:
            metrics = learner.evaluate_params(
                dict(params),
                str(meta.get("split", "test")),
                classes=meta.get("classes"),
                model_round=meta.get("model_round"),
                keep_rounds=meta.get("keep_rounds") or (),
                counts=meta.get("counts"),
            )
            return {}, {"classes": list(learner.classes), "metrics": metrics}
        if task == SITE_FIT:
            return {}, {"written": self._site_fit(params, meta)}
        raise ValueError(f"unknown surgical-aggregation task {task!r}")

    def _site_fit(self, params: Mapping[str, Any], meta: Mapping[str, Any]) -> str:
        """Write the received model with its calibration and operating points as this site's model.

        Returns:
            the file's path under the state root.

        Raises:
            ConfigError: the fit names a class this site does not have, or is malformed.
        """
        state = self.model_state(params, meta)  # the received parameters, checked whole by the learner
        assert self.settings is not None and self.learner is not None  # model_state built them
        keep = set(meta.get("keep") or ())
        rows = [i for i, c in enumerate(self.learner.classes) if c in keep]
        classes = [self.learner.classes[i] for i in rows]  # the model's classes among the site's own
        for key in (HEAD_PREFIX + "weight", HEAD_PREFIX + "bias"):
            state[key] = state[key][rows]
        where = f"site {self.data.site}: the server's calibration"
        fit = ClinicalFit.from_checkpoint({"classes": classes, CHECKPOINT_KEY: meta.get(CHECKPOINT_KEY)}, where)
        if fit is None:
            raise ValueError(f"{where} is missing: the task carries no '{CHECKPOINT_KEY}' entry")
        path = self.state_root / SITE_MODELS / f"{self.settings.run_key}.pt"
        extra = {CHECKPOINT_KEY: fit.to_dict()}
        save_checkpoint(path, state, classes=classes, model_config=self.settings.model_config, extra=extra)
        owner_only(path, up_to=self.state_root)
        return str(path.relative_to(self.state_root))

    def _train(self, learner: SiteLearner, params: dict[str, Any], meta: Mapping[str, Any]) -> SiteUpdate:
        if meta.get("phase") != "warmup":
            return learner.train_round(
                params,
                int(meta.get("round", 1)),
                classes=meta.get("classes"),
                keep_rounds=meta.get("keep_rounds") or (),
            )
        if self.warmups is None:
            return learner.warmup(params)
        assert self.settings is not None  # learner_for set them
        key = self.warmups.key(self.data.site, params, self.settings)
        done = self.warmups.get(key)
        if done is not None:
            return learner.adopt_warmup(*done)
        update = learner.warmup(params)
        self.warmups.put(key, learner.warm_state(), update.metrics)
        return update

    def model_state(self, params: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The site's whole model for a received one (with the site's own parts of ``meta["model_round"]``):
        a personalized model, read in-process by the benchmark.

        Args:
            params: the received parameters.
            meta: a ``validate`` task's meta.
        """
        learner = self.learner_for(meta)
        learner.receive(
            dict(params),
            meta.get("classes"),
            model_round=meta.get("model_round"),
            keep_rounds=meta.get("keep_rounds") or (),
        )
        return {k: v.detach().cpu().clone() for k, v in learner.model.state_dict().items()}

    def describe(self, task: str, meta: Mapping[str, Any], answer: Mapping[str, Any]) -> str | None:
        """One operator line per task: losses, validation AUROC and time."""
        m = answer.get("metrics") or {}
        if task == CLASSES:
            return None
        if task == TRAIN:
            return (
                f"site {self.data.site} {m.get('phase', meta.get('phase'))} round {meta.get('round', 0)}: "
                f"train_loss {_fmt(m.get('train_loss'))} val_loss {_fmt(m.get('val_loss'))} "
                f"val_AUROC {_fmt(m.get('val_mean_auroc'))} time {_fmt(m.get('seconds'), 1)}s"
                + (f" ({m['images_per_second']:.1f} img/s training)" if m.get("images_per_second") else "")
            )
        return (
            f"site {self.data.site} {m.get('split', meta.get('split'))} (model of round {meta.get('model_round')}): "
            f"loss {_fmt(m.get('loss'))} mean AUROC {_fmt(m.get('mean_auroc'))} time {_fmt(m.get('seconds'), 1)}s"
        )

    def scalars(self, task: str, answer: Mapping[str, Any]) -> tuple[dict[str, float], int] | None:
        """Training and validation metrics per round (``train`` tasks only): the losses, the mean
        AUROC and the AUROC of each of the site's classes (``val_auroc/<class>``) on the received model."""
        m = answer.get("metrics") or {}
        if task != TRAIN:
            return None
        values = {k: m[k] for k in ("train_loss", "val_loss", "val_mean_auroc") if m.get(k) is not None}
        values.update({f"val_auroc/{c}": v for c, v in (m.get("val_auroc") or {}).items() if v is not None})
        return values, int(m.get("round", 0))


def prune_states(root: Path, keep: int) -> None:
    """Remove all but the ``keep`` most recently used run states under ``root``.

    Args:
        root: the folder of run states.
        keep: how many to keep.
    """
    if not root.is_dir():
        return
    runs = sorted(
        (p for p in root.iterdir() if p.is_dir() and p.name not in (IMAGE_CACHE, SITE_MODELS)),  # these stay
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in runs[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def _fmt(v: float | None, digits: int = 4) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"
