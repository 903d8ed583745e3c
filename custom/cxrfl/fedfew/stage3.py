"""Stage 3 on the server: the energy threshold from the sites' error counts, and the prototypes kept.

Both work on the sites' answers only (counts per candidate threshold, prototype payloads); what
is unusable is left out with one warning line naming the site.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from cxrfl.common.transport import Message
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.energy import choose_threshold
from cxrfl.fedfew.plan import ClassPlan
from cxrfl.fedfew.prototypes import DualPrototype


def threshold_from_counts(
    grid: np.ndarray, counts: Mapping[str, Message], config: FedFewConfig, warning: Callable[[str], None]
) -> dict[str, Any] | None:
    """Sum the sites' error counts and choose the threshold.

    Args:
        grid: the candidate thresholds.
        counts: site -> its ``fedfew_energy`` answer in ``counts`` mode.
        config: the settings (``threshold_weighting``, ``threshold_examples``).
        warning: problem logger.

    Returns:
        The choice (:func:`cxrfl.fedfew.energy.choose_threshold`) with the totals and the sites
        used; None when no site sent a usable count.
    """
    in_above = np.zeros(len(grid))
    out_below = np.zeros(len(grid))
    n_in = n_out = 0
    used = []
    for site, (_, meta) in sorted(counts.items()):
        c = meta.get("stats") or {}
        try:
            a, b = np.asarray(c["in_above"], float), np.asarray(c["out_below"], float)
            if a.shape != grid.shape or b.shape != grid.shape:
                raise ValueError(f"{a.shape}/{b.shape} counts for {grid.shape} thresholds")
            ni, no = int(c["n_in"]), int(c["n_out"])
        except (KeyError, TypeError, ValueError) as exc:
            warning(f"stage 3: threshold counts of site {site} are unusable ({exc}); left out")
            continue
        in_above += a
        out_below += b
        n_in += ni
        n_out += no
        used.append(site)
    if n_in + n_out == 0:
        return None
    if n_out == 0:
        warning("stage 3: no UC-positive training image at any site; the threshold flags (almost) nothing")
    if n_in == 0:
        warning("stage 3: no training example without a UC; the threshold flags (almost) everything")
    chosen = choose_threshold(grid, in_above, out_below, n_in, n_out, config.threshold_weighting)
    chosen.update(
        n_in=n_in, n_out=n_out, sites=used, weighting=config.threshold_weighting, examples=config.threshold_examples
    )
    return chosen


def _usable(proto: DualPrototype, site: str, plan: ClassPlan, config: FedFewConfig, dims: set[int]) -> str | None:
    """Why a prototype is left out (None: kept)."""
    if proto.uc not in plan.site_ucs.get(site, []):
        return f"site {site} sent a prototype of {proto.uc!r}, a class it was not asked for"
    if min(proto.n_positive, proto.n_negative) < config.min_prototype_images:
        return f"site {site} sent a prototype of {proto.uc} over fewer than {config.min_prototype_images} images"
    if dims and len(proto.positive) not in dims:
        return f"prototype of {proto.uc} from site {site} has {len(proto.positive)} features, others {sorted(dims)}"
    return None


def collect_prototypes(
    answers: Mapping[str, Message], plan: ClassPlan, config: FedFewConfig, warning: Callable[[str], None]
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str]]:
    """The prototypes to keep from the UC sites' answers, anonymised (a running ``source`` number, no site).

    Args:
        answers: site -> its ``fedfew_prototypes`` answer.
        plan: the class plan (which site may send which UC).
        config: the settings (``min_prototype_images``).
        warning: problem logger.

    Returns:
        UC -> its prototype payloads (every UC of the plan, possibly empty), and
        ``"<uc>@<site>"`` -> why the site refused it.
    """
    prototypes: dict[str, list[dict[str, Any]]] = {uc: [] for uc in plan.uc_classes}
    refused: dict[str, str] = {}
    for site, (_, meta) in sorted(answers.items()):
        for uc, reason in dict(meta.get("refused") or {}).items():
            refused[f"{uc}@{site}"] = reason
            warning(f"stage 3: no prototype of {uc} from site {site}: {reason}")
        for payload in meta.get("prototypes") or []:
            try:
                proto = DualPrototype.from_payload(payload)
            except (KeyError, TypeError, ValueError) as exc:
                warning(f"stage 3: unusable prototype from site {site} ({exc}); left out")
                continue
            dims = {len(q["positive"]) for q in sum(prototypes.values(), [])}
            why = _usable(proto, site, plan, config, dims)
            if why:
                warning(f"stage 3: {why}; left out")
                continue
            kept = proto.to_payload()
            kept["source"] = len(prototypes[proto.uc])
            prototypes[proto.uc].append(kept)
    for uc in plan.uc_classes:
        if not prototypes[uc]:
            warning(f"stage 3: UC {uc} has no prototype; the final model does not predict it")
    return prototypes, refused
