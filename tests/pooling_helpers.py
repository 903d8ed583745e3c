"""The independent expectation of a pooled evaluation: scikit-learn's AUROC of the pooled per-image scores."""

from __future__ import annotations

from pathlib import Path

from cxrfl.predict import predict_images
from sklearn.metrics import roc_auc_score


def central_auroc(sites, checkpoint: Path, cls: str) -> float:
    """sklearn's AUROC of the pooled test scores (``cxrfl predict``'s code path, float32) of every site labelling
    ``cls``."""
    scores, labels = [], []
    for site in sites:
        if cls not in site.classes:
            continue
        table = site.split_table("test")
        known = table[cls].notna()
        rows = predict_images(checkpoint, table.loc[known, "path"].tolist(), device="cpu", precision="fp32")
        scores += [r["probabilities"][cls] for r in rows]
        labels += table.loc[known, cls].tolist()
    return float(roc_auc_score(labels, scores))
