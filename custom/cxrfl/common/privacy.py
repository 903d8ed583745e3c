"""The privacy filters' settings, free of NVFlare: defaults, the check of a setting, and what a
filter did to an update.

A job may filter what a site sends back with NVFlare's ``PercentilePrivacy`` or ``SVTPrivacy``,
applied to the weight difference by :class:`cxrfl.fl.privacy.UpdatePrivacy`. Measured on real
DenseNet121 updates (``cxrfl bench privacy``; README, "Privacy filters"):

- NVFlare's SVT defaults destroy every update (cosine similarity about 0.002 with the true update,
  9 % of entries sent, epsilon about 70,000 per round): their release noise has a scale of
  ``2 * gamma / noise_var`` = 20 times the largest value it protects.
- A percentile of 90 or more keeps too few entries: the head rows, whose changes are small beside
  the feature extractor's largest, lose most or all of theirs (18 % kept at 95, none at 99).
- ``gamma`` bounds every sent change to +-gamma, the BatchNorm running statistics' too, whose
  changes are far larger than the weights' (a running variance moves by whole units in a round):
  at 0.1 (cxrfl's first default) they kept 25 % of their norm and the model stayed at chance
  (mean AUROC 0.44 against 0.63 unfiltered on ``nih1000``, 3 seeds; SVT alike); at 0.01 (NVFlare's
  default) the warm-up's head rows, sent as whole values, are clipped too.

:data:`PRIVACY_DEFAULTS` keep the model useful (cosine >= 0.9 for the feature extractor's weights
and the head rows, >= 0.9 and most of the norm for the BatchNorm statistics). What they protect:
``percentile`` withholds the smallest 10 % of each round's changes and bounds every change to +-1:
no formal guarantee. ``svt`` sends a random 90 % of the changes, clipped to +-1, with Laplace noise
of scale ``2 * gamma / noise_var`` = 2e-5 (at 2e-4 the weights' cosine fell to 0.63: a round's
changes at the default learning rate are of that size); its accountant spends
``epsilon + 0.9 * entries * noise_var`` per round (about 6e11 for DenseNet121's 7 M entries): no
meaningful differential privacy. No setting of NVFlare's SVT found both a useful model and a
meaningful epsilon on a model of this size. :func:`check_privacy` refuses settings that destroy
the update or silently send it unfiltered, and warns about those that lose much of it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from cxrfl.errors import ConfigError

log = logging.getLogger(__name__)

METHODS = ("percentile", "svt")

NVFLARE_DEFAULTS: dict[str, dict[str, Any]] = {
    "percentile": {"percentile": 10, "gamma": 0.01},
    "svt": {"fraction": 0.1, "epsilon": 0.1, "noise_var": 0.1, "gamma": 1e-5, "tau": 1e-6, "replace": True},
}
"""NVFlare 2.9's own defaults of ``PercentilePrivacy`` and ``SVTPrivacy`` (for the benchmark's comparison)."""

PRIVACY_DEFAULTS: dict[str, dict[str, Any]] = {
    "percentile": {"percentile": 10, "gamma": 1.0},
    "svt": {"fraction": 0.9, "epsilon": 0.1, "noise_var": 100000, "gamma": 1.0, "tau": 1e-6, "replace": False},
}
"""cxrfl's defaults (see the module docstring), written into jobs explicitly."""

MIN_COSINE = 0.5
"""A filtered update whose cosine similarity with the true one is below this is destroyed (site warning)."""
MIN_RELATIVE_NORM = 0.1
"""... or whose norm is below this share of the true one's."""
REFUSED_PERCENTILE = 90
"""``percentile`` at or above this is refused: the head rows lose most or all of their changes."""
WARNED_PERCENTILE = 50
REFUSED_GAMMA = 0.2
"""``gamma`` below this is refused: it clips the BatchNorm running statistics' changes to a fraction of their norm."""
WARNED_GAMMA = 0.5
REFUSED_NOISE_VAR = 2
"""SVT ``noise_var`` at or below this is refused: the release noise is at least as large as ``gamma``."""
WARNED_NOISE_VAR = 20
WARNED_NOISE_SCALE = 1e-4
"""SVT release noise ``2 * gamma / noise_var`` above this is warned about: as large as a round's changes."""
WARNED_FRACTION = 0.8

_WARNED: set[str] = set()
"""Warnings already given in this process (a job builds its filter several times)."""

PARTS = ("feature_extractor", "batchnorm_statistics", "head")
"""How an update is measured: the feature extractor's weights, its BatchNorm running statistics, the head rows."""
_STATISTICS = ("running_mean", "running_var")


