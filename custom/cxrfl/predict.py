"""Predict every class a saved global model knows, for PNG/JPEG/DICOM images.

An image that cannot be read does not stop the others: its row carries ``error`` (the reason)
instead of probabilities.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cxrfl.clinical.fitted import ClinicalFit
from cxrfl.data.images import ImageError, read_image
from cxrfl.data.transforms import build_transforms
from cxrfl.nn.models import CXRNet, load_checkpoint, model_from_checkpoint, select_device
from cxrfl.nn.precision import resolve


def predict_images(
    model_path: str | Path,
    images: Sequence[str | Path],
    *,
    device: str = "auto",
    precision: str = "auto",
    raw: bool = False,
) -> list[dict[str, Any]]:
    """Class probabilities for each image.

    Args:
        model_path: a checkpoint written by a cxrfl job (``FL_global_model.pt`` or ``best_...``).
        images: image files (PNG, JPEG or DICOM).
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        precision: ``auto`` (the training loops' inference path on this device:
            :mod:`cxrfl.nn.precision`), ``fp32``, ``bf16`` or ``fp16``.
        raw: the model's raw probabilities even where the checkpoint carries calibration maps.

    Returns:
        one dict per image, in input order: ``image`` and ``probabilities`` (class -> probability,
        model order; calibrated where the checkpoint carries a map, unless ``raw``) and, for a
        checkpoint with operating points, ``positive`` (class -> the decision at its threshold); or
        ``image`` and ``error`` (why it cannot be read) for a missing or unreadable image.
    """
    model, classes, config = model_from_checkpoint(model_path)
    checkpoint = load_checkpoint(model_path)
    fit = ClinicalFit.from_checkpoint(checkpoint, str(model_path))
    compute = resolve(precision, "auto", select_device(device))
    compute.prepare(model).eval()
    fedfew = _fedfew_model(checkpoint, model, model_path)
    transform = build_transforms(config.image_size, train=False, in_channels=config.in_channels)
    rows: list[dict[str, Any]] = []
    for image in images:
        try:
            gray = read_image(image)
        except ImageError as exc:
            rows.append({"image": str(image), "error": exc.reason})
            continue
        x = compute.inputs(transform(gray).unsqueeze(0))
        with torch.no_grad(), compute.autocast():
            if fedfew is not None:
                rows.append({"image": str(image), **_fedfew_row(fedfew, x)})
                continue
            logits = model(x)
        rows.append(
            {"image": str(image), **_clinical_row(torch.sigmoid(logits.float()).cpu().numpy(), classes, fit, raw)}
        )
    return rows


def _clinical_row(probs: np.ndarray, classes: list[str], fit: ClinicalFit | None, raw: bool) -> dict[str, Any]:
    """One image's probabilities (calibrated unless ``raw`` or no map) and decisions at the operating points."""
    shown = probs if fit is None or raw else fit.calibrate(probs, classes)
    row: dict[str, Any] = {"probabilities": dict(zip(classes, shown[0].astype(float).tolist(), strict=True))}
    if fit is not None and fit.operating_points:
        row["positive"] = fit.decide(probs, classes)[0]
    return row


def _fedfew_model(checkpoint: dict[str, Any], model: CXRNet, model_path: str | Path) -> Any:
    """The FedFew view of a checkpoint that carries a ``fedfew`` entry, else None."""
    from cxrfl.fedfew.model import FEDFEW_KEY, FedFewModel

    info = checkpoint.get(FEDFEW_KEY)
    return None if info is None else FedFewModel(model, info, str(model_path))


def _fedfew_row(fedfew: Any, x: torch.Tensor) -> dict[str, Any]:
    """A FedFew model's outputs for one image: CC probabilities (the "no CC" output dropped),
    the energy and, per UC, the detector's decision (``paper``: negative when the energy is not
    above the threshold; ``scorer``: the UC sites' scorers' vote)."""
    out = fedfew.predict(x)
    ucs = {}
    for uc in fedfew.uc_classes:
        m = out["uc"][uc]
        ucs[uc] = {
            "present": bool(m["positive"][0]),
            "votes": int(m["votes"][0]),
            "pairs": int(m["pairs"]),
            "margin": float(m["margin"][0]),
        }
    return {
        "probabilities": dict(zip(fedfew.cc_classes, out["cc_probabilities"][0].tolist(), strict=True)),
        "energy": float(out["energy"][0]),
        "energy_threshold": fedfew.threshold,
        "detector": fedfew.detector,
        "underrepresented": ucs,
    }


def format_predictions(rows: list[dict[str, Any]], fmt: str = "table") -> str:
    """Render predictions.

    Args:
        rows: output of :func:`predict_images`.
        fmt: ``table`` (one block per readable image; unreadable ones are left to the caller's
            error lines), ``json`` (every row, ``error`` rows included) or ``csv`` (one row per
            image, a last ``error`` column that is empty for readable images). A model with operating
            points adds each class's decision (table: ``positive``/``negative``; csv: ``<class> positive``, 1/0).
    """
    if fmt == "json":
        return json.dumps(rows, indent=2)
    good = [r for r in rows if "error" not in r]
    classes = list(good[0]["probabilities"]) if good else []
    ucs = list(good[0].get("underrepresented", {})) if good else []  # FedFew models: rare-class decisions
    fedfew = bool(good) and "energy" in good[0]
    decided = list(good[0].get("positive", {})) if good else []  # classes with an operating point
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        header = [*classes, *(["energy"] if fedfew else []), *ucs, *(f"{c} positive" for c in decided)]
        writer.writerow(["image", *header, "error"])
        for r in rows:
            if "error" in r:
                writer.writerow([r["image"], *[""] * len(header), r["error"]])
                continue
            extra = [f"{r['energy']:.4f}"] if fedfew else []
            writer.writerow(
                [
                    r["image"],
                    *(f"{r['probabilities'][c]:.4f}" for c in classes),
                    *extra,
                    *(int(r["underrepresented"][u]["present"]) for u in ucs),
                    *(int(r["positive"][c]) for c in decided),
                    "",
                ]
            )
        return buf.getvalue().rstrip("\n")
    width = max((len(c) for c in [*classes, *ucs]), default=5)
    blocks = []
    for r in good:
        decision = {c: "  positive" if v else "  negative" for c, v in r.get("positive", {}).items()}
        lines = [r["image"]] + [f"  {c:<{width}}  {p:.3f}{decision.get(c, '')}" for c, p in r["probabilities"].items()]
        if "energy" in r:
            gated = r.get("detector", "paper") == "paper"  # the scorers do not look at the energy
            if gated:
                flagged = r["energy"] > r["energy_threshold"]
                lines.append(
                    f"  energy {r['energy']:.3f} (threshold {r['energy_threshold']:.3f}): "
                    + ("may hold a rare class" if flagged else "no rare class")
                )
            for u, d in r["underrepresented"].items():
                verdict = "present" if d["present"] else "absent"
                lines.append(
                    f"  {u:<{width}}  {verdict} (rare class; {d['votes']}/{d['pairs']} "
                    f"{'prototype' if gated else 'scorer'} vote(s), margin {d['margin']:+.4f})"
                )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
