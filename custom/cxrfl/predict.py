"""Predict every class a saved global model knows, for PNG/JPEG/DICOM images."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from cxrfl.data.transforms import build_transforms
from cxrfl.errors import DataError
from cxrfl.models import model_from_checkpoint, select_device


def predict_images(model_path: str | Path, images: Sequence[str | Path], *, device: str = "auto") -> list[dict[str, Any]]:
    """Class probabilities for each image.

    Args:
        model_path: a checkpoint written by a cxrfl job (``FL_global_model.pt`` or ``best_...``).
        images: image files (PNG, JPEG or DICOM).
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.

    Returns:
        one dict per image: ``image`` and ``probabilities`` (class -> probability, model order).
    """
    model, classes, config = model_from_checkpoint(model_path)
    dev = select_device(device)
    model.to(dev).eval()
    transform = build_transforms(config.image_size, train=False, in_channels=config.in_channels)
    rows = []
    for image in images:
        if not Path(image).is_file():
            raise DataError(f"image {image} does not exist")
        x = transform(str(image)).unsqueeze(0).to(dev)
        with torch.no_grad():
            probs = torch.sigmoid(model(x)).squeeze(0).cpu().tolist()
        rows.append({"image": str(image), "probabilities": dict(zip(classes, probs, strict=True))})
    return rows


def format_predictions(rows: list[dict[str, Any]], fmt: str = "table") -> str:
    """Render predictions.

    Args:
        rows: output of :func:`predict_images`.
        fmt: ``table`` (one block per image), ``json`` or ``csv`` (one row per image).
    """
    if fmt == "json":
        return json.dumps(rows, indent=2)
    classes = list(rows[0]["probabilities"]) if rows else []
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(["image", *classes])
        for r in rows:
            writer.writerow([r["image"], *(f"{r['probabilities'][c]:.4f}" for c in classes)])
        return buf.getvalue().rstrip("\n")
    width = max((len(c) for c in classes), default=5)
    blocks = []
    for r in rows:
        lines = [r["image"]] + [f"  {c:<{width}}  {p:.3f}" for c, p in r["probabilities"].items()]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