def privacy_args(privacy: Mapping[str, Any]) -> dict[str, Any]:
    """A privacy option's full arguments (defaults filled in).

    Args:
        privacy: ``{"method": ..., "args": {...}}``.
    """
    return {**PRIVACY_DEFAULTS[privacy["method"]], **(privacy.get("args") or {})}


def check_privacy(privacy: Mapping[str, Any] | None, where: str, warn: Callable[[str], None] = log.warning) -> None:
    """Refuse a privacy option that cannot work; warn (one line each, once per process) about one
    that loses much of the update.

    Args:
        privacy: None (off) or ``{"method": "percentile" | "svt", "args": {...}}``.
        where: names the job or site in the messages.
        warn: where the warnings go.

    Raises:
        ConfigError: an unknown method, key or argument, or a setting that destroys every update
            or makes NVFlare send it unfiltered.
    """
    if privacy is None:
        return
    method = privacy.get("method")
    if method not in METHODS:
        raise ConfigError(f"{where}: privacy method must be one of {list(METHODS)}, got {method!r}")
    unknown = set(privacy) - {"method", "args"}
    if unknown:
        raise ConfigError(f"{where}: unknown privacy key(s) {sorted(unknown)} (use 'method' and 'args')")
    bad = set(privacy.get("args") or {}) - set(PRIVACY_DEFAULTS[method])
    if bad:
        raise ConfigError(
            f"{where}: unknown {method} privacy argument(s) {sorted(bad)}; known: {sorted(PRIVACY_DEFAULTS[method])}"
        )
    args = privacy_args(privacy)
    try:
        problems = _percentile_problems(args) if method == "percentile" else _svt_problems(args)
    except ValueError as exc:
        raise ConfigError(f"{where}: {method} privacy {exc}") from None
    for refused, text in problems:
        if refused:
            raise ConfigError(f"{where}: {method} privacy {text}; see README, 'Privacy filters'")
    for _, text in problems:
        if text not in _WARNED:
            _WARNED.add(text)
            warn(f"{where}: {method} privacy {text}")


