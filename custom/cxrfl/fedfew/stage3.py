"""Stage 3 on the server: the energy threshold from the sites' error counts, and the detectors kept.

Both work on the sites' answers only (counts per candidate threshold, detector payloads); what
is unusable is left out with one warning line naming the site. :func:`run_stage3` asks the sites
and writes ``stage3.json`` (:func:`cxrfl.fedfew.stages.write_stage3`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cxrfl.common.server import ServerLoop
from cxrfl.common.transport import Message
from cxrfl.fedfew import protocol as P
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.detectors import PAYLOAD_KEYS, Detector, detector_size, parse_detector
from cxrfl.fedfew.energy import choose_threshold, threshold_grid
from cxrfl.fedfew.plan import ClassPlan
from cxrfl.fedfew.stages import write_stage3


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


Ask = Callable[[Sequence[str], dict[str, Any]], Mapping[str, Message]]
"""Sends ``fedfew_energy`` to the sites named with extra meta (``mode`` ...): site -> answer."""


def energy_threshold(
    ask: Ask, sites: Sequence[str], config: FedFewConfig, warning: Callable[[str], None]
) -> dict[str, Any] | None:
    """The two passes of the threshold: the sites' energy ranges make a common grid, then each site
    counts its errors per candidate (:func:`threshold_from_counts`).

    Args:
        ask: sends the energy task.
        sites: the stage-2 sites.
        config: the settings (``threshold_bins`` ...).
        warning: problem logger.

    Returns:
        The choice, or None when no site has the statistics.
    """
    ranges = ask(sites, {"mode": "range"})
    rs = {
        s: m["stats"]
        for s, (_, m) in ranges.items()
        if isinstance(m.get("stats"), Mapping) and m["stats"].get("min") is not None
    }
    if not rs:
        return None
    low, high = min(float(r["min"]) for r in rs.values()), max(float(r["max"]) for r in rs.values())
    grid = threshold_grid(low, high, config.threshold_bins)
    counts = ask(sorted(rs), {"mode": "counts", "grid": grid.tolist()})
    return threshold_from_counts(grid, counts, config, warning)


def flags_nothing(config: FedFewConfig) -> dict[str, Any]:
    """The threshold without statistics: 0, above every joint energy (no image is flagged)."""
    return {
        "threshold": 0.0,
        "errors": None,
        "accuracy": None,
        "balanced_accuracy": None,
        "n_in": 0,
        "n_out": 0,
        "sites": [],
        "weighting": config.threshold_weighting,
        "note": "no statistics: flags nothing",
    }


def _usable(d: Detector, site: str, plan: ClassPlan, config: FedFewConfig, dims: set[int], what: str) -> str | None:
    """Why a detector is left out (None: kept)."""
    if d.uc not in plan.site_ucs.get(site, []):
        return f"site {site} sent a {what} of {d.uc!r}, a class it was not asked for"
    if min(d.n_positive, d.n_negative) < config.min_prototype_images:
        return f"site {site} sent a {what} of {d.uc} over fewer than {config.min_prototype_images} images"
    if dims and detector_size(d) not in dims:
        return f"{what} of {d.uc} from site {site} has {detector_size(d)} features, others {sorted(dims)}"
    return None


def collect_detectors(
    answers: Mapping[str, Message], plan: ClassPlan, config: FedFewConfig, warning: Callable[[str], None]
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str]]:
    """The detectors (``config.detector``) to keep from the UC sites' answers, anonymised (a
    running ``source`` number, no site).

    Args:
        answers: site -> its ``fedfew_detectors`` answer.
        plan: the class plan (which site may send which UC).
        config: the settings (``detector``, ``min_prototype_images``).
        warning: problem logger.

    Returns:
        UC -> its detector payloads (every UC of the plan, possibly empty), and
        ``"<uc>@<site>"`` -> why the site refused it.
    """
    key = PAYLOAD_KEYS[config.detector]
    what = "prototype" if config.detector == "paper" else "scorer"
    kept: dict[str, list[dict[str, Any]]] = {uc: [] for uc in plan.uc_classes}
    dims: set[int] = set()
    refused: dict[str, str] = {}
    for site, (_, meta) in sorted(answers.items()):
        for uc, reason in dict(meta.get("refused") or {}).items():
            refused[f"{uc}@{site}"] = reason
            warning(f"stage 3: no {what} of {uc} from site {site}: {reason}")
        for payload in meta.get(key) or []:
            try:
                d = parse_detector(config.detector, payload)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                warning(f"stage 3: unusable {what} from site {site} ({exc}); left out")
                continue
            why = _usable(d, site, plan, config, dims, what)
            if why:
                warning(f"stage 3: {why}; left out")
                continue
            dims.add(detector_size(d))
            out = d.to_payload()
            out["source"] = len(kept[d.uc])
            kept[d.uc].append(out)
    for uc in plan.uc_classes:
        if not kept[uc]:
            warning(f"stage 3: UC {uc} has no {what}; the final model does not predict it")
    return kept, refused


def _threshold(
    loop: ServerLoop, plan: ClassPlan, state: Mapping[str, np.ndarray], config: FedFewConfig, meta: P.SiteMeta
) -> dict[str, Any]:
    """The energy threshold from the sites' ranges, then their error counts on a common grid."""

    def ask(sites: Sequence[str], extra: dict[str, Any]) -> Mapping[str, Message]:
        return loop.broadcast(P.ENERGY, sites, state, lambda s: meta(s, **extra))

    chosen = energy_threshold(ask, plan.stage2_sites, config, loop.warning)
    if chosen is None:
        loop.warning(
            "stage 3: no usable threshold statistics (no site has UC positives or negatives"
            f"{' or CC-labelled images' if config.threshold_examples == 'all' else ''}); the threshold is set to 0, "
            "above every joint energy, so no image is flagged and the final model predicts the CCs only"
        )
        return flags_nothing(config)
    loop.info(
        f"stage 3 threshold: {chosen['threshold']:.4f} classifies {chosen['accuracy']:.1%} of "
        f"{chosen['n_in'] + chosen['n_out']} training examples correctly ({chosen['n_in']} without UC, "
        f"{chosen['n_out']} with one)"
    )
    return chosen


