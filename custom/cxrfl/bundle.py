"""A trained global model as a MONAI bundle (``cxrfl export bundle --model CKPT --out DIR``).

Layout (the MONAI Bundle specification)::

    DIR/configs/metadata.json    network_data_format: the input image and the output ``pred``, one
                                 sigmoid probability per class, ``channel_def`` naming them in order
    DIR/configs/inference.json   network_def (cxrfl.nn.models.CXRNet by _target_), preprocessing
                                 (cxrfl's own: build_transforms, so PNG/JPEG/DICOM read as cxrfl
                                 reads them), inferer, postprocessing (sigmoid), and a run over a
                                 folder of images that writes predictions.csv
    DIR/models/model.pt          the network's state_dict
    DIR/docs/README.md           the model card: classes, the training run's settings, its evaluation

Run it with MONAI's own entry point (the cxrfl package must be importable)::

    python -m monai.bundle run --config_file DIR/configs/inference.json --bundle_root DIR \\
        --dataset_dir IMAGES [--output_dir OUT]

``OUT/predictions.csv`` (default ``DIR/eval``) holds one row per image: its path, then the
probabilities in ``channel_def`` order, equal to ``cxrfl predict --precision fp32``'s. The
network, preprocessing and postprocessing also load through ``monai.bundle.ConfigParser``
(``network_def``, ``preprocessing``, ``postprocessing``: a dict with ``image`` -> a model input).
"""

from __future__ import annotations

import json
import math
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import monai
import numpy as np
import torch

import cxrfl
from cxrfl.clinical.fitted import ClinicalFit
from cxrfl.common.io import atomic_write, torch_save, write_json
from cxrfl.errors import ConfigError
from cxrfl.nn.models import ModelConfig, load_checkpoint, model_from_checkpoint

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".dcm", ".dicom")
"""Files of the dataset folder the bundle predicts."""

SCHEMA = "https://github.com/Project-MONAI/MONAI-extra-test-data/releases/download/0.8.1/meta_schema_20220324.json"

BUNDLE_VERSION = "0.1.0"


def export_bundle(model_path: str | Path, out: str | Path, *, name: str | None = None) -> Path:
    """Write the MONAI bundle of a cxrfl checkpoint.

    Args:
        model_path: a checkpoint written by a cxrfl job (``best_FL_global_model.pt`` ...).
        out: the bundle folder (created; files in it are replaced).
        name: the model's name in the metadata (default: the checkpoint's file name).

    Returns:
        the bundle folder.

    Raises:
        ConfigError: not a cxrfl checkpoint, or a FedFew model (its outputs are not one sigmoid
            probability per class).
    """
    model_path, out = Path(model_path), Path(out)
    if load_checkpoint(model_path).get("fedfew") is not None:
        raise ConfigError(
            f"{model_path} is a FedFew model (energy threshold and prototypes, not one sigmoid per "
            "class): a MONAI bundle covers surgical aggregation, its baselines and CWT models"
        )
    model, classes, config = model_from_checkpoint(model_path)
    fit = ClinicalFit.from_checkpoint(load_checkpoint(model_path), str(model_path))
    run = run_records(model_path)
    torch_save(out / "models" / "model.pt", model.state_dict())
    meta = metadata(classes, config, name or model_path.stem, run)
    if fit is not None:
        meta["cxrfl_clinical"] = fit.to_dict()  # maps, thresholds and what they were fitted on (no site named)
    write_json(out / "configs" / "metadata.json", meta)
    write_json(out / "configs" / "inference.json", inference_config(classes, config, fit))
    card = model_card(classes, config, name or model_path.stem, model_path, run) + clinical_card(classes, fit)
    atomic_write(out / "docs" / "README.md", lambda f: f.write(card), mode="w")
    return out


def run_records(model_path: Path) -> dict[str, Any]:
    """The settings and evaluation of the run that wrote a checkpoint, where its folder has them.

    Args:
        model_path: the checkpoint (in the server's app folder, or under its ``cxrfl/checkpoints``).

    Returns:
        ``run_config`` and ``evaluation`` (each None when absent).
    """
    for folder in list(model_path.resolve().parents)[:3]:
        records = folder / "cxrfl"
        if (records / "run_config.json").is_file() or (records / "evaluation.json").is_file():
            return {
                key: json.loads((records / f"{key}.json").read_text()) if (records / f"{key}.json").is_file() else None
                for key in ("run_config", "evaluation")
            }
    return {"run_config": None, "evaluation": None}


