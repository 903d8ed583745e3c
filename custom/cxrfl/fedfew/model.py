"""The final FedFew model file and inference with it.

The file is an ordinary cxrfl checkpoint (:func:`cxrfl.nn.models.save_checkpoint`): ``model`` is
the stage-2 network (encoder + head over the CCs and the extra "no CC" output), ``classes``
names its outputs, ``model_config`` its architecture; so :func:`cxrfl.nn.models.model_from_checkpoint`
and every tool that reads checkpoints work unchanged. The extra key ``fedfew`` holds the rest::

    {"version": 1,
     "cc_classes": [...], "no_cc_class": "No common class", "uc_classes": [...],
     "temperature": 1.0, "energy_outputs": "all", "threshold": -2.31,
     "detector": "paper",
     "prototypes": {uc: [{"positive": Tensor[D], "negative": Tensor[D],
                          "n_positive": 14, "n_negative": 140, "source": 0}, ...]},
     "margins": {"m_in": ..., "m_out": ..., "chosen": "config" | "warm-up"},
     "threshold_stats": {...}, "min_prototype_images": 10}

With ``"detector": "scorer"`` the UCs' detectors are under ``scorers`` instead:
``{uc: [{"weights": Tensor[D], "bias": ..., "threshold": ..., "n_positive": ..., "n_negative": ...,
"cv_balanced_accuracy": ..., "source": 0}, ...]}`` (:mod:`cxrfl.fedfew.scorer`). A file without
``detector`` (written before scorers existed) holds prototypes. Detectors carry an anonymous
``source`` index, not a site name.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cxrfl.errors import ConfigError
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.detectors import PAYLOAD_KEYS, Detector, parse_detectors, predict
from cxrfl.fedfew.energy import joint_energy
from cxrfl.fedfew.learner import NO_CC, stage2_classes
from cxrfl.nn.models import CXRNet, ModelConfig, load_checkpoint, model_from_checkpoint, save_checkpoint

FEDFEW_KEY = "fedfew"
ARTIFACT_VERSION = 1


def _stored(d: Detector) -> dict[str, Any]:
    """A detector as stored: its vectors as tensors (the checkpoint is read with
    ``torch.load(weights_only=True)``), without the UC (the key it is stored under)."""
    out = {
        k: torch.as_tensor(np.asarray(v, np.float32)) if isinstance(v, list) else v for k, v in d.to_payload().items()
    }
    out.pop("uc")
    return out


def fedfew_extra(
    *,
    cc_classes: list[str],
    threshold: float,
    temperature: float,
    energy_outputs: str,
    detector: str,
    detectors: Mapping[str, list[Detector]],
    margins: Mapping[str, Any] | None = None,
    threshold_stats: Mapping[str, Any] | None = None,
    min_prototype_images: int | None = None,
) -> dict[str, Any]:
    """The ``fedfew`` entry of the final checkpoint (pass as ``extra`` to ``save_checkpoint``).

    Args:
        cc_classes: the CCs in output order (the last output is "no CC").
        threshold: the energy threshold.
        temperature: T of the energy.
        energy_outputs: ``all`` or ``cc`` (see :data:`cxrfl.fedfew.config.ENERGY_OUTPUTS`).
        detector: ``paper`` or ``scorer`` (:data:`cxrfl.fedfew.config.DETECTORS`).
        detectors: UC -> its detectors (UCs without any are left out).
        margins: the stage-2 margins and how they were chosen.
        threshold_stats: accuracy etc. of the threshold on the training examples.
        min_prototype_images: the minimum the detectors were computed under.
    """
    stored = {uc: [_stored(d) for d in ds] for uc, ds in detectors.items() if ds}
    return {
        FEDFEW_KEY: {
            "version": ARTIFACT_VERSION,
            "cc_classes": list(cc_classes),
            "no_cc_class": NO_CC,
            "uc_classes": sorted(stored),
            "temperature": float(temperature),
            "energy_outputs": energy_outputs,
            "threshold": float(threshold),
            "detector": detector,
            PAYLOAD_KEYS[detector]: stored,
            "margins": dict(margins or {}),
            "threshold_stats": dict(threshold_stats or {}),
            "min_prototype_images": min_prototype_images,
        }
    }


def save_fedfew_model(
    path: Path,
    model_state: Mapping[str, np.ndarray],
    cc_classes: list[str],
    stage3: Mapping[str, Any],
    detectors: Mapping[str, list[Detector]],
    *,
    margins: Mapping[str, Any],
    config: FedFewConfig,
    model_config: ModelConfig,
) -> Path:
    """Write the final FedFew model file (an ordinary cxrfl checkpoint with its ``fedfew`` entry).

    Args:
        path: the file.
        model_state: the stage-2 network's weights.
        cc_classes: the CCs in output order.
        stage3: stage 3's result (``threshold``, ``threshold_stats``).
        detectors: UC -> its detectors.
        margins: the stage-2 margins and how they were chosen.
        config: the run's settings.
        model_config: the network settings.
    """
    extra = fedfew_extra(
        cc_classes=cc_classes,
        threshold=stage3["threshold"],
        temperature=config.temperature,
        energy_outputs=config.energy_outputs,
        detector=config.detector,
        detectors=dict(detectors),
        margins=dict(margins),
        threshold_stats=stage3["threshold_stats"],
        min_prototype_images=config.min_prototype_images,
    )
    save_checkpoint(
        path,
        {k: torch.as_tensor(np.asarray(v)) for k, v in model_state.items()},
        classes=stage2_classes(cc_classes),
        model_config=model_config,
        extra={**extra, "method": "fedfew", "fedfew_config": config.to_dict()},
    )
    return path


def _plain(d: Mapping[str, Any]) -> dict[str, Any]:
    """A stored detector with its tensors as lists (what ``from_payload`` reads)."""
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in d.items()}


class FedFewModel:
    """A FedFew model ready for inference.

    Args:
        net: the stage-2 network (outputs: the CCs, then "no CC").
        info: the checkpoint's ``fedfew`` entry.
        where: the file, for messages.
    """

    def __init__(self, net: CXRNet, info: Mapping[str, Any], where: str = "the checkpoint") -> None:
        self.net = net
        try:
            self.cc_classes = [str(c) for c in info["cc_classes"]]
            self.threshold = float(info["threshold"])
            self.temperature = float(info.get("temperature", 1.0))
            self.energy_outputs = str(info.get("energy_outputs", "all"))
            self.detector = str(info.get("detector", "paper"))
            stored = dict(info.get(PAYLOAD_KEYS[self.detector]) or {})
            self.detectors = parse_detectors(
                self.detector, [{**_plain(d), "uc": uc} for uc, ds in stored.items() for d in ds]
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: malformed FedFew entry ({type(exc).__name__}: {exc})") from exc
        if net.num_classes != len(self.cc_classes) + 1:
            raise ConfigError(
                f"{where}: the network has {net.num_classes} outputs, the FedFew entry names "
                f"{len(self.cc_classes)} CCs + 'no CC'"
            )
        if self.energy_outputs not in ("all", "cc"):
            raise ConfigError(f"{where}: unknown energy_outputs {self.energy_outputs!r}")
        self.uc_classes = sorted(self.detectors)

    @classmethod
    def from_checkpoint(cls, path: str | Path, map_location: str | torch.device = "cpu") -> FedFewModel | None:
        """The FedFew model of a checkpoint, or None when the checkpoint holds no FedFew entry.

        Args:
            path: a checkpoint file.
            map_location: where tensors are loaded.
        """
        ckpt = load_checkpoint(path, map_location)
        info = ckpt.get(FEDFEW_KEY)
        if info is None:
            return None
        if not isinstance(info, Mapping):
            raise ConfigError(f"{path}: the '{FEDFEW_KEY}' entry is not a mapping")
        net, _, _ = model_from_checkpoint(path, map_location)
        return cls(net, info, str(path))

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> dict[str, Any]:
        """CC probabilities, energies and UC decisions for a batch of preprocessed images.

        Args:
            x: [B, C, H, W] images (``build_transforms(..., train=False)``).

        Returns:
            ``cc_probabilities`` [B, K], ``energy`` [B], ``flagged`` [B] (energy above the
            threshold), ``uc``: UC -> ``positive`` [B] bool, ``score`` [B] (the detection score),
            ``votes`` [B], ``pairs``, ``margin`` [B] (:func:`cxrfl.fedfew.detectors.predict`).
        """
        self.net.eval()
        feats = self.net.features(x)
        logits = self.net.classifier(self.net.dropout(self.net.hidden(feats))).float()
        k = len(self.cc_classes)
        outputs = logits if self.energy_outputs == "all" else logits[:, :k]
        energy = joint_energy(outputs, self.temperature).cpu().numpy()
        f = feats.float().cpu().numpy()
        uc = predict(self.detector, f, energy, self.threshold, self.detectors) if self.detectors else {}
        return {
            "cc_probabilities": torch.sigmoid(logits[:, :k]).cpu().numpy(),
            "energy": energy,
            "flagged": energy > self.threshold,
            "uc": uc,
        }
