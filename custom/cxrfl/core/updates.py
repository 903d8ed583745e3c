"""Checks of one site's update before it is aggregated: fields, classes, shapes, finite values, variances.

Part of the shared federated core (:mod:`cxrfl.core`): framework-free, no NVFlare import. An update
is a mapping::

    {"site": "hospital-a",                  # unique per round
     "classes": ["Atelectasis", "Edema"],   # row order of this site's head
     "params": {name: array},               # incl. classifier.weight [K, N], classifier.bias [K]
     "num_samples": 1234}                   # positive int (weights with weighting="samples")

The head is optional: with ``head_prefix=None`` the update has no head (FedFew's rounds, the
personalized ``local`` mode): every key is checked like any other, ``classes`` is
neither needed nor read, and the parsed update has no classes.

Every value must be a real number array: floating point, or integer for buffers (BatchNorm's
``num_batches_tracked``); head values floating point. With expected dtypes (the previous global
model's, per key) a value must have exactly its key's dtype, so float64, int64 or bool where float32 is
expected is rejected; complex, bool, object and string arrays never pass. :class:`SampleCounts`
bounds ``num_samples`` (a hard cap, and the count a site reported first). BatchNorm running variances
(``*.running_var``) must not be negative.

Finiteness checks (:func:`first_nonfinite`, and the sums of
:class:`cxrfl.core.running_sum.RunningSum`) are one cheap pass: small arrays are concatenated
and summed together, large ones summed one by one; only a sum that is not finite (a NaN/Inf, or
finite values whose sum overflows) leads to the exact element-wise check, so the verdict and the
key named are those of checking every array on its own.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cxrfl.errors import UpdateRejected
from cxrfl.nn.models import HEAD_PREFIX

Array = np.ndarray | torch.Tensor
"""A parameter value: numpy array or torch tensor."""

UPDATE_FIELDS = ("site", "classes", "params", "num_samples")
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
INT_DTYPES = frozenset({"uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64"})
MAX_NUM_SAMPLES = 10_000_000
"""Default hard cap on a site's ``num_samples`` (the largest public chest X-ray sets hold < 10**6 images)."""
RUNNING_VAR = ".running_var"
"""Suffix of a BatchNorm layer's running-variance buffer in a torch state dict (checked: never negative)."""
COUNT_TOLERANCE = 0.01
"""Relative change of a site's ``num_samples`` from its first report that is still accepted (splits are fixed)."""


@dataclass(frozen=True)
class ParsedUpdate:
    """One site's update after :func:`parse_update`: checked, its parameters without dropped keys."""

    site: str
    classes: list[str]
    params: dict[str, Array]
    num_samples: int


def shape_of(v: Array) -> tuple[int, ...]:
    """The shape as a tuple of Python ints."""
    return tuple(int(d) for d in v.shape)


def dtype_name(v: Array) -> str:
    """The dtype's name, the same for numpy and torch (``float32``, ``int64``, ``complex64``, ``object`` ...)."""
    return v.dtype.name if isinstance(v, np.ndarray) else str(v.dtype).removeprefix("torch.")


def expected_dtypes(params: Mapping[str, Array]) -> dict[str, str]:
    """name -> dtype name of a model's arrays (what :func:`validate_update` compares with)."""
    return {k: dtype_name(v) for k, v in params.items() if isinstance(v, (np.ndarray, torch.Tensor))}


def as_tensor(v: Array) -> torch.Tensor:
    """A CPU tensor; numpy arrays are wrapped without a copy (never written to)."""
    if isinstance(v, torch.Tensor):
        return v if v.is_cpu and not v.requires_grad else v.detach().cpu()
    v = v if v.flags.c_contiguous else np.ascontiguousarray(v)
    if v.flags.writeable:
        return torch.from_numpy(v)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(v)


def as_numpy(v: Array) -> np.ndarray:
    """A numpy array (tensors moved to the CPU)."""
    return v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)


