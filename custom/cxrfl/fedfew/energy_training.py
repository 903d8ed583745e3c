"""Stage 2 at a site: the energy-based multi-label loss (Eqs. 3-7) and a round's local epochs.

A batch holds the CC labels, then the role flags :data:`cxrfl.fedfew.roles.ENERGY_GROUPS` as extra
label columns; a batch without any loss term is skipped (no optimiser step).
"""

from __future__ import annotations

from typing import Any

import torch

from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.energy import hinge_in, hinge_out, no_cc_targets, output_energy
from cxrfl.fedfew.roles import ENERGY_GROUPS
from cxrfl.nn.losses import masked_bce
from cxrfl.nn.precision import Compute
from cxrfl.nn.training import train_steps


def stage2_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor,
    is_in: torch.Tensor,
    is_out: torch.Tensor,
    energy: torch.Tensor,
    energy_weight: float,
    m_in: float | None,
    m_out: float | None,
) -> dict[str, torch.Tensor]:
    """One batch's loss (Eq. 6, or Eq. 7 where no CC label is known) and its parts.

    Args:
        logits: [n, K+1] float logits.
        target: "no CC" targets (:func:`cxrfl.fedfew.energy.no_cc_targets`).
        mask: their known entries.
        is_in: [n] the images pushed below ``m_in``.
        is_out: [n] the images pushed above ``m_out``.
        energy: [n] the joint energies of ``logits``.
        energy_weight: lambda (0: BCE only).
        m_in: the in margin (needed when ``energy_weight > 0``).
        m_out: the out margin (needed when ``energy_weight > 0``).

    Returns:
        ``loss``, ``bce``, ``hinge_in``, ``hinge_out``.
    """
    bce = masked_bce(logits, target, mask)
    h_in = h_out = torch.zeros((), device=logits.device)
    if energy_weight > 0:
        if m_in is None or m_out is None:
            raise ValueError("the energy term needs both margins")
        h_in, h_out = hinge_in(energy[is_in], m_in), hinge_out(energy[is_out], m_out)
    return {"loss": bce + energy_weight * (h_in + h_out), "bce": bce, "hinge_in": h_in, "hinge_out": h_out}


def energy_epochs(
    model: torch.nn.Module,
    loader: Any,
    *,
    n_cc: int,
    config: FedFewConfig,
    compute: Compute,
    energy_weight: float,
    m_in: float | None,
    m_out: float | None,
    site: str,
) -> tuple[int, int, dict[str, float | None]]:
    """A round's local stage-2 training (``local_epochs``, at most ``max_steps_per_epoch`` steps each).

    Args:
        model: the stage-2 network, loaded with the received weights.
        loader: batches ``(x, y, mask)``: y holds the CCs, then the :data:`ENERGY_GROUPS` flags.
        n_cc: K, the number of CCs.
        config: FedFew settings (``lr``, ``local_epochs``, the energy settings).
        compute: device and precision.
        energy_weight: lambda (0 in warm-up rounds: BCE only).
        m_in: the in margin.
        m_out: the out margin.
        site: the site's name, for the message of a non-finite loss.

    Returns:
        The optimiser steps, the skipped batches, and the means per step of ``train_loss``,
        ``train_bce``, ``train_hinge_in``, ``train_hinge_out`` and per group the mean training-time
        energy ``train_energy_<group>`` (None without steps or such images).
    """
    k, device = n_cc, compute.device
    model.train()
    sums = {"loss": 0.0, "bce": 0.0, "hinge_in": 0.0, "hinge_out": 0.0}
    energy_sums, energy_counts = dict.fromkeys(ENERGY_GROUPS, 0.0), dict.fromkeys(ENERGY_GROUPS, 0)

    def stage2(batch: Any) -> torch.Tensor | None:
        x, y, m = batch
        y_cc, m_cc = y[:, :k], m[:, :k]
        is_in, is_out = y[:, k] == 1, y[:, k + 1] == 1
        target, mask = no_cc_targets(y_cc, m_cc)
        has_bce = bool(mask.sum() > 0)
        has_energy = energy_weight > 0 and bool(is_in.any() or is_out.any())
        if not (has_bce or has_energy) or x.shape[0] < 2:
            return None
        x, target, mask = compute.inputs(x), target.to(device), mask.to(device)
        with compute.autocast():
            logits = model(x)
        logits = logits.float()
        energy = output_energy(logits, k, config.energy_outputs, config.temperature)
        parts = stage2_loss(
            logits, target, mask, is_in.to(device), is_out.to(device), energy, energy_weight, m_in, m_out
        )
        for name, v in parts.items():  # a non-finite loss stops the round: these sums are then never read
            sums[name] += float(v.detach())
        for j, g in enumerate(ENERGY_GROUPS):
            rows = (y[:, k + j] == 1).to(device)
            energy_sums[g] += float(energy.detach()[rows].sum())
            energy_counts[g] += int(rows.sum())
        return parts["loss"]

    stats = train_steps(
        loader,
        torch.optim.Adam(model.parameters(), lr=config.lr),
        compute,
        stage2,
        epochs=config.local_epochs,
        max_steps=config.max_steps_per_epoch,
        what=f"site {site}: stage-2 loss",
    )
    steps, skipped = stats.steps, stats.skipped
    means = {f"train_{name}": (v / steps if steps else None) for name, v in sums.items()}
    for g in ENERGY_GROUPS:
        means[f"train_energy_{g}"] = energy_sums[g] / energy_counts[g] if energy_counts[g] else None
    return steps, skipped, means
