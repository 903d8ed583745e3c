"""NVFlare glue of FedFew: the three-stage workflow as a job, and the site executor.

The workflow is :class:`cxrfl.fedfew.server.FedFewServer` (stage planning, FedAvg, margins,
threshold, prototypes, resumable stage results, the final self-describing model), run by
:class:`cxrfl.fl.base.TaskController` over NVFlare; a site answers through
:class:`cxrfl.fedfew.protocol.SiteHost`, run by :class:`cxrfl.fl.base.TaskExecutor`. A site whose
task fails or times out is left out of that task with a warning; the run stops (``panic``) only
when nothing is left to go on with, with the reason.

Tasks: see :mod:`cxrfl.fedfew.protocol`. Written to the server's app folder: see
:mod:`cxrfl.fedfew.server` (``fedfew/stage*``, ``FL_global_model.pt``, ``cxrfl/*.jsonl|json``).

Resuming a stopped run: submit the job again with ``resume_from`` set to the interrupted job's
id (its finished stages are kept in ``<server workspace>/cxrfl_resume/<job id>/``) or to a folder
of stage files (absolute path); finished stages are loaded, not run again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from cxrfl.data.site import SiteData
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.protocol import SiteHost
from cxrfl.fedfew.server import FedFewServer
from cxrfl.fl.base import TaskController, TaskExecutor
from cxrfl.nn.models import ModelConfig


class FedFew(TaskController):
    """The FedFew workflow: self-supervised pretraining, energy-based CC training, threshold and prototypes.

    Args:
        fedfew_config: :class:`cxrfl.fedfew.config.FedFewConfig` fields (sent to the sites).
        model_config: :class:`cxrfl.nn.models.ModelConfig` fields (``pretrained`` is read here, on
            the server, for the initial encoder only).
        min_clients: fewest valid site results that make a round; fewer keep the previous weights.
        task_timeout: seconds a site may take per task (0: no limit).
        resume_from: go on from an interrupted run: its job id on this server, or a folder of stage
            files; None: run every stage.
        resume: deprecated alias of ``resume_from`` (a folder, relative paths against the new app
            folder); removed in the next release.
        evaluate_test: evaluate the final model on every site's test split.
    """

    def __init__(self, *, fedfew_config: dict | None = None, model_config: dict | None = None, min_clients: int = 1,
                 task_timeout: int = 0, resume_from: str | None = None, resume: str | None = None,
                 evaluate_test: bool = True) -> None:
        super().__init__(task_timeout=task_timeout)
        if isinstance(min_clients, bool) or not isinstance(min_clients, int) or min_clients < 1:
            raise ValueError(f"min_clients must be an integer >= 1, got {min_clients!r}")
        if resume_from and resume:
            raise ValueError("give resume_from only (resume is its deprecated alias)")
        self.config = FedFewConfig.from_dict(fedfew_config)
        self.model_config = ModelConfig.from_dict(model_config or {})
        self.min_clients = min_clients
        self.resume_from = resume_from
        self.resume = resume
        self.evaluate_test = evaluate_test

    def make_server(self, **common: Any) -> FedFewServer:
        resume_from = self.resume_from
        if self.resume:
            common["warning"](f"FedFew: 'resume' is deprecated and will be removed in the next release; "
                              f"use resume_from (the interrupted job's id, or a folder of stage files) instead of "
                              f"resume={self.resume!r}")
            path = Path(self.resume).expanduser()
            resume_from = str(path if path.is_absolute() else (Path(common["out_dir"]) / path).resolve())
        return FedFewServer(config=self.config, model_config=self.model_config, min_clients=self.min_clients,
                            resume_from=resume_from, evaluate_test=self.evaluate_test, **common)


class FedFewExecutor(TaskExecutor):
    """A FedFew site: answers the tasks of :data:`cxrfl.fedfew.protocol.TASKS` with its own data.

    Finds and checks the site's data at start like every cxrfl executor (:class:`cxrfl.fl.base.TaskExecutor`);
    the settings of every task come from the server.
    """

    def make_host(self, data: SiteData, device: torch.device, state_root: Path) -> SiteHost:
        return SiteHost(data, device, self.num_workers)