def _number(args: Mapping[str, Any], key: str) -> float:
    value = args[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
        raise ValueError(f"argument {key} must be a finite number, got {value!r}")
    return float(value)


def _percentile_problems(args: Mapping[str, Any]) -> list[tuple[bool, str]]:
    """(refused, text) for each problem of a percentile setting."""
    p, gamma = _number(args, "percentile"), _number(args, "gamma")
    if not 0 <= p <= 100 or gamma <= 0:
        return [
            (
                True,
                f"percentile={p:g}, gamma={gamma:g}: NVFlare would send the update UNFILTERED "
                "(it needs 0 <= percentile <= 100 and gamma > 0)",
            )
        ]
    out = []
    if p >= REFUSED_PERCENTILE:
        out.append(
            (
                True,
                f"percentile={p:g} withholds {p:g} % of every update's changes: the head rows, whose changes "
                "are small beside the feature extractor's largest, lose most or all of theirs (measured: 18 % "
                f"kept at 95, none at 99); use a percentile below {REFUSED_PERCENTILE}",
            )
        )
    elif p > WARNED_PERCENTILE:
        out.append(
            (
                False,
                f"percentile={p:g} withholds {p:g} % of every update: the head rows lose most of their "
                "change (measured cosine 0.46 at 80)",
            )
        )
    out.extend(_gamma_problems(gamma))
    return out


def _svt_problems(args: Mapping[str, Any]) -> list[tuple[bool, str]]:
    """(refused, text) for each problem of an SVT setting."""
    fraction, noise_var, gamma = _number(args, "fraction"), _number(args, "noise_var"), _number(args, "gamma")
    for key in ("epsilon", "tau"):
        _number(args, key)
    if not 0 < fraction <= 1 or args["epsilon"] <= 0 or noise_var <= 0 or gamma <= 0:
        return [
            (
                True,
                "needs 0 < fraction <= 1 and epsilon, noise_var, gamma > 0 (NVFlare fails mid-round or sends nothing)",
            )
        ]
    out = []
    if noise_var <= REFUSED_NOISE_VAR:
        out.append(
            (
                True,
                f"noise_var={noise_var:g} adds noise of scale 2*gamma/noise_var = {2 / noise_var:g} x gamma, "
                "larger than any value it protects: every update is destroyed (measured cosine 0.002 at "
                f"NVFlare's defaults); use noise_var > {REFUSED_NOISE_VAR}",
            )
        )
    elif noise_var < WARNED_NOISE_VAR:
        out.append(
            (
                False,
                f"noise_var={noise_var:g}: the noise is {2 / noise_var:.0%} of gamma; updates lose much "
                "of their direction",
            )
        )
    elif 2 * gamma / noise_var > WARNED_NOISE_SCALE:
        out.append(
            (
                False,
                f"gamma={gamma:g}, noise_var={noise_var:g}: release noise of scale 2*gamma/noise_var = "
                f"{2 * gamma / noise_var:.2g} per entry, as large as a round's changes (measured at 2e-4: "
                f"the weights' cosine 0.63); raise noise_var to at least {2 * gamma / WARNED_NOISE_SCALE:g}",
            )
        )
    if fraction < WARNED_FRACTION:
        out.append(
            (
                False,
                f"fraction={fraction:g} sends {fraction:.0%} of the entries: each round moves the model "
                f"about that much (measured at 0.5: cosine 0.71, mean AUROC 0.08 below the unfiltered run)",
            )
        )
    return out + _gamma_problems(gamma)


def _gamma_problems(gamma: float) -> list[tuple[bool, str]]:
    """(refused, text) for a clipping bound that loses the BatchNorm statistics' changes."""
    if gamma < REFUSED_GAMMA:
        return [
            (
                True,
                f"gamma={gamma:g} clips every change to +-{gamma:g}: the BatchNorm running statistics, whose "
                "changes are far larger than the weights', keep a fraction of theirs (measured at 0.1: 25 % of "
                "their norm; the model stayed at chance, mean AUROC 0.44 against 0.63 unfiltered); use "
                f"gamma >= {WARNED_GAMMA:g} (default 1)",
            )
        ]
    if gamma < WARNED_GAMMA:
        return [
            (
                False,
                f"gamma={gamma:g} clips the BatchNorm running statistics' changes (measured at 0.5: 86 % "
                f"of their norm); use gamma >= {WARNED_GAMMA:g}",
            )
        ]
    return []


def part_of(key: str, head_prefix: str) -> str:
    """Which :data:`PARTS` entry a parameter belongs to.

    Args:
        key: the state-dict name.
        head_prefix: state-dict prefix of the head (:data:`cxrfl.nn.models.HEAD_PREFIX`).
    """
    if key.startswith(head_prefix):
        return "head"
    return "batchnorm_statistics" if key.endswith(_STATISTICS) else "feature_extractor"


def fidelity(
    result: Mapping[str, Any], received: Mapping[str, Any], sent: Mapping[str, Any], head_prefix: str
) -> dict[str, dict[str, float | int | None]]:
    """How much of a site's update a filter let through, per part (:data:`PARTS`).

    The true update is ``result - received``, the sent one ``sent - received`` (a parameter
    without a received value: from zero; one missing from ``sent``: no change sent). Integer
    buffers are left out.

    Args:
        result: the site's parameters before the filter.
        received: what it received for the task.
        sent: the parameters after the filter.
        head_prefix: state-dict prefix of the head (:data:`cxrfl.nn.models.HEAD_PREFIX`).

    Returns:
        part -> ``cosine`` (of the sent with the true update; None when either is zero),
        ``relative_norm`` (|sent| / |true|; None when nothing changed), ``kept`` (share of the
        changed entries that are sent non-zero) and ``entries`` (changed entries); parts with no
        floating-point entry are absent.
    """
    sums: dict[str, np.ndarray] = {}
    for key, value in result.items():
        true = np.asarray(value)
        if not np.issubdtype(true.dtype, np.floating):
            continue
        ref = np.asarray(received[key], np.float64) if key in received else 0.0
        t = (true.astype(np.float64) - ref).ravel()
        s = (np.asarray(sent[key], np.float64) - ref).ravel() if key in sent else np.zeros_like(t)  # absent: not sent
        changed = t != 0
        part = sums.setdefault(part_of(key, head_prefix), np.zeros(5))
        part += (float(t @ s), float(t @ t), float(s @ s), int(changed.sum()), int((changed & (s != 0)).sum()))
    out: dict[str, dict[str, float | int | None]] = {}
    for part, (ts, tt, ss, n_changed, n_kept) in sums.items():
        out[part] = {
            "cosine": float(ts / np.sqrt(tt * ss)) if tt > 0 and ss > 0 else None,
            "relative_norm": float(np.sqrt(ss / tt)) if tt > 0 else None,
            "kept": n_kept / n_changed if n_changed else None,
            "entries": int(n_changed),
        }
    return out


def destroyed(report: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The parts of a :func:`fidelity` report that changed but whose sent update is destroyed
    (cosine below :data:`MIN_COSINE`, norm below :data:`MIN_RELATIVE_NORM` of the true one's, or nothing sent).

    Args:
        report: from :func:`fidelity`.
    """
    return [
        p
        for p, m in report.items()
        if m["entries"] and (m["cosine"] is None or m["cosine"] < MIN_COSINE or m["relative_norm"] < MIN_RELATIVE_NORM)
    ]