def evaluation_summary(evaluation: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What a model card may say about a run's test evaluation: per class, the mean AUROC over the
    sites that have the class; over the sites, the mean and SD of their mean AUROC. No site is
    named and no site's own classes are listed (a card travels to every site).

    Args:
        evaluation: the run's ``cxrfl/evaluation.json`` (None: none).
    """
    if not evaluation or not evaluation.get("sites"):
        return None
    per_class: dict[str, list[float]] = {}
    site_means = []
    for site in evaluation["sites"].values():
        for c, v in (site.get("auroc") or {}).items():
            if v is not None and math.isfinite(v):
                per_class.setdefault(c, []).append(float(v))
        if site.get("mean_auroc") is not None and math.isfinite(site["mean_auroc"]):
            site_means.append(float(site["mean_auroc"]))
    return {
        "sites": len(evaluation["sites"]),
        "selected_round": evaluation.get("best_round"),
        "mean_site_auroc": float(np.mean(site_means)) if site_means else None,
        "sd_site_auroc": float(np.std(site_means)) if site_means else None,
        "class_auroc": {c: float(np.mean(v)) for c, v in sorted(per_class.items())},
    }


def metadata(classes: list[str], config: ModelConfig, name: str, run: Mapping[str, Any]) -> dict[str, Any]:
    """``configs/metadata.json``.

    Args:
        classes: output classes, in order.
        config: the network settings.
        name: the model's name.
        run: :func:`run_records`.
    """
    summary = evaluation_summary(run.get("evaluation"))
    return {
        "schema": SCHEMA,
        "version": BUNDLE_VERSION,
        "changelog": {BUNDLE_VERSION: f"exported by cxrfl {cxrfl.__version__}"},
        "monai_version": monai.__version__,
        "pytorch_version": torch.__version__.split("+")[0],
        "numpy_version": np.__version__,
        "required_packages_version": {"cxrfl": cxrfl.__version__},
        "name": name,
        "task": "Multi-label classification of chest X-ray findings",
        "description": f"{config.arch} (torchvision DenseNet) trained by federated learning (cxrfl) across sites "
        f"whose label sets differ; one sigmoid probability for each of {len(classes)} findings",
        "authors": "cxrfl",
        "copyright": "see the training sites' data licences",
        "intended_use": "research only; not for clinical decisions",
        "data_type": "png, jpeg or dicom",
        "image_classes": "a frontal chest X-ray (one gray channel; colour images are converted to gray)",
        "label_classes": ", ".join(classes),
        "pred_classes": "one sigmoid probability per finding, in channel_def order",
        "eval_metrics": {"mean_test_auroc": summary["mean_site_auroc"]} if summary else {},
        "network_data_format": {
            "inputs": {
                "image": {
                    "type": "image",
                    "format": "magnitude",
                    "modality": "xray",
                    "num_channels": config.in_channels,
                    "spatial_shape": [config.image_size, config.image_size],
                    "dtype": "float32",
                    "value_range": [],
                    "is_patch_data": False,
                    "channel_def": {str(i): "image" for i in range(config.in_channels)},
                }
            },
            "outputs": {
                "pred": {
                    "type": "probabilities",
                    "format": "classes",
                    "num_channels": len(classes),
                    "spatial_shape": [1, len(classes)],
                    "dtype": "float32",
                    "value_range": [0, 1],
                    "is_patch_data": False,
                    "channel_def": {str(i): c for i, c in enumerate(classes)},
                }
            },
        },
    }


def _preprocessing(config: ModelConfig) -> dict[str, Any]:
    """The bundle's preprocessing: keep the file name, then read the image as ``cxrfl predict`` does."""
    return {
        "_target_": "Compose",
        "transforms": [
            {"_target_": "CopyItemsd", "keys": "@image", "names": "filename_or_obj"},
            {
                "_target_": "Lambdad",
                "keys": "@image",
                "func": f"$build_transforms({config.image_size}, train=False, in_channels={config.in_channels})",
            },
        ],
    }


def inference_config(classes: list[str], config: ModelConfig, fit: ClinicalFit | None = None) -> dict[str, Any]:
    """``configs/inference.json``: a MONAI bundle config that predicts a folder of images.

    Args:
        classes: output classes, in order.
        config: the network settings.
        fit: the checkpoint's calibration maps (postprocessing: :class:`CalibratedSigmoid`) and operating points.
    """
    return {
        "imports": [
            "$import glob",
            "$import os",
            "$import torch",
            "$from cxrfl.data.transforms import build_transforms",
        ],
        "bundle_root": ".",
        "dataset_dir": "$@bundle_root + '/data'",
        "output_dir": "$@bundle_root + '/eval'",
        "image": "image",
        "pred": "pred",
        "image_suffixes": list(IMAGE_SUFFIXES),
        "device": "$torch.device('cuda:0' if torch.cuda.is_available() else 'cpu')",
        "ckpt_path": "$@bundle_root + '/models/model.pt'",
        "classes": list(classes),
        "network_def": {
            "_target_": "cxrfl.nn.models.CXRNet",
            "config": {"_target_": "cxrfl.nn.models.ModelConfig", **{**config.to_dict(), "pretrained": None}},
            "num_classes": len(classes),
        },
        "network": "$@network_def.to(@device).eval()",
        "datalist": "$[{@image: f} for f in sorted(glob.glob(os.path.join(@dataset_dir, '*'))) "
        "if f.lower().endswith(tuple(@image_suffixes))]",
        "preprocessing": _preprocessing(config),
        "dataset": {"_target_": "Dataset", "data": "@datalist", "transform": "@preprocessing"},
        "dataloader": {
            "_target_": "DataLoader",
            "dataset": "@dataset",
            "batch_size": 1,
            "shuffle": False,
            "num_workers": 0,
        },
        "inferer": {"_target_": "SimpleInferer"},
        "postprocessing": _postprocessing(classes, fit),
        "saver": {
            "_target_": "CSVSaver",
            "output_dir": "@output_dir",
            "filename": "predictions.csv",
            "overwrite": True,
        },
        "initialize": [
            "$torch.set_grad_enabled(False)",
            "$@network.load_state_dict(torch.load(@ckpt_path, map_location=@device, weights_only=True))",
        ],
        "run": [
            "$[@saver.save_batch(@postprocessing(@inferer(batch[@image].to(@device), @network)), "
            "{'filename_or_obj': batch['filename_or_obj']}) for batch in @dataloader]"
        ],
        "finalize": ["$@saver.finalize()"],
    }


class CalibratedSigmoid:
    """MONAI postprocessing of a calibrated model: per channel ``sigmoid(slope * logit + intercept)``.

    Args:
        slopes: one per output channel (1: no map).
        intercepts: one per output channel (0: no map).
    """

    def __init__(self, slopes: Sequence[float], intercepts: Sequence[float]) -> None:
        self.slopes = torch.tensor(list(slopes), dtype=torch.float64)
        self.intercepts = torch.tensor(list(intercepts), dtype=torch.float64)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        z = logits.double() * self.slopes.to(logits.device) + self.intercepts.to(logits.device)
        return torch.sigmoid(z).float()


def _postprocessing(classes: list[str], fit: ClinicalFit | None) -> dict[str, Any]:
    """The sigmoid, calibrated per class where the checkpoint carries maps."""
    if fit is None or not fit.calibration:
        return {"_target_": "Activations", "sigmoid": True}
    maps = [fit.calibration.get(c) for c in classes]
    return {
        "_target_": "cxrfl.bundle.CalibratedSigmoid",
        "slopes": [m.slope if m else 1.0 for m in maps],
        "intercepts": [m.intercept if m else 0.0 for m in maps],
    }


def clinical_card(classes: list[str], fit: ClinicalFit | None) -> str:
    """The model card's section on calibration and operating points ("" without a fit).

    Args:
        classes: output classes, in order.
        fit: the checkpoint's fit.
    """
    if fit is None:
        return ""
    on = fit.fitted_on.get("classes", {})
    lines = [
        "",
        "## Calibration and operating points",
        "",
        f"Fitted by an evaluation-only federation on the sites' `{fit.fitted_on.get('split', '?')}` splits from "
        "binned score counts (no image or score left a site). `pred` holds calibrated probabilities; a finding is "
        "positive when its RAW probability reaches the threshold (`cxrfl predict` prints the decision, `--raw` the "
        "raw probabilities).",
        "",
        "| finding | map | threshold (raw / calibrated) | target | sensitivity / specificity reached [95% interval] "
        "| cases (+/-) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for c in classes:
        m, op, n = fit.calibration.get(c), fit.operating_points.get(c), on.get(c, {})
        if m is None and op is None:
            continue
        mapping = f"{m.kind}: sigmoid({m.slope:.3f} z {m.intercept:+.3f})" if m else "none"
        point = reached = goal = "-"
        if op:
            point = f"{op['threshold']:.4f} / {op['calibrated_threshold']:.4f}"
            reached = " / ".join(
                f"{op[k]:.3f}" + (" [{:.3f}, {:.3f}]".format(*op[f"{k}_interval"]) if f"{k}_interval" in op else "")
                for k in ("sensitivity", "specificity")
            )
            goal = f"{op['target']} {op['value'] if op['value'] is not None else ''}".strip()
            goal += " on new images" if op.get("rule") == "new_data" else ""
            goal += "" if op["met"] else " (not met)"
        cases = f"{n.get('positives', '?')} / {n.get('negatives', '?')}"
        lines.append(f"| {c} | {mapping} | {point} | {goal} | {reached} | {cases} |")
    return "\n".join(lines) + "\n"


def model_card(classes: list[str], config: ModelConfig, name: str, model_path: Path, run: Mapping[str, Any]) -> str:
    """``docs/README.md``: what the model predicts, how it was trained, how it did, how to run it.

    Args:
        classes: output classes, in order.
        config: the network settings.
        name: the model's name.
        model_path: the exported checkpoint.
        run: :func:`run_records`.
    """
    lines = [
        f"# {name}",
        "",
        "A chest X-ray multi-label classifier trained with cxrfl (federated learning across sites whose label "
        "sets differ), exported as a MONAI bundle. Research use only; not for clinical decisions.",
        "",
        "## Input and output",
        "",
        f"- Input: one PNG, JPEG or DICOM chest X-ray, read as cxrfl reads it (DICOM modality LUT and window, "
        f"MONOCHROME1 inverted, else the image's own range), resized to {config.image_size}x{config.image_size}, "
        f"{config.in_channels} channel(s), ImageNet-normalised (`cxrfl.data.transforms.build_transforms`).",
        f"- Output `pred`: {len(classes)} sigmoid probabilities, in this order:",
        "",
        "| channel | finding |",
        "| --- | --- |",
        *[f"| {i} | {c} |" for i, c in enumerate(classes)],
        "",
        "## Run",
        "",
        "```bash",
        "python -m monai.bundle run --config_file BUNDLE/configs/inference.json --bundle_root BUNDLE \\",
        "    --dataset_dir IMAGES --output_dir OUT",
        "```",
        "",
        "`OUT/predictions.csv`: one row per image (path, then the probabilities in channel order); the same as "
        "`cxrfl predict --precision fp32 --model CHECKPOINT IMAGES/*`. Needs `pip install cxrfl` (the network "
        "and the image reader).",
        "",
        "## Training",
        "",
        f"Exported from `{model_path.name}` with cxrfl {cxrfl.__version__} (Python {platform.python_version()}, "
        f"torch {torch.__version__}).",
        "",
    ]
    lines += _training_settings(run.get("run_config")) + _evaluation_lines(run.get("evaluation"))
    return "\n".join(lines)


def _num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def _training_settings(settings: Mapping[str, Any] | None) -> list[str]:
    """The model card's lines on the training run's settings (``cxrfl/run_config.json``)."""
    if not settings:
        return ["The checkpoint's folder holds no `cxrfl/run_config.json`: the run's settings are unknown.", ""]
    return [
        "Settings of the training run (`cxrfl/run_config.json`):",
        "",
        "```json",
        json.dumps(settings, indent=2),
        "```",
        "",
    ]


def _evaluation_lines(evaluation: Mapping[str, Any] | None) -> list[str]:
    """The model card's "Evaluation" section: the selected model's test AUROC overall and per finding."""
    summary = evaluation_summary(evaluation)
    if not summary:
        return ["## Evaluation", "", "No evaluation was found beside the checkpoint (`cxrfl/evaluation.json`).", ""]
    return [
        "## Evaluation",
        "",
        f"Selected model (round {summary['selected_round']}) on the test splits of {summary['sites']} site(s): "
        f"mean AUROC {_num(summary['mean_site_auroc'])} ± {_num(summary['sd_site_auroc'])} (SD over sites).",
        "",
        "| finding | test AUROC (mean over the sites that label it) |",
        "| --- | --- |",
        *[f"| {c} | {_num(v)} |" for c, v in summary["class_auroc"].items()],
        "",
    ]
