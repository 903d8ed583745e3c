"""Energy scores, the squared-hinge energy terms, the "no CC" target and the energy threshold.

Notation of the FedFew paper (Dong et al.) and of energy-based OOD detection (Liu et al. 2020):

* Helmholtz free energy of a classifier with logits ``f`` (Eq. 2):
  ``E(x) = -T * logsumexp(f(x) / T)`` (:func:`energy_score`).
* Multi-label: class k is a binary classifier with logits ``(0, f_k)``, so its energy is
  ``-T * log(1 + exp(f_k / T))`` and the joint energy is the sum over the outputs (Eq. 4,
  Wang et al. 2021; :func:`joint_energy`). Low energy = the model recognises something it
  was trained on (a CC, or "no CC"); high energy = neither: possibly a UC.
* Regulariser (Eqs. 5 and 7): ``relu(E_in - m_in)^2`` pushes the energy of CC-site images
  below ``m_in``; ``relu(m_out - E_out)^2`` pushes the energy of UC images above ``m_out``
  (:func:`hinge_in`, :func:`hinge_out`), each averaged over its images and weighted by lambda.
* Threshold: an image whose energy is above the threshold may hold a UC. The threshold is the
  one that classifies the most training examples correctly (:func:`choose_threshold`); the
  sites count their errors for every candidate on a common grid (:func:`threshold_counts`),
  and only those counts leave them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from cxrfl.fedfew.config import THRESHOLD_WEIGHTINGS


def energy_score(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Free energy of a softmax classifier, ``-T * logsumexp(logits / T)`` over the last axis.

    Args:
        logits: [..., K] logits.
        temperature: T > 0.

    Returns:
        [...] energies.
    """
    return -temperature * torch.logsumexp(logits / temperature, dim=-1)


def joint_energy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Joint energy of a multi-label classifier: ``-T * sum_k log(1 + exp(f_k / T))``.

    Each output is a binary classifier with logits ``(0, f_k)``; its energy
    ``-T * logsumexp((0, f_k) / T)`` is ``-T * softplus(f_k / T)`` (computed stably), and the
    joint energy is their sum. Always negative; near 0 when every output is confidently off.

    Args:
        logits: [..., K] logits of the outputs to sum over.
        temperature: T > 0.

    Returns:
        [...] energies.
    """
    return -temperature * F.softplus(logits / temperature).sum(dim=-1)


def output_energy(logits: torch.Tensor, n_cc: int, outputs: str, temperature: float) -> torch.Tensor:
    """Joint energy of a stage-2 network's logits, over every output or the CCs only.

    Args:
        logits: [n, K+1] logits (the CCs, then "no CC").
        n_cc: K, the number of CCs.
        outputs: ``energy_outputs``: ``all`` or ``cc``.
        temperature: T > 0.
    """
    return joint_energy(logits if outputs == "all" else logits[:, :n_cc], temperature)


def hinge_in(energy: torch.Tensor, m_in: float) -> torch.Tensor:
    """Mean of ``relu(E - m_in)^2``: pushes the energy of in-distribution (CC) images below ``m_in``.

    Args:
        energy: [n] energies (n may be 0: the result is then 0).
        m_in: the margin.
    """
    if energy.numel() == 0:
        return energy.new_zeros(())
    return F.relu(energy - m_in).pow(2).mean()


def hinge_out(energy: torch.Tensor, m_out: float) -> torch.Tensor:
    """Mean of ``relu(m_out - E)^2``: pushes the energy of UC images above ``m_out``.

    Args:
        energy: [n] energies (n may be 0: the result is then 0).
        m_out: the margin.
    """
    if energy.numel() == 0:
        return energy.new_zeros(())
    return F.relu(m_out - energy).pow(2).mean()


def no_cc_targets(targets: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append the paper's extra output "no CC" to CC targets.

    The extra label is 1 when every CC label is known and 0, 0 when some CC is positive, and
    unknown (mask 0) otherwise (some CC labels unknown and none positive).

    Args:
        targets: [n, K] CC labels (values at unknown entries are ignored).
        mask: [n, K], 1 where a label is known.

    Returns:
        (targets [n, K+1], mask [n, K+1]).
    """
    known = mask != 0
    positive = (targets == 1) & known
    any_pos = positive.any(dim=-1, keepdim=True)
    all_known = known.all(dim=-1, keepdim=True)
    extra = (~any_pos & all_known).to(targets.dtype)
    extra_known = (any_pos | all_known).to(mask.dtype)
    return torch.cat([targets, extra], dim=-1), torch.cat([mask, extra_known], dim=-1)


def margins_from_means(mean_in: float, mean_out: float, widen: float) -> tuple[float, float]:
    """Margins from the mean energies of a warm-up model (trained without the energy term).

    ``m_in = mean_in - widen`` and ``m_out = max(mean_out, mean_in) + widen``: both around the
    observed means, moved apart to enlarge the energy gap (the paper's recipe). A warm-up model
    that already gives UC images a lower energy than CC images gets ``m_out`` above the CC mean.

    Args:
        mean_in: mean energy of CC-site training images.
        mean_out: mean energy of UC training images.
        widen: how far each margin moves away from its mean (>= 0).
    """
    m_in = float(mean_in) - float(widen)
    m_out = max(float(mean_out), float(mean_in)) + float(widen)
    if m_out <= m_in:  # widen == 0 and equal means
        m_out = m_in + 1e-3
    return m_in, m_out


