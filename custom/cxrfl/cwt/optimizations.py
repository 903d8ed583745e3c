"""The four optimizations of CWT as functions of counts and labels (PLTI, CLR, LWMS, CWL)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch


def _counts(site_counts: Mapping[str, int]) -> tuple[list[str], np.ndarray]:
    names = list(site_counts)
    n = np.array([site_counts[s] for s in names], dtype=np.float64)
    if not names:
        raise ValueError("no site counts given")
    if (n < 0).any() or not np.isfinite(n).all():
        raise ValueError(f"training sizes must be finite and >= 0, got {dict(site_counts)}")
    if n.sum() <= 0:
        raise ValueError(f"no site has training images: {dict(site_counts)}")
    return names, n


def default_local_steps(site_counts: Mapping[str, int], batch_size: int) -> int:
    """Steps per visit that make one cycle one epoch over all sites: ``round(N / (k * b))`` (>= 1).

    Args:
        site_counts: site -> training images.
        batch_size: minibatch size b.
    """
    names, n = _counts(site_counts)
    return max(1, int(math.floor(n.sum() / (len(names) * batch_size) + 0.5)))


def plti_steps(site_counts: Mapping[str, int], base_steps: int) -> dict[str, int]:
    """Proportional local training iterations: ``steps_i = round(s * n_i)`` with ``s = base_steps * k / N``.

    The paper's "number of iterations proportional to the training sample size" with the scaling
    factor chosen so that the mean over the k sites is ``base_steps``; with ``base_steps = N / (k b)``
    it is the paper's ``s = 1 / b`` (one cycle = one epoch over all data). A site with training
    images gets at least one step; a site without gets none.

    Args:
        site_counts: site -> training images n_i.
        base_steps: the mean steps per visit (vanilla CWT's fixed number).
    """
    if base_steps < 1:
        raise ValueError(f"base_steps must be >= 1, got {base_steps}")
    names, n = _counts(site_counts)
    scale = base_steps * len(names) / n.sum()
    return {s: (max(1, int(math.floor(scale * ni + 0.5))) if ni > 0 else 0) for s, ni in zip(names, n)}


def clr_rates(site_counts: Mapping[str, int], global_lr: float) -> dict[str, float]:
    """Cyclical learning rate: ``lr_i = global_lr * k * n_i / N`` (mean over the k sites = ``global_lr``).

    Args:
        site_counts: site -> training images n_i.
        global_lr: the global learning rate.
    """
    if not global_lr > 0:
        raise ValueError(f"global_lr must be > 0, got {global_lr}")
    names, n = _counts(site_counts)
    return {s: float(global_lr * (len(names) * ni / n.sum())) for s, ni in zip(names, n)}


def _targets_mask(targets: np.ndarray, mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    t = np.asarray(targets, dtype=np.float64)
    if t.ndim == 1:
        t = t[:, None]
    if t.ndim != 2:
        raise ValueError(f"targets must be [n] or [n, K], got shape {t.shape}")
    m = ~np.isnan(t) if mask is None else np.asarray(mask).reshape(t.shape) != 0
    t = np.where(m, np.nan_to_num(t), 0.0)
    if not np.isin(t[m], (0.0, 1.0)).all():
        raise ValueError("known labels must be 0 or 1")
    return t, m


def label_groups(targets: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """The label each image counts for in LWMS.

    One output (the binary task): the label itself (0 or 1). Several outputs: the image's rarest
    known positive class at this site (column index), or ``K`` (no positive label) — the
    multi-label reading of "each label equally likely". Images without any known label get -1
    (never sampled).

    Args:
        targets: [n] or [n, K] labels (NaN = unknown when ``mask`` is None).
        mask: [n, K], nonzero where the label is known.
    """
    t, m = _targets_mask(targets, mask)
    n, k = t.shape
    known_any = m.any(axis=1)
    if k == 1:
        return np.where(known_any, t[:, 0], -1).astype(np.int64)
    positives = (t * m).sum(axis=0)
    rarity = np.where((t > 0) & m, positives[None, :], np.inf)
    groups = np.where(np.isfinite(rarity.min(axis=1)), rarity.argmin(axis=1), k)
    return np.where(known_any, groups, -1).astype(np.int64)


def lwms_sample_weights(targets: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Locally weighted minibatch sampling: weight ``1 / (L * n_j)`` for an image of label j.

    ``n_j`` is the number of the site's images with label j (see :func:`label_groups`) and L the
    number of labels present at the site, so the weights sum to 1 and each present label has
    probability 1/L per draw (use with ``torch.utils.data.WeightedRandomSampler`` or
    :class:`VisitSampler`). The paper's weight is ``1 / n_ij``; the constant does not change sampling.

    Args:
        targets: [n] or [n, K] labels.
        mask: [n, K] known-label mask (default: not NaN).
    """
    groups = label_groups(targets, mask)
    present, counts = np.unique(groups[groups >= 0], return_counts=True)
    weights = np.zeros(len(groups), dtype=np.float64)
    for g, c in zip(present, counts):
        weights[groups == g] = 1.0 / (len(present) * c)
    return weights


def cwl_class_weights(positives: Sequence[float], known: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Cyclically weighted loss: per class, the weights of its positive and negative terms.

    For an output c with positive share ``p = positives / known`` at the site, the two labels
    (positive, negative) are weighted ``1 / (2 p)`` and ``1 / (2 (1 - p))`` — the paper's
    ``1 / p_ij`` for the L = 2 labels of a binary cross-entropy, times 1/L so that a balanced site
    gets weight 1 and the mean weight over the site's images is 1. A class with only one label
    value at the site (or no known label) keeps weight 1 for both terms (see :func:`label_warnings`).

    Args:
        positives: [K] positive images per class at the site.
        known: [K] images with a known label per class at the site.

    Returns:
        (w_pos, w_neg), each [K].
    """
    pos = np.asarray(positives, dtype=np.float64)
    n = np.asarray(known, dtype=np.float64)
    if pos.shape != n.shape or (pos < 0).any() or (pos > n).any():
        raise ValueError(f"need 0 <= positives <= known per class, got {pos.tolist()} / {n.tolist()}")
    w_pos, w_neg = np.ones_like(pos), np.ones_like(pos)
    ok = (pos > 0) & (pos < n)
    p = np.where(ok, pos / np.where(n > 0, n, 1.0), 0.5)
    w_pos[ok] = 1.0 / (2.0 * p[ok])
    w_neg[ok] = 1.0 / (2.0 * (1.0 - p[ok]))
    return w_pos, w_neg


def cwl_loss_weights(positives: Sequence[float], known: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cwl_class_weights` as ``(pos_weight, class_weight)`` for :func:`cxrfl.nn.losses.masked_bce`.

    ``class_weight * BCE(pos_weight)`` = ``w_pos * y * (-log p) + w_neg * (1 - y) * (-log(1 - p))``.

    Args:
        positives: [K] positive images per class.
        known: [K] images with a known label per class.
    """
    w_pos, w_neg = cwl_class_weights(positives, known)
    return torch.as_tensor(w_pos / w_neg, dtype=torch.float32), torch.as_tensor(w_neg, dtype=torch.float32)


def label_warnings(
    site: str, classes: Sequence[str], positives: Sequence[float], known: Sequence[float], *, lwms: bool, cwl: bool
) -> list[str]:
    """Clear warnings for classes with one label value only at a site, when LWMS or CWL is on.

    Args:
        site: the site name (for the message).
        classes: the output classes.
        positives: [K] positive images per class at the site.
        known: [K] images with a known label per class at the site.
        lwms: LWMS is on.
        cwl: CWL is on.
    """
    if not (lwms or cwl):
        return []
    which = " and ".join(name for name, on in (("LWMS", lwms), ("CWL", cwl)) if on)
    out = []
    for only, test in (("negative", lambda p, n: p == 0), ("positive", lambda p, n: p == n)):
        names = [
            f"{c!r} ({int(p)} positive of {int(n)})"
            for c, p, n in zip(classes, positives, known)
            if n > 0 and test(p, n)
        ]
        if names:  # classes without known labels here are masked out: nothing to balance
            what = []
            if lwms:
                what.append("LWMS: no minibatch share for the missing label")
            if cwl:
                what.append(f"CWL: the loss of {'that class' if len(names) == 1 else 'those classes'} stays unweighted")
            out.append(
                f"site {site}: only {only} training images for class(es) {', '.join(names)}: one label only, so "
                f"{which} cannot balance {'it' if len(names) == 1 else 'them'} here ({'; '.join(what)}). "
                f"The site still trains on what it has."
            )
    return out
