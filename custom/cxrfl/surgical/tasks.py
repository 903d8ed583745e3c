"""What the surgical server sends the sites: the settings every task carries and each site's part of a model.

:class:`cxrfl.surgical.server.SurgicalServer` builds every warm-up, training and validation message with
:class:`SiteTasks`; :class:`cxrfl.surgical.host.SurgicalSiteHost` reads them. A site receives the
feature extractor and only the head rows of its own classes (:func:`cxrfl.surgical.head_modes.payload_for`),
never a name of another site's classes.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from cxrfl.common.transport import Message
from cxrfl.nn.models import ModelConfig
from cxrfl.surgical.config import SurgicalConfig
from cxrfl.surgical.head_modes import payload_for
from cxrfl.surgical.state import RunState


class SiteTasks:
    """The sites' task messages of one run.

    Args:
        config: the run's settings.
        bn_keys: the model's BatchNorm keys (kept at the sites with ``fedbn``: never sent).
    """

    def __init__(self, config: SurgicalConfig, bn_keys: Collection[str]) -> None:
        self.config = config
        self.site_model = ModelConfig.from_dict({**config.model_config.to_dict(), "pretrained": None})
        self.bn_keys = bn_keys

    def task_meta(self, run_key: str, **extra: Any) -> dict[str, Any]:
        """The settings every task carries, plus ``extra``.

        Args:
            run_key: the run key (names the sites' state).
            extra: task-specific entries.
        """
        cfg = self.config
        return {
            "model_config": self.site_model.to_dict(),
            "train_config": cfg.train_config.to_dict(),
            "batchnorm": cfg.batchnorm,
            "head_mode": cfg.head_mode,
            "missing": cfg.missing,
            "selection": cfg.selection,
            "run_key": run_key,
            **extra,
        }

    def messages(self, state: RunState, params: Mapping[str, Any], **extra: Any) -> dict[str, Message]:
        """One message per site of the run: its part of ``params`` and the task meta.

        Args:
            state: the run.
            params: a global model.
            extra: task-specific meta (``round``, ``split``, ``model_round`` ...).
        """
        exclude = self.bn_keys if self.config.batchnorm == "fedbn" else ()
        best = state.stopper.best_step
        out = {}
        for site, own in state.announced.items():
            sent, classes = payload_for(params, state.classes, own, head_mode=self.config.head_mode, exclude=exclude)
            out[site] = (
                sent,
                self.task_meta(state.run_key, classes=classes, keep_rounds=[] if best is None else [best], **extra),
            )
        return out
