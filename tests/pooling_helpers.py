"""The independent expectation of a pooled evaluation: scikit-learn's AUROC of the pooled per-image scores."""

from __future__ import annotations

from pathlib import Path

from cxrfl.predict import predict_images
from sklearn.metrics import roc_auc_score

_SCORES: dict[tuple, dict[str, dict[str, float]]] = {}


def scores_by_path(site, checkpoint: Path) -> dict[str, dict[str, float]]:
    """Image path -> class -> probability for every test image of ``site``, by ``cxrfl predict``'s code path in
    float32; predicted once per (checkpoint file as it is now, test images) and reused by the tests that ask
    again (they used to predict the same images once per class and group)."""
    paths = site.split_table("test")["path"].tolist()
    key = (str(checkpoint), Path(checkpoint).stat().st_mtime_ns, tuple(paths))
    if key not in _SCORES:
        rows = predict_images(checkpoint, paths, device="cpu", precision="fp32")
        _SCORES[key] = {p: r["probabilities"] for p, r in zip(paths, rows)}
    return _SCORES[key]


def central_auroc(sites, checkpoint: Path, cls: str) -> float:
    """sklearn's AUROC of the pooled test scores (``cxrfl predict``'s code path, float32) of every site labelling
    ``cls``."""
    scores, labels = [], []
    for site in sites:
        if cls not in site.classes:
            continue
        table = site.split_table("test")
        known = table[table[cls].notna()]
        found = scores_by_path(site, checkpoint)
        scores += [found[p][cls] for p in known["path"]]
        labels += known[cls].tolist()
    return float(roc_auc_score(labels, scores))
