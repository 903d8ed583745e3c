"""NVFlare glue of the evaluation-only federation: the controller (sites run the training jobs' executor).

The loop is :class:`cxrfl.fedeval.server.FedEvalServer`; this module finds the model and carries
the loop's messages over NVFlare (:class:`cxrfl.fl.base.TaskController`). Sites answer with
:class:`cxrfl.fl.surgical.SurgicalExecutor`, the executor every surgical-aggregation job deploys.

The model is a plain file name, never a path: the file shipped in the job's server app
(``job.py --model FILE`` puts it in ``app_server/config``), else one in the folder the server's
operator names with ``CXRFL_MODEL_ROOT`` (for models too large to ship). A job can name no other file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from cxrfl.common.io import plain_name
from cxrfl.common.server import ServerLoop
from cxrfl.errors import ConfigError
from cxrfl.fedeval.config import FedEvalConfig
from cxrfl.fedeval.server import FedEvalServer
from cxrfl.fl.base import TaskController
from cxrfl.nn.models import load_checkpoint

MODEL_ROOT_ENV = "CXRFL_MODEL_ROOT"
"""Environment variable of the server's process naming a folder of models a job may evaluate by name."""


class FederatedEvaluation(TaskController):
    """Scores a trained model at every site from binned score counts; nothing is trained.

    Args:
        model: the checkpoint's file name (see the module docstring).
        fedeval_config: :class:`cxrfl.fedeval.config.FedEvalConfig` fields (split, min_cell, bins ...).
        task_timeout: seconds a site may take per task (0: no limit).
        analytic_sender_id: the server's analytics writer ("": none; an evaluation tracks nothing).
    """

    def __init__(
        self, *, model: str, fedeval_config: dict | None = None, task_timeout: int = 0, analytic_sender_id: str = ""
    ) -> None:
        super().__init__(task_timeout=task_timeout, analytic_sender_id=analytic_sender_id)
        self.model = plain_name(
            model,
            "model",
            "give the checkpoint's file name: ship it with the job "
            "(job.py --model FILE) or place it in the folder $CXRFL_MODEL_ROOT names",
        )
        self.config = FedEvalConfig.from_dict(fedeval_config, where="the FederatedEvaluation arguments")

    @property
    def discloses_class_names(self) -> bool:
        """Each site receives the rows of its own classes only."""
        return False

    def model_path(self) -> Path:
        """The checkpoint: in the job's server app, else in ``$CXRFL_MODEL_ROOT``.

        Raises:
            ConfigError: in neither.
        """
        app = Path(self.get_app_dir())
        candidates = [app / "config" / self.model, app / "custom" / self.model]
        if os.environ.get(MODEL_ROOT_ENV):
            candidates.append(Path(os.environ[MODEL_ROOT_ENV]) / self.model)
        for path in candidates:
            if path.is_file():
                return path
        raise ConfigError(
            f"model {self.model!r} is neither in the job's server app nor in ${MODEL_ROOT_ENV} "
            f"({os.environ.get(MODEL_ROOT_ENV) or 'not set'}): export the job with "
            "job.py --model FILE, or ask the server's operator to place it there"
        )

    def make_server(self, **common: Any) -> ServerLoop:
        common.pop("resume_root", None)  # nothing to resume
        return FedEvalServer(config=self.config, checkpoint=load_checkpoint(self.model_path()), **common)
