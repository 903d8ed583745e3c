"""FedFew's stage results on disk: what each finished stage writes, and how a resumed run reads them back.

A folder of stage results (``fedfew/`` in the server's app folder, and the run's resume folder
``cxrfl_resume/<run id>/``) holds up to three files:

- :data:`STAGE_FILES` [1] ``stage1_ssl.pt``: the SimSiam weights after stage 1;
- [2] ``stage2_model.pt``: the stage-2 network (a cxrfl checkpoint) with its margins;
- [3] ``stage3.json``: threshold, its statistics, prototypes, refusals.

:func:`load_stages` finds the latest finished stage of such a folder (stage 3 counts only with
stage 2's file) and refuses results of other model settings or other CCs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cxrfl.common.io import atomic_write, json_default, to_numpy, torch_load, torch_save
from cxrfl.common.server import RunStopped
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.nn.models import ModelConfig, load_checkpoint, save_checkpoint

STAGE_DIR = "fedfew"
"""Sub-folder of the output folder with the stage results."""
STAGE_FILES = {1: "stage1_ssl.pt", 2: "stage2_model.pt", 3: "stage3.json"}
STAGE1_FORMAT = "cxrfl-fedfew-stage1-v1"


def _tensors(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(np.asarray(v)) for k, v in state.items()}


def write_stage1(
    path: Path, ssl_state: Mapping[str, Any], site_config: ModelConfig, config: FedFewConfig, contributed: bool
) -> Path:
    """Stage 1's file.

    Args:
        path: the file.
        ssl_state: the SimSiam weights.
        site_config: the network settings the sites trained with (``pretrained`` unset).
        config: the FedFew settings.
        contributed: whether any round was aggregated (else the weights are the initial ones).
    """
    return torch_save(
        path,
        {
            "format": STAGE1_FORMAT,
            "ssl_state": _tensors(ssl_state),
            "model_config": site_config.to_dict(),
            "fedfew_config": config.to_dict(),
            "contributed": contributed,
        },
    )


def write_stage2(
    path: Path,
    state: Mapping[str, Any],
    *,
    classes: Sequence[str],
    model_config: ModelConfig,
    cc_classes: Sequence[str],
    margins: Mapping[str, Any],
    rounds: int,
    config: FedFewConfig,
) -> Path:
    """Stage 2's file: a cxrfl checkpoint with the CCs and margins.

    Args:
        path: the file.
        state: the network's weights.
        classes: its outputs (the CCs, then "no CC").
        model_config: the network settings.
        cc_classes: the CCs.
        margins: the energy margins used (and how they were chosen).
        rounds: warm-up plus energy rounds run.
        config: the FedFew settings.
    """
    save_checkpoint(
        path,
        _tensors(state),
        classes=list(classes),
        model_config=model_config,
        extra={
            "fedfew_stage2": {"cc_classes": list(cc_classes), "margins": dict(margins), "rounds": rounds},
            "fedfew_config": config.to_dict(),
        },
    )
    return path


def write_stage3(path: Path, result: Mapping[str, Any]) -> Path:
    """Stage 3's file (JSON).

    Args:
        path: the file.
        result: threshold, its statistics, prototypes, refusals.
    """
    text = json.dumps(dict(result), default=json_default)
    return atomic_write(path, lambda f: f.write(text), mode="w")


def finished_stages(folder: Path) -> tuple[int, set[int]]:
    """The latest stage a folder's files let a run skip, and the stages whose files are there.

    Args:
        folder: a folder of stage results.
    """
    have = {k for k, name in STAGE_FILES.items() if (folder / name).is_file()}
    done = 3 if {2, 3} <= have else 2 if 2 in have else 1 if 1 in have else 0
    return done, have


def _same_model(path: Path, saved: Mapping[str, Any], site_config: ModelConfig) -> None:
    found = ModelConfig.from_dict({**saved, "pretrained": None})
    if found != site_config:
        raise RunStopped(
            f"resume: {path} was trained with model settings {found.to_dict()}, this run has "
            f"{site_config.to_dict()}; remove resume_from or match the settings"
        )


def load_stages(folder: Path, done: int, site_config: ModelConfig, cc_classes: Sequence[str]) -> dict[str, Any]:
    """The results of stages 1..``done`` of a folder, checked against this run.

    Args:
        folder: the folder of stage results.
        done: the latest finished stage (:func:`finished_stages`), 1 to 3.
        site_config: this run's network settings (``pretrained`` unset).
        cc_classes: this run's CCs.

    Returns:
        ``ssl_state`` (done = 1), ``model_state`` and ``margins`` (done >= 2), ``stage3`` (done = 3).

    Raises:
        RunStopped: a file of other model settings, other CCs, or not a stage file.
        ConfigError: a stage file that cannot be read.
    """
    data: dict[str, Any] = {}
    if done >= 2:
        path = folder / STAGE_FILES[2]
        ckpt = load_checkpoint(path)
        _same_model(path, ckpt["model_config"], site_config)
        saved_cc = list(ckpt.get("fedfew_stage2", {}).get("cc_classes", ckpt["classes"][:-1]))
        if saved_cc != list(cc_classes):
            raise RunStopped(
                f"resume: {path} predicts the CCs {saved_cc}, the sites now give {list(cc_classes)}; "
                "the stage-2 model cannot be reused"
            )
        data["model_state"] = to_numpy(ckpt["model"])
        data["margins"] = dict(ckpt.get("fedfew_stage2", {}).get("margins", {}))
    if done == 3:
        data["stage3"] = json.loads((folder / STAGE_FILES[3]).read_text())
    if done == 1:
        path = folder / STAGE_FILES[1]
        obj = torch_load(path, "FedFew stage-1 file", "delete it (stage 1 then runs again) or remove resume_from")
        if not isinstance(obj, dict) or obj.get("format") != STAGE1_FORMAT:
            raise RunStopped(f"resume: {path} is not a FedFew stage-1 file")
        _same_model(path, obj["model_config"], site_config)
        data["ssl_state"] = to_numpy(obj["ssl_state"])
    return data
