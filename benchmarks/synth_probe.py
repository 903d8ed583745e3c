"""How hard is the synthetic demo data? Per-class AUROC of simple probes.

Renders a fully annotated cohort (all 20 classes, the external site's case mix, images from all
three site styles), splits it by patient, and trains

* ``logreg``: one logistic regression per class on 32x32 downsampled pixels (scikit-learn);
* ``cnn``: a small 4-block CNN on the 64x64 images, multi-label BCE (torch, CPU).

A realistic synthetic set gives AUROCs well below 1 (SYNTHETIC.md: roughly 0.65-0.95 for a
DenseNet trained on a few thousand images); the pixel probe is the weaker learner and should
sit at or below that range. Usage::

    python benchmarks/synth_probe.py --n 3000 --model both --out benchmarks/results/synth_probe.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from cxrfl.data.labels import KNOWN_CLASSES
from cxrfl.synth.anatomy import jitter_position, sample_anatomy
from cxrfl.synth.cohort import sample_cohort
from cxrfl.synth.profiles import EXTERNAL_MIX
from cxrfl.synth.render import render_cxr
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.preprocessing import StandardScaler

STYLES = ("nih", "chexpert", "mimic")


def make_data(n: int, size: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Render ``n`` frontal images; returns images (n, size, size) float32, labels (n, 20), patient ids."""
    exams = sample_cohort(EXTERNAL_MIX, n, np.random.default_rng([seed, 0]))
    images = np.zeros((n, size, size), dtype=np.float32)
    anatomy = {}
    for i, ex in enumerate(exams):
        if ex.patient not in anatomy:
            anatomy[ex.patient] = sample_anatomy(np.random.default_rng([seed, 1, ex.patient]), ex.sex, ex.age)
        anat = anatomy[ex.patient]
        if ex.study > 1:
            anat = jitter_position(anat, np.random.default_rng([seed, 3, ex.patient, ex.study]))
        style = STYLES[ex.patient % len(STYLES)]
        img = render_cxr(
            ex.findings, style, np.random.default_rng([seed, 2, i]), size, view=ex.view, supine=ex.supine, anatomy=anat
        )
        images[i] = img / 255.0
    labels = np.array([[c in ex.findings for c in KNOWN_CLASSES] for ex in exams], dtype=np.float32)
    return images, labels, np.array([ex.patient for ex in exams])


def _auroc(y: np.ndarray, p: np.ndarray) -> dict[str, float]:
    return {
        c: float(roc_auc_score(y[:, j], p[:, j])) for j, c in enumerate(KNOWN_CLASSES) if 0 < y[:, j].sum() < len(y)
    }


def probe_logreg(x_tr: np.ndarray, y_tr: np.ndarray, x_te: np.ndarray, y_te: np.ndarray) -> dict[str, float]:
    """Per-class logistic regression on 32x32 downsampled pixels."""

    def feats(x: np.ndarray) -> np.ndarray:
        n, h, w = x.shape
        return x.reshape(n, 32, h // 32, 32, w // 32).mean(axis=(2, 4)).reshape(n, -1)

    scaler = StandardScaler().fit(feats(x_tr))
    f_tr, f_te = scaler.transform(feats(x_tr)), scaler.transform(feats(x_te))
    scores = np.zeros_like(y_te)
    for j in range(y_tr.shape[1]):
        if 0 < y_tr[:, j].sum() < len(y_tr):
            clf = LogisticRegression(C=0.01, max_iter=3000).fit(f_tr, y_tr[:, j])
            scores[:, j] = clf.decision_function(f_te)
    return _auroc(y_te, scores)


def probe_cnn(
    x_tr: np.ndarray, y_tr: np.ndarray, x_te: np.ndarray, y_te: np.ndarray, epochs: int, seed: int
) -> dict[str, float]:
    """A small CNN (4 conv blocks, global pooling, linear head) trained with multi-label BCE."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    torch.set_num_threads(2)

    def block(i: int, o: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(i, o, 3, padding=1),
            nn.BatchNorm2d(o),
            nn.ReLU(),
            nn.Conv2d(o, o, 3, padding=1),
            nn.BatchNorm2d(o),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )

    model = nn.Sequential(
        block(1, 16),
        block(16, 32),
        block(32, 64),
        block(64, 96),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(96, y_tr.shape[1]),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    xt, yt = torch.from_numpy(x_tr[:, None]), torch.from_numpy(y_tr)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        model.train()
        for idx in torch.randperm(len(xt), generator=gen).split(32):
            loss = nn.functional.binary_cross_entropy_with_logits(model(xt[idx]), yt[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        scores = torch.cat([model(b) for b in torch.from_numpy(x_te[:, None]).split(256)]).numpy()
    return _auroc(y_te, scores)


def main() -> None:
    """Render, split by patient, run the probes, print and save per-class AUROCs."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3000, help="images (2/3 train, 1/3 test by patient)")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", choices=("logreg", "cnn", "both"), default="both")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "synth_probe.json")
    args = ap.parse_args()
    t0 = time.time()
    x, y, patients = make_data(args.n, args.size, args.seed)
    render_s = time.time() - t0
    test = patients % 3 == 0
    results: dict[str, object] = {
        "n": args.n,
        "size": args.size,
        "seed": args.seed,
        "render_s": round(render_s, 1),
        "train": int((~test).sum()),
        "test": int(test.sum()),
        "test_positives": {c: int(v) for c, v in zip(KNOWN_CLASSES, y[test].sum(0))},
    }
    for name in ("logreg", "cnn"):
        if args.model not in (name, "both"):
            continue
        t = time.time()
        if name == "logreg":
            auc = probe_logreg(x[~test], y[~test], x[test], y[test])
        else:
            auc = probe_cnn(x[~test], y[~test], x[test], y[test], args.epochs, args.seed)
        results[name] = {
            "auroc": {k: round(v, 3) for k, v in auc.items()},
            "mean": round(float(np.mean(list(auc.values()))), 3),
            "seconds": round(time.time() - t, 1),
        }
    print(json.dumps(results, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