def all_finite(t: torch.Tensor) -> bool:
    """True when no element is NaN/Inf (a sum first: one cheap pass in the common case)."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())


SMALL = 4096  # elements: arrays below this are concatenated and checked with one sum


def first_nonfinite(named: Iterable[tuple[str, Array]]) -> str | None:
    """The first name (in order) whose array holds a NaN/Inf, else None.

    One cheap pass: one sum per large floating array and one per group of small ones (grouped
    by kind, device and dtype, concatenated); when any of those sums is not finite, every array
    is checked on its own, in order, exactly (a sum of large finite values can overflow).
    """
    named = list(named)
    small_np: dict[np.dtype, list[np.ndarray]] = {}
    small_torch: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    suspect = False
    for _, v in named:
        if isinstance(v, np.ndarray):
            if v.dtype.kind != "f":
                continue
            if v.size < SMALL:
                small_np.setdefault(v.dtype, []).append(v)
                continue
        elif isinstance(v, torch.Tensor):
            if not v.is_floating_point():
                continue
            if v.numel() < SMALL:
                small_torch.setdefault((v.device, v.dtype), []).append(v.detach().reshape(-1))
                continue
        if not math.isfinite(float(as_tensor(v).sum())):
            suspect = True
            break
    if not suspect:
        sums = [np.concatenate(parts, axis=None).sum() for parts in small_np.values()]  # axis=None: flattened
        sums += [torch.cat(parts).sum() for parts in small_torch.values()]
        suspect = not all(math.isfinite(float(x)) for x in sums)
    if not suspect:
        return None
    return next((k for k, v in named if not all_finite(as_tensor(v))), None)


class _Shapes(dict):
    """name -> shape as a tuple of Python ints (what :func:`normalize_shapes` returns)."""


def normalize_shapes(shapes: Mapping[str, Sequence[int]]) -> Mapping[str, tuple[int, ...]]:
    """``shapes`` with every shape as a tuple of ints; pass the result to :func:`validate_update`
    for many updates to skip this conversion on each call."""
    if isinstance(shapes, _Shapes):
        return shapes
    return _Shapes((k, tuple(map(int, s))) for k, s in shapes.items())


def unique_names(names: Iterable[str], what: str) -> list[str]:
    """``names`` as a list; ValueError for empty, non-text or duplicate names (``what`` names the list)."""
    names = list(names)
    if not all(isinstance(c, str) and c for c in names):
        raise ValueError(f"{what} must be non-empty strings, got {names!r}")
    dup = sorted({c for c in names if names.count(c) > 1})
    if dup:
        raise ValueError(f"{what} has duplicate names {dup}")
    return names


def _listing(keys: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def parse_update(
    update: Mapping[str, Any],
    *,
    expected_shapes: Mapping[str, tuple[int, ...]] | None,
    head_prefix: str | None,
    announced_classes: Sequence[str] | None,
    check_finite: bool,
    drop: frozenset[str] = frozenset(),
    dtypes: Mapping[str, str] | None = None,
) -> ParsedUpdate:
    """The checks of :func:`validate_update`, returning the parsed update.

    Args:
        update: the mapping described in the module docstring.
        expected_shapes: as for :func:`validate_update` (already normalized).
        head_prefix: state-dict prefix of the head; None: the update has no head (``classes`` not read).
        announced_classes: the classes this site may send rows for (None: any).
        check_finite: check every value for NaN/Inf.
        drop: keys left out of the parsed parameters (local BatchNorm under FedBN).
        dtypes: name -> the dtype each value must have (:func:`expected_dtypes`; None: any real type).

    Raises:
        UpdateRejected: ``"site <site>: <reason>"``.
    """
    if not isinstance(update, Mapping):
        raise UpdateRejected(f"site ?: the update is a {type(update).__name__}, not a mapping")
    site = update.get("site")
    label = site if isinstance(site, str) and site else repr(site)
    try:
        missing = [f for f in UPDATE_FIELDS if f not in update and (head_prefix is not None or f != "classes")]
        if missing:
            raise _Invalid(f"missing field(s) {missing}")
        if not isinstance(site, str) or not site:
            raise _Invalid("'site' must be a non-empty string")
        classes = _classes(update["classes"], announced_classes) if head_prefix is not None else []
        n = update["num_samples"]
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n <= 0:
            raise _Invalid(f"num_samples must be a positive integer, got {n!r}")
        params = _params(update["params"], expected_shapes, head_prefix, drop, dtypes or {})
        if head_prefix is not None:
            _check_head(params, len(classes), expected_shapes, head_prefix)
        bad = first_nonfinite(params.items()) if check_finite else None
        if bad is not None:
            raise _Invalid(f"non-finite values (NaN or Inf) in {bad!r}")
    except _Invalid as exc:
        raise UpdateRejected(f"site {label}: {exc}") from None
    return ParsedUpdate(site, classes, params, int(n))


class _Invalid(Exception):
    """Why an update is rejected (the site's name is added by :func:`parse_update`)."""


def _classes(classes: Any, announced: Sequence[str] | None) -> list[str]:
    """The update's class names, checked (non-empty, unique, announced)."""
    if isinstance(classes, (str, bytes)) or not isinstance(classes, Sequence):
        raise _Invalid(f"'classes' must be a list of class names, got {type(classes).__name__}")
    classes = list(classes)
    if not classes:
        raise _Invalid("'classes' is empty")
    if not all(isinstance(c, str) and c for c in classes):
        raise _Invalid(f"class names must be non-empty strings, got {classes!r}")
    dup = sorted({c for c in classes if classes.count(c) > 1})
    if dup:
        raise _Invalid(f"duplicate class names {dup}")
    if announced is not None:
        allowed = set(announced)
        unannounced = [c for c in classes if c not in allowed]
        if unannounced:
            raise _Invalid(f"sent rows for class(es) {unannounced} it never announced")
    return classes


def _params(
    raw: Any,
    expected_shapes: Mapping[str, tuple[int, ...]] | None,
    head_prefix: str | None,
    drop: frozenset[str],
    dtypes: Mapping[str, str],
) -> dict[str, Array]:
    """The update's parameters without ``drop``, checked: names, value kinds and dtypes, shapes (the head's
    only in :func:`_check_head`)."""
    if not isinstance(raw, Mapping):
        raise _Invalid(f"'params' must be a mapping of name -> array, got {type(raw).__name__}")
    params = {k: v for k, v in raw.items() if k not in drop} if drop else dict(raw)
    head = (head_prefix + "weight", head_prefix + "bias") if head_prefix is not None else ()
    if head_prefix is not None:
        for key in head:
            if key not in params:
                raise _Invalid(f"missing head parameter {key!r}")
        odd_head = [k for k in params if k.startswith(head_prefix) and k not in head]
        if odd_head:
            raise _Invalid(f"unexpected head parameter(s) {_listing(odd_head)}")
    if expected_shapes is not None and params.keys() != expected_shapes.keys():  # names -> tuples of ints
        absent = [
            k
            for k in expected_shapes
            if k not in params and not (head_prefix is not None and k.startswith(head_prefix)) and k not in drop
        ]
        if absent:
            raise _Invalid(f"missing parameter(s) {_listing(absent)}")
        extra = [k for k in params if k not in expected_shapes and k not in head]
        if extra:
            raise _Invalid(f"unexpected parameter(s) {_listing(extra)}")
    for k, v in params.items():  # one pass: the hot loop of a DenseNet update (~700 entries)
        if not isinstance(v, (np.ndarray, torch.Tensor)):
            raise _Invalid(f"value of {k!r} is a {type(v).__name__}, not a numpy array or torch tensor")
        _check_dtype(k, dtype_name(v), dtypes.get(k), k in head)
        if expected_shapes is not None and v.shape != expected_shapes.get(k, v.shape) and k not in head:
            raise _Invalid(f"parameter {k!r} has shape {shape_of(v)}, expected {expected_shapes[k]}")
        if k.endswith(RUNNING_VAR):
            _check_variance(k, v)
    return params


def _check_head(
    params: Mapping[str, Array],
    n_classes: int,
    expected_shapes: Mapping[str, tuple[int, ...]] | None,
    head_prefix: str,
) -> None:
    """One head row (weight and bias) per class, with the expected number of inputs."""
    wkey, bkey = head_prefix + "weight", head_prefix + "bias"
    w_shape, b_shape = shape_of(params[wkey]), shape_of(params[bkey])
    if len(w_shape) != 2 or w_shape[0] != n_classes:
        raise _Invalid(f"head weight {wkey!r} has shape {w_shape}, expected ({n_classes}, N): one row per class")
    if b_shape != (n_classes,):
        raise _Invalid(f"head bias {bkey!r} has shape {b_shape}, expected ({n_classes},)")
    n_in = (expected_shapes or {}).get(wkey, w_shape)[1:]
    if w_shape[1:] != n_in:
        raise _Invalid(f"head weight {wkey!r} has {w_shape[1]} inputs, expected {n_in[0]}")


def _check_variance(key: str, v: Array) -> None:
    """A BatchNorm running variance must not be negative: one negative entry makes that layer's output NaN
    in evaluation (its square root), at every site, in every later round. Each honest value is >= 0, so
    every aggregate of accepted updates (weighted mean, median, clipped deltas between the previous model
    and an update) is too; a flipped or scaled update usually is not (seen: one sign-flipped site among
    five made 26 layers' variances negative and every site's validation failed)."""
    low = float(v.min()) if math.prod(shape_of(v)) else 0.0
    if low < 0:
        raise _Invalid(f"BatchNorm running variance {key!r} has negative values (min {low:.4g}); a variance is >= 0")


def _check_dtype(key: str, name: str, want: str | None, head: bool) -> None:
    """A value's dtype: ``want`` exactly when given, else real floating point (integer allowed off the head)."""
    if want is not None:
        if name != want:
            raise _Invalid(f"parameter {key!r} has dtype {name}, expected {want}")
    elif name not in FLOAT_DTYPES and (head or name not in INT_DTYPES):
        kind = "real floating point" if head else "real floating point (integer for buffers)"
        raise _Invalid(f"parameter {key!r} has dtype {name}, expected {kind}")


def validate_update(
    update: Mapping[str, Any],
    *,
    expected_shapes: Mapping[str, tuple[int, ...]] | None = None,
    head_prefix: str | None = HEAD_PREFIX,
    announced_classes: Sequence[str] | None = None,
    check_finite: bool = True,
    dtypes: Mapping[str, str] | None = None,
) -> None:
    """Check one site's update before it is aggregated.

    Checks: the four fields are present (``classes`` only with a head); ``site`` a non-empty string;
    ``classes`` non-empty, unique, and (when ``announced_classes`` is given) all announced;
    ``num_samples`` a positive int; head weight [len(classes), N] and bias [len(classes)], no other
    head keys; every value a real number array (see the module docstring; exactly ``dtypes[key]``
    where given); with ``expected_shapes``: no missing or extra non-head keys, equal shapes, and the
    head's N; every value finite.

    Args:
        update: the mapping described in the module docstring.
        expected_shapes: name -> shape of the global model; head entries only fix N (validating
            many updates against the same shapes: pass :func:`normalize_shapes` of them once).
        head_prefix: state-dict prefix of the head; None: the update has no head (every key is checked
            against ``expected_shapes``; ``classes`` is not read).
        announced_classes: the classes this site announced (it may not send rows for others).
        check_finite: False leaves the NaN/Inf check to the caller (:meth:`RunningSum.add`
            with ``check_finite=True`` does it while summing, or :func:`first_nonfinite`).
        dtypes: name -> the dtype each value must have (:func:`expected_dtypes` of the previous
            global model); keys not in it only need a real type.

    Raises:
        UpdateRejected: ``"site <site>: <reason>"``.
    """
    if expected_shapes is not None:
        expected_shapes = normalize_shapes(expected_shapes)
    parse_update(
        update,
        expected_shapes=expected_shapes,
        head_prefix=head_prefix,
        announced_classes=announced_classes,
        check_finite=check_finite,
        dtypes=dtypes,
    )


def parse_round(
    updates: Iterable[Mapping[str, Any]],
    *,
    head_prefix: str | None,
    announced: Sequence[str] | None,
    check_finite: bool,
    drop: frozenset[str],
    dtypes: Mapping[str, str],
) -> list[ParsedUpdate]:
    """One round's updates, all at once: each checked (:func:`parse_update`) against
    ``dtypes`` and the first one's shapes and dtypes; one update per site.

    Args:
        updates: the round's update mappings (a one-shot iterator is read into a list).
        head_prefix: state-dict prefix of the head; None: updates have no head.
        announced: the classes any update may send head rows for (None: any).
        check_finite: check every value for NaN/Inf here.
        drop: keys left out of the parsed parameters (neither needed nor checked).
        dtypes: name -> the dtype each value must have (keys not in it: the first update's).

    Raises:
        ValueError: no updates.
        UpdateRejected: an update fails its checks, or two updates name the same site.
    """
    updates = updates if isinstance(updates, Sequence) else list(updates)
    if not updates:
        raise ValueError("no updates to aggregate")
    parsed: list[ParsedUpdate] = []
    expected: dict[str, tuple[int, ...]] | None = None
    for update in updates:
        p = parse_update(
            update,
            expected_shapes=expected,
            head_prefix=head_prefix,
            announced_classes=announced,
            check_finite=check_finite,
            drop=drop,
            dtypes=dtypes,
        )
        if p.site in {q.site for q in parsed}:
            raise UpdateRejected(f"site {p.site}: sent more than one update this round")
        parsed.append(p)
        if expected is None:
            expected = {k: shape_of(v) for k, v in p.params.items()}
            dtypes = {**expected_dtypes(p.params), **dtypes}
    return parsed


class SampleCounts:
    """The ``num_samples`` each site may report: at most ``cap``, and within ``tolerance`` (relative)
    of the count it reported first (its training split is fixed), so no site can outweigh the others
    by claiming more images, at once or later.

    Args:
        cap: the largest count accepted.
        tolerance: the relative change from the first report still accepted.
    """

    def __init__(self, cap: int = MAX_NUM_SAMPLES, tolerance: float = COUNT_TOLERANCE) -> None:
        self.cap = int(cap)
        self.tolerance = float(tolerance)
        self.first: dict[str, int] = {}

    def check(self, site: str, n: Any) -> None:
        """Raise :class:`UpdateRejected` for a count above the cap or off the site's first one (nothing is noted).

        Args:
            site: the site.
            n: the count it reports now (checked to be a positive int by :func:`validate_update`).
        """
        if not isinstance(n, numbers.Integral):
            return  # not a count at all: the update's own checks reject it
        count = int(n)
        if count > self.cap:
            raise UpdateRejected(f"site {site}: num_samples {count} is above the cap max_num_samples={self.cap}")
        first = self.first.get(site)
        if first is not None and abs(count - first) > self.tolerance * first:
            raise UpdateRejected(f"site {site}: num_samples changed from {first} to {count} (its split is fixed)")

    def note(self, site: str, n: int) -> None:
        """Keep the count of an accepted result (the first one of each site only).

        Args:
            site: the site.
            n: its accepted count.
        """
        self.first.setdefault(site, int(n))
