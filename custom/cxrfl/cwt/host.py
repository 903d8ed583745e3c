"""One site's end of the relay: answers ``counts``, ``train`` (its turn) and ``validate`` with its own data.

:class:`CWTSiteHost` is a :class:`cxrfl.common.transport.SiteHost`: the NVFlare executor
(:class:`cxrfl.fl.cwt.CWTExecutor`) and the in-process transport (:mod:`cxrfl.cwt.inprocess`)
both hand it the server's messages. Every task carries the run's settings (``cwt_config``,
``model_config``, ``classes``); the site keeps nothing between tasks that the relay needs
(the weights, Adam's state and the iteration count travel with the model).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from cxrfl.clinical.counts import count_classes
from cxrfl.clinical.subgroups import memberships
from cxrfl.common.io import params_digest, to_numpy
from cxrfl.common.transport import Message
from cxrfl.cwt.config import CWTConfig
from cxrfl.cwt.relay import (
    COUNTS_TASK,
    TASKS,
    TRAIN_TASK,
    VALIDATE_TASK,
    Visit,
    load_optimizer_arrays,
    optimizer_arrays,
    split_params,
)
from cxrfl.cwt.site import CWTSite, eval_summary
from cxrfl.data.site import SiteData
from cxrfl.errors import ConfigError
from cxrfl.nn.models import ModelConfig, build_model
from cxrfl.nn.training import adam

log = logging.getLogger(__name__)


def site_model_config(model_config: Mapping[str, Any] | ModelConfig) -> ModelConfig:
    """The network skeleton on a site: the weights arrive with the relay, no local file is read.

    Args:
        model_config: the server's model settings.
    """
    plain = model_config.to_dict() if isinstance(model_config, ModelConfig) else dict(model_config)
    return ModelConfig.from_dict({**plain, "pretrained": None})


def _num(value: float | None) -> str:
    return "n/a" if value is None or not np.isfinite(value) else f"{value:.4f}"


class CWTSiteHost:
    """Answers the relay's tasks with one site's data.

    Args:
        data: the site's data (the :class:`CWTSite` is built from the first task's settings).
        site: an already built site (in-process runs reuse its image cache); it is reconfigured
            when only the optimizations change.
        device: torch device (default: the site's, else CPU).
        num_workers: data-loader worker processes.
        warning: where the site's label warnings go.
    """

    tasks = TASKS

    def __init__(
        self,
        data: SiteData | None = None,
        *,
        site: CWTSite | None = None,
        device: torch.device | None = None,
        num_workers: int = 0,
        warning: Callable[[str], None] = log.warning,
    ) -> None:
        if data is None and site is None:
            raise ValueError("CWTSiteHost needs the site's data or a built CWTSite")
        self.data = data
        self.site = site
        self.name = site.name if site is not None else data.site
        self.device = device or (site.device if site is not None else torch.device("cpu"))
        self.num_workers = num_workers
        self.warning = warning
        self._model: torch.nn.Module | None = None
        self._model_key: tuple | None = None

    # ------------------------------------------------------------ settings
    def _site(self, meta: Mapping[str, Any]) -> CWTSite:
        """The site for the task's settings (built, reconfigured or reused)."""
        cfg = CWTConfig.from_dict(meta.get("cwt_config"))
        mcfg = site_model_config(meta.get("model_config") or {})
        classes = list(meta["classes"]) if meta.get("classes") else None
        site = self.site
        fits = (
            site is not None
            and site.config.task == cfg.task
            and site_model_config(site.model_config) == mcfg
            and (classes is None or site.classes == classes)
        )
        if fits:
            if site.config != cfg:
                site.configure(cfg)
                self._warn(site)
            return site
        if self.data is None:
            raise ConfigError(
                f"site {self.name}: built for other settings (task, network or classes) than the server "
                "sends; build it with the run's settings"
            )
        self.site = CWTSite(self.data, cfg, mcfg, classes=classes, device=self.device, num_workers=self.num_workers)
        self._warn(self.site)
        return self.site

    def _warn(self, site: CWTSite) -> None:
        for w in site.warnings:
            self.warning(w)

    def _load(self, site: CWTSite, weights: Mapping[str, Any]) -> torch.nn.Module:
        key = (site.model_config, len(site.classes))
        if self._model is None or key != self._model_key:
            self._model = build_model(site.model_config, len(site.classes)).to(site.device)
            self._model_key = key
        self._model.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in weights.items()}, strict=True)
        return self._model

    # --------------------------------------------------------------- tasks
    def handle(self, task: str, params: Mapping[str, Any], meta: Mapping[str, Any]) -> Message:
        """Answer one task.

        Args:
            task: ``counts``, ``train`` or ``validate``.
            params: the travelling model (and Adam's state) for ``train`` and ``validate``.
            meta: the run's settings and the task's (cycle, position, steps, lr, iteration, split).
        """
        site = self._site(meta)
        if task == COUNTS_TASK:
            return {}, {"counts": site.counts()}
        if task == TRAIN_TASK:
            return self._train(site, params, meta)
        if task == VALIDATE_TASK:
            split = str(meta.get("split", "val"))
            model = self._load(site, split_params(params)[0])
            result = site.evaluate(model, split)
            metrics = {**eval_summary(result), "split": split, "cycle": meta.get("cycle")}
            if meta.get("counts") is not None:  # the final test evaluation, pooled per class at the server
                labels = np.where(result.mask > 0, result.y_true, np.nan)
                groups = memberships(site.tables[split])  # the evaluation loader keeps the table's order
                metrics["counts"] = count_classes(result.scores, labels, site.classes, meta["counts"], groups=groups)
            return {}, {"metrics": metrics}
        raise ValueError(f"site {self.name}: unknown task {task!r}")

    def _train(self, site: CWTSite, params: Mapping[str, Any], meta: Mapping[str, Any]) -> Message:
        weights, opt_in = split_params(params)
        model = self._load(site, weights)
        received = params_digest(to_numpy(model.state_dict()))
        cfg = site.config
        visit = Visit(steps=int(meta["steps"]), lr=float(meta["lr"]), iteration=int(meta.get("iteration", 0)))
        optimizer = adam(model, visit.lr, cfg.weight_decay)
        if cfg.optimizer_state == "travel" and opt_in:
            load_optimizer_arrays(optimizer, opt_in)
        metrics = site.train_visit(model, optimizer, visit, int(meta.get("cycle", 0)))
        out = to_numpy(model.state_dict())
        metrics.update(
            position=int(meta.get("position", 0)), received_digest=received, returned_digest=params_digest(out)
        )
        if cfg.optimizer_state == "travel":
            out.update(optimizer_arrays(optimizer))
        return out, {"metrics": metrics}

    # ------------------------------------------------------------- logging
    def describe(self, task: str, meta: Mapping[str, Any], answer: Mapping[str, Any]) -> str | None:
        """The operator's line: counts sent, one line per visit, one per validation.

        Args:
            task: the task answered.
            meta: what the server sent.
            answer: the answer's meta.
        """
        m = answer.get("metrics") or {}
        if task == COUNTS_TASK:
            return f"site {self.name}: sending counts {answer.get('counts')}"
        if task == TRAIN_TASK:
            return (
                f"site {self.name} cycle {m.get('cycle')} visit {int(m.get('position', 0)) + 1}: "
                f"{m.get('steps')} steps at lr {m.get('lr', 0):.3g} (iteration {m.get('iteration')}), "
                f"train_loss {_num(m.get('train_loss'))}, time {m.get('seconds', 0):.1f}s"
            )
        if task == VALIDATE_TASK:
            return (
                f"site {self.name} {m.get('split')}: loss {_num(m.get('loss'))} accuracy {_num(m.get('accuracy'))} "
                f"mean AUROC {_num(m.get('mean_auroc'))}"
            )
        return None

    def scalars(self, task: str, answer: Mapping[str, Any]) -> tuple[dict[str, float], int] | None:
        """Training loss per visit and validation loss and AUROC (mean, and ``val_auroc/<class>``) per
        cycle, stepped by cycle.

        Args:
            task: the task answered.
            answer: the answer's meta.
        """
        m = answer.get("metrics") or {}
        if task == TRAIN_TASK:
            return {"train_loss": m.get("train_loss"), "lr": m.get("lr")}, int(m.get("cycle") or 0)
        if task == VALIDATE_TASK and m.get("split") == "val":
            per_class = {f"val_auroc/{c}": v for c, v in (m.get("auroc") or {}).items() if v is not None}
            return {"val_loss": m.get("loss"), "val_auroc": m.get("mean_auroc"), **per_class}, int(m.get("cycle") or 0)
        return None