def run_stage3(
    loop: ServerLoop,
    plan: ClassPlan,
    state: Mapping[str, np.ndarray],
    *,
    config: FedFewConfig,
    meta: P.SiteMeta,
    path: Path,
) -> dict[str, Any]:
    """Stage 3: the threshold, the UC sites' detectors; recorded and written to its file.

    Args:
        loop: the server loop that asks the sites and records the stage.
        plan: the class plan.
        state: the stage-2 weights.
        config: FedFew settings.
        meta: a site's task meta.
        path: stage 3's file.

    Returns:
        ``threshold``, ``threshold_stats``, ``detector``, the detector payloads per UC (under
        :data:`cxrfl.fedfew.detectors.PAYLOAD_KEYS`), ``refused`` and ``detector_counts``.
    """
    start = time.perf_counter()
    chosen = _threshold(loop, plan, state, config, meta)
    holders = [s for s in plan.stage2_sites if plan.site_ucs.get(s)]
    answers = loop.broadcast(P.DETECTORS, holders, state, meta) if holders else {}
    kept, refused = collect_detectors(answers, plan, config, loop.warning)
    result = {
        "threshold": chosen["threshold"],
        "threshold_stats": chosen,
        "detector": config.detector,
        PAYLOAD_KEYS[config.detector]: {uc: d for uc, d in kept.items() if d},
        "refused": refused,
        "detector_counts": {uc: len(d) for uc, d in kept.items()},
    }
    loop.record(
        {
            "stage": 3,
            "threshold": chosen,
            "detector": config.detector,
            "detector_counts": result["detector_counts"],
            "refused": refused,
            "seconds": time.perf_counter() - start,
        }
    )
    written = write_stage3(path, result)
    loop.info(f"stage 3 done: {written}")
    return result