def threshold_grid(low: float, high: float, bins: int) -> np.ndarray:
    """Candidate thresholds: ``bins`` values from one step below ``low`` to one step above ``high``.

    The end points flag every image (below all energies) or none (above all).

    Args:
        low: the lowest energy any site saw.
        high: the highest.
        bins: number of candidates (>= 2).
    """
    low, high = float(low), float(high)
    if not (np.isfinite(low) and np.isfinite(high)) or high < low:
        raise ValueError(f"bad energy range [{low}, {high}]")
    if bins < 2:
        raise ValueError("at least 2 candidate thresholds are needed")
    step = (high - low) / max(bins - 3, 1) if high > low else 1.0
    return np.linspace(low - step, high + step, bins)


def threshold_counts(
    energy_in: Sequence[float] | np.ndarray,
    energy_out: Sequence[float] | np.ndarray,
    grid: Sequence[float] | np.ndarray,
) -> dict[str, list[int] | int]:
    """A site's errors for every candidate threshold (the only threshold data that leaves it).

    An image is flagged "may hold a UC" when its energy is above the threshold, so an in image
    is wrong when ``E > t`` and a UC image when ``E <= t``.

    Args:
        energy_in: energies of the site's images without UC (CC-labelled images, UC negatives).
        energy_out: energies of its UC-positive images.
        grid: the candidate thresholds (ascending).

    Returns:
        ``in_above`` (per candidate: in images with E > t), ``out_below`` (UC images with
        E <= t), ``n_in``, ``n_out``.
    """
    grid = np.asarray(grid, dtype=np.float64)
    e_in = np.sort(np.asarray(energy_in, dtype=np.float64).ravel())
    e_out = np.sort(np.asarray(energy_out, dtype=np.float64).ravel())
    in_above = len(e_in) - np.searchsorted(e_in, grid, side="right")
    out_below = np.searchsorted(e_out, grid, side="right")
    return {
        "in_above": in_above.astype(int).tolist(),
        "out_below": out_below.astype(int).tolist(),
        "n_in": int(len(e_in)),
        "n_out": int(len(e_out)),
    }


def choose_threshold(
    grid: Sequence[float] | np.ndarray,
    in_above: Sequence[float] | np.ndarray,
    out_below: Sequence[float] | np.ndarray,
    n_in: int,
    n_out: int,
    weighting: str = "count",
) -> dict[str, float]:
    """The threshold that classifies the training examples best, from the summed site counts.

    Errors per candidate: ``in_above + out_below`` (``count``: the paper's "maximise the number
    of correctly classified training examples") or ``in_above / n_in + out_below / n_out``
    (``balanced``). Of the first run of consecutive candidates with the fewest errors, the
    midpoint is returned (every threshold in that interval makes the same errors).

    Args:
        grid: the candidate thresholds (ascending).
        in_above: summed over sites: in images with E > t, per candidate.
        out_below: summed over sites: UC images with E <= t, per candidate.
        n_in: in images in all.
        n_out: UC images in all.
        weighting: ``count`` or ``balanced``.

    Returns:
        ``threshold``, ``errors`` (count at it), ``accuracy`` (share of training examples
        classified correctly), ``balanced_accuracy`` (mean of the in and out accuracies; None
        where one group is empty).
    """
    if weighting not in THRESHOLD_WEIGHTINGS:
        raise ValueError(f"weighting must be one of {list(THRESHOLD_WEIGHTINGS)}, got {weighting!r}")
    grid = np.asarray(grid, dtype=np.float64)
    a = np.asarray(in_above, dtype=np.float64)
    b = np.asarray(out_below, dtype=np.float64)
    if not (len(grid) == len(a) == len(b)) or len(grid) == 0:
        raise ValueError("grid, in_above and out_below must have the same non-zero length")
    if n_in + n_out <= 0:
        raise ValueError("no training example to choose a threshold from")
    if weighting == "count":
        cost = a + b
    else:
        cost = (a / n_in if n_in else 0.0) + (b / n_out if n_out else 0.0)
    best = float(cost.min())
    first = int(np.flatnonzero(np.isclose(cost, best, rtol=0.0, atol=1e-12))[0])
    last = first
    while last + 1 < len(cost) and np.isclose(cost[last + 1], best, rtol=0.0, atol=1e-12):
        last += 1
    errors = a[first] + b[first]
    acc_in = 1.0 - a[first] / n_in if n_in else None
    acc_out = 1.0 - b[first] / n_out if n_out else None
    return {
        "threshold": float((grid[first] + grid[last]) / 2.0),
        "errors": float(errors),
        "accuracy": float(1.0 - errors / (n_in + n_out)),
        "balanced_accuracy": float((acc_in + acc_out) / 2.0) if acc_in is not None and acc_out is not None else None,
    }
