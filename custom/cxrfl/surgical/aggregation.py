"""Surgical aggregation: FedAvg of the feature extractor, class-wise averaging of the head.

Framework-free (no NVFlare import): parameters are numpy arrays or torch tensors and come back
as the same kind (torch results are on the CPU).

Each update is a mapping::

    {"site": "hospital-a",                  # unique per round
     "classes": ["Atelectasis", "Edema"],   # row order of this site's head
     "params": {name: array},               # incl. classifier.weight [K, N], classifier.bias [K]
     "num_samples": 1234}                   # positive int (weights with weighting="samples")

Numerics of the default (mean) path: one pass over the sites, adding each site's tensors times
its weight into one running sum per key (float32, float64 for float64 inputs; small arrays are
added as one flat array per dtype), then dividing by the total weight, as NVFlare's FedAvg
does; the extra memory is about one model; non-finite inputs are detected on those sums
(NaN/Inf propagate) and only then traced back to the site. Integer buffers (BatchNorm's
``num_batches_tracked``) get the weighted mean rounded to the nearest integer, in their dtype.

Finiteness checks (:func:`validate_update`, the sums above) are one cheap pass: small arrays are
concatenated and summed together, large ones summed one by one; only a sum that is not finite
(a NaN/Inf, or finite values whose sum overflows) leads to the exact element-wise check, so the
verdict and the key named are those of checking every array on its own.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import torch

from cxrfl.errors import UpdateRejected

Array = Union[np.ndarray, torch.Tensor]

HEAD_PREFIX = "classifier."
WEIGHTINGS = ("uniform", "samples")
BATCHNORM_MODES = ("fedavg", "fedbn", "fedbn+")
ROBUST_MODES = (None, "median", "clip")
_FIELDS = ("site", "classes", "params", "num_samples")


@dataclass(frozen=True)
class _Update:
    site: str
    classes: list[str]
    params: dict[str, Array]
    num_samples: int


def _shape(v: Array) -> tuple[int, ...]:
    return tuple(int(d) for d in v.shape)


def _tensor(v: Array) -> torch.Tensor:
    """A CPU tensor; numpy arrays are wrapped without a copy (never written to)."""
    if isinstance(v, torch.Tensor):
        return v if v.is_cpu and not v.requires_grad else v.detach().cpu()
    v = v if v.flags.c_contiguous else np.ascontiguousarray(v)
    if v.flags.writeable:
        return torch.from_numpy(v)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(v)


def _numpy(v: Array) -> np.ndarray:
    return v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)


def _to_kind(v: Array, as_numpy: bool) -> Array:
    if as_numpy:
        return _numpy(v)
    return v if isinstance(v, torch.Tensor) else _tensor(v)


def _all_finite(t: torch.Tensor) -> bool:
    """True when no element is NaN/Inf (a sum first: one cheap pass in the common case)."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())


_SMALL = 4096  # elements: arrays below this are concatenated and checked with one sum


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
            if v.size < _SMALL:
                small_np.setdefault(v.dtype, []).append(v)
                continue
        elif isinstance(v, torch.Tensor):
            if not v.is_floating_point():
                continue
            if v.numel() < _SMALL:
                small_torch.setdefault((v.device, v.dtype), []).append(v.detach().reshape(-1))
                continue
        if not math.isfinite(float(_tensor(v).sum())):
            suspect = True
            break
    if not suspect:
        sums = [np.concatenate(parts, axis=None).sum() for parts in small_np.values()]  # axis=None: flattened
        sums += [torch.cat(parts).sum() for parts in small_torch.values()]
        suspect = not all(math.isfinite(float(x)) for x in sums)
    if not suspect:
        return None
    return next((k for k, v in named if not _all_finite(_tensor(v))), None)


class _Shapes(dict):
    """name -> shape as a tuple of Python ints (what :func:`normalize_shapes` returns)."""


def normalize_shapes(shapes: Mapping[str, Sequence[int]]) -> Mapping[str, tuple[int, ...]]:
    """``shapes`` with every shape as a tuple of ints; pass the result to :func:`validate_update`
    for many updates to skip this conversion on each call."""
    if isinstance(shapes, _Shapes):
        return shapes
    return _Shapes((k, tuple(map(int, s))) for k, s in shapes.items())


def _unique_names(names: Iterable[str], what: str) -> list[str]:
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


def _check_update(
    update: Mapping[str, Any],
    *,
    expected_shapes: Mapping[str, tuple[int, ...]] | None,
    head_prefix: str,
    announced_classes: Sequence[str] | None,
    check_finite: bool,
    drop: frozenset[str] = frozenset(),
) -> _Update:
    """validate_update's checks; returns the parsed update without the ``drop`` keys."""
    if not isinstance(update, Mapping):
        raise UpdateRejected(f"site ?: the update is a {type(update).__name__}, not a mapping")
    site = update.get("site")
    label = site if isinstance(site, str) and site else repr(site)

    def reject(reason: str) -> UpdateRejected:
        return UpdateRejected(f"site {label}: {reason}")

    missing = [f for f in _FIELDS if f not in update]
    if missing:
        raise reject(f"missing field(s) {missing}")
    if not isinstance(site, str) or not site:
        raise reject("'site' must be a non-empty string")
    classes = update["classes"]
    if isinstance(classes, (str, bytes)) or not isinstance(classes, Sequence):
        raise reject(f"'classes' must be a list of class names, got {type(classes).__name__}")
    classes = list(classes)
    if not classes:
        raise reject("'classes' is empty")
    if not all(isinstance(c, str) and c for c in classes):
        raise reject(f"class names must be non-empty strings, got {classes!r}")
    dup = sorted({c for c in classes if classes.count(c) > 1})
    if dup:
        raise reject(f"duplicate class names {dup}")
    if announced_classes is not None:
        allowed = set(announced_classes)
        unannounced = [c for c in classes if c not in allowed]
        if unannounced:
            raise reject(f"sent rows for class(es) {unannounced} it never announced")
    n = update["num_samples"]
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n <= 0:
        raise reject(f"num_samples must be a positive integer, got {n!r}")
    raw = update["params"]
    if not isinstance(raw, Mapping):
        raise reject(f"'params' must be a mapping of name -> array, got {type(raw).__name__}")
    params = {k: v for k, v in raw.items() if k not in drop} if drop else dict(raw)
    wkey, bkey = head_prefix + "weight", head_prefix + "bias"
    for key in (wkey, bkey):
        if key not in params:
            raise reject(f"missing head parameter {key!r}")
    odd_head = [k for k in params if k.startswith(head_prefix) and k not in (wkey, bkey)]
    if odd_head:
        raise reject(f"unexpected head parameter(s) {_listing(odd_head)}")
    if expected_shapes is not None and params.keys() != expected_shapes.keys():  # names -> tuples of ints
        absent = [k for k in expected_shapes if k not in params and not k.startswith(head_prefix) and k not in drop]
        if absent:
            raise reject(f"missing parameter(s) {_listing(absent)}")
        extra = [k for k in params if k not in expected_shapes and k not in (wkey, bkey)]
        if extra:
            raise reject(f"unexpected parameter(s) {_listing(extra)}")
    for k, v in params.items():  # one pass: the hot loop of a DenseNet update (~700 entries)
        if not isinstance(v, (np.ndarray, torch.Tensor)):
            raise reject(f"value of {k!r} is a {type(v).__name__}, not a numpy array or torch tensor")
        if expected_shapes is not None and v.shape != expected_shapes.get(k, v.shape) and k not in (wkey, bkey):
            raise reject(f"parameter {k!r} has shape {_shape(v)}, expected {expected_shapes[k]}")
    w_shape, b_shape = _shape(params[wkey]), _shape(params[bkey])
    if len(w_shape) != 2 or w_shape[0] != len(classes):
        raise reject(f"head weight {wkey!r} has shape {w_shape}, expected ({len(classes)}, N): one row per class")
    if b_shape != (len(classes),):
        raise reject(f"head bias {bkey!r} has shape {b_shape}, expected ({len(classes)},)")
    n_in = (expected_shapes or {}).get(wkey, w_shape)[1:]
    if w_shape[1:] != n_in:
        raise reject(f"head weight {wkey!r} has {w_shape[1]} inputs, expected {n_in[0]}")
    if check_finite:
        bad = first_nonfinite(params.items())
        if bad is not None:
            raise reject(f"non-finite values (NaN or Inf) in {bad!r}")
    return _Update(site, classes, params, int(n))


def validate_update(
    update: Mapping[str, Any],
    *,
    expected_shapes: Mapping[str, tuple[int, ...]] | None = None,
    head_prefix: str = HEAD_PREFIX,
    announced_classes: Sequence[str] | None = None,
    check_finite: bool = True,
) -> None:
    """Check one site's update before it is aggregated.

    Checks: the four fields are present; ``site`` a non-empty string; ``classes`` non-empty,
    unique, and (when ``announced_classes`` is given) all announced; ``num_samples`` a positive
    int; head weight [len(classes), N] and bias [len(classes)], no other head keys; with
    ``expected_shapes``: no missing or extra non-head keys, equal shapes, and the head's N; every
    value finite.

    Args:
        update: the mapping described in the module docstring.
        expected_shapes: name -> shape of the global model; head entries only fix N (validating
            many updates against the same shapes: pass :func:`normalize_shapes` of them once).
        head_prefix: state-dict prefix of the head.
        announced_classes: the classes this site announced (it may not send rows for others).
        check_finite: False leaves the NaN/Inf check to the caller (:meth:`RunningSum.add`
            with ``check_finite=True`` does it while summing, or :func:`first_nonfinite`).

    Raises:
        UpdateRejected: ``"site <site>: <reason>"``.
    """
    if expected_shapes is not None:
        expected_shapes = normalize_shapes(expected_shapes)
    _check_update(
        update,
        expected_shapes=expected_shapes,
        head_prefix=head_prefix,
        announced_classes=announced_classes,
        check_finite=check_finite,
    )


def _check_options(
    weighting: str, batchnorm: str, robust: str | None, clip_norm: float | None, reference: Any
) -> None:
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {list(WEIGHTINGS)}, got {weighting!r}")
    if batchnorm not in BATCHNORM_MODES:
        raise ValueError(f"batchnorm must be one of {list(BATCHNORM_MODES)}, got {batchnorm!r}")
    if robust not in ROBUST_MODES:
        raise ValueError(f"robust must be one of {list(ROBUST_MODES)}, got {robust!r}")
    if robust == "median" and weighting != "uniform":
        raise ValueError("robust='median' is an unweighted median; use weighting='uniform'")
    if robust != "clip" and clip_norm is not None:
        raise ValueError("clip_norm is only used with robust='clip'")
    if robust == "clip":
        if isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float)) or not 0 < clip_norm < math.inf:
            raise ValueError(f"robust='clip' needs a positive clip_norm, got {clip_norm!r}")
        if reference is None:
            raise ValueError("robust='clip' needs reference= (the previous global params)")


def _site_weights(parsed: Sequence[_Update], weighting: str) -> list[float]:
    return [float(p.num_samples) if weighting == "samples" else 1.0 for p in parsed]


def _clip_scale(p: _Update, keys: Sequence[str], ref: Mapping[str, torch.Tensor], clip_norm: float) -> float:
    """Factor that brings the site's non-head update (params - reference) to norm <= clip_norm."""
    sq = 0.0
    for k in keys:
        t = _tensor(p.params[k])
        if t.is_floating_point():
            part = float(torch.linalg.vector_norm(t - ref[k], dtype=torch.float64)) ** 2
            if not math.isfinite(part):
                raise UpdateRejected(f"site {p.site}: non-finite values (NaN or Inf) in {k!r}")
            sq += part
    norm = math.sqrt(sq)
    return min(1.0, clip_norm / norm) if norm > 0 else 1.0


def _raise_for_bad_key(key: str, parsed: Sequence[_Update]) -> None:
    """Name the site behind a non-finite aggregate of ``key``."""
    bad = [p.site for p in parsed if not _all_finite(_tensor(p.params[key]))]
    if not bad:
        raise ValueError(f"the mean of {key!r} is not finite: values at the limit of the float range")
    also = f" (also sites {bad[1:]})" if len(bad) > 1 else ""
    raise UpdateRejected(f"site {bad[0]}: non-finite values (NaN or Inf) in {key!r}{also}")


def _flat(values: Sequence[Array]) -> torch.Tensor:
    """The arrays back to back as one 1-d CPU tensor (one copy of small arrays)."""
    if all(isinstance(v, np.ndarray) for v in values):
        return torch.from_numpy(np.concatenate(values, axis=None))  # axis=None: flattened
    return torch.cat([_tensor(v).reshape(-1) for v in values])


class RunningSum:
    """Weighted sum of the non-head parameters, fed one update at a time (streaming FedAvg).

    Large arrays are added one by one; small ones (BatchNorm vectors and counters, biases) as one
    flat array per dtype, so a DenseNet update is about 130 additions instead of 730. Floating
    keys are summed in float32 (float64 for float64 inputs), integer keys in float64.

    Args:
        keys: the parameter names to sum, in output order.
        head_prefix: state-dict prefix of the head (its arrays are checked, never summed).
    """

    def __init__(self, keys: Sequence[str], head_prefix: str = HEAD_PREFIX) -> None:
        self.keys = list(keys)
        self.head_prefix = head_prefix
        self.added: list[tuple[str, float]] = []  # (site, weight of its floating keys)
        self.usable = True  # False after an update was only partly added
        self._items: list[tuple[list[str], bool, bool]] | None = None  # (keys, flat, floating)
        self._shapes: dict[str, tuple[torch.Size, int]] = {}
        self._accs: list[torch.Tensor] = []

    def _plan(self, params: Mapping[str, Array]) -> None:
        firsts = {k: _tensor(params[k]) for k in self.keys}
        self._shapes = {k: (t.shape, t.numel()) for k, t in firsts.items()}
        items: list[tuple[list[str], bool, bool]] = []
        small: dict[torch.dtype, list[str]] = {}
        for k, t in firsts.items():
            if t.numel() < _SMALL:
                small.setdefault(t.dtype, []).append(k)
            else:
                items.append(([k], False, t.is_floating_point()))
        items += [(ks, True, dtype.is_floating_point) for dtype, ks in small.items()]
        self._items = items
        self._dtypes = {k: t.dtype for k, t in firsts.items()}

    def add(self, site: str, params: Mapping[str, Array], weight: float, *, int_weight: float | None = None,
            check_finite: bool = False) -> str | None:
        """Add ``weight`` x the update's arrays (``int_weight`` for integer buffers, default ``weight``).

        With ``check_finite``, every array of ``params`` (head and keys not summed included) is
        checked, each summed array just before it is added, while it is in the cache.

        Returns:
            None, or the first key in ``params`` order holding a NaN/Inf; the update is then
            not (or only partly) added and this sum is no longer :attr:`usable`.
        """
        if self._items is None:
            self._plan(params)
        assert self._items is not None
        if check_finite:
            rest = [(k, v) for k, v in params.items() if k not in self._shapes]
            if first_nonfinite(rest) is not None:  # nothing added yet
                return first_nonfinite(params.items())
        iw = weight if int_weight is None else int_weight
        first = not self._accs
        for i, (ks, flat, is_float) in enumerate(self._items):
            x = _flat([params[k] for k in ks]) if flat else _tensor(params[ks[0]])
            if check_finite and is_float and not math.isfinite(float(x.sum())):
                bad = first_nonfinite(params.items())  # exact, in order (the sum may just overflow)
                if bad is not None:
                    self.usable = False
                    return bad
            w = weight if is_float else iw
            if first:
                acc_dtype = torch.float64 if x.dtype == torch.float64 or not is_float else torch.float32
                self._accs.append(x.to(acc_dtype) * w)
            else:
                self._accs[i].add_(x, alpha=w)
        self.added.append((site, weight))
        return None

    def sums(self) -> dict[str, torch.Tensor]:
        """key -> the running sum (views into the flat sums for small keys)."""
        out: dict[str, torch.Tensor] = {}
        for (ks, flat, _), acc in zip(self._items or [], self._accs):
            if not flat:
                out[ks[0]] = acc
                continue
            parts = torch.split(acc, [self._shapes[k][1] for k in ks])
            out.update((k, part.view(self._shapes[k][0])) for k, part in zip(ks, parts))
        return out

    def dtype(self, key: str) -> torch.dtype:
        """The dtype of ``key`` in the first update added."""
        return self._dtypes[key]


def _mean_body(
    parsed: Sequence[_Update],
    keys: Sequence[str],
    weights: Sequence[float],
    ref: Mapping[str, torch.Tensor] | None,
    clip_norm: float | None,
    running: RunningSum | None = None,
) -> dict[str, torch.Tensor]:
    """(Weighted) mean of the non-head keys, streaming; with clip_norm, of clipped deltas.

    ``running``: these updates' sum, already accumulated (with these weights, no clipping).
    """
    total = sum(weights)
    clipping = clip_norm is not None and ref is not None
    if running is None:
        running = RunningSum(keys)
        for w, p in zip(weights, parsed):
            scale = _clip_scale(p, keys, ref, clip_norm) if clipping else 1.0
            running.add(p.site, p.params, w * scale, int_weight=w)
    out = running.sums()
    running.usable = False  # its sums become the mean, in place
    floats = [k for k in keys if running.dtype(k).is_floating_point]
    for k in keys:
        out[k].div_(total)
    if clipping:
        kept = 1.0 - sum(w for _, w in running.added) / total
        for k in floats:
            out[k].add_(ref[k], alpha=kept)  # = ref + sum_i c_i (x_i - ref), c_i = w_i scale_i / total
    bad = first_nonfinite((k, out[k]) for k in floats)
    if bad is not None:
        _raise_for_bad_key(bad, parsed)
    return {k: (out[k] if running.dtype(k).is_floating_point else torch.round(out[k])).to(running.dtype(k))
            for k in keys}


def _median_body(parsed: Sequence[_Update], keys: Sequence[str]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for k in keys:
        stack = np.stack([_numpy(p.params[k]) for p in parsed])
        med = np.median(stack, axis=0)
        dtype = stack.dtype
        out[k] = (np.rint(med) if not np.issubdtype(dtype, np.floating) else med).astype(dtype)
    return out


def _aggregate_head(
    parsed: Sequence[_Update],
    global_classes: Sequence[str],
    weights: Sequence[float],
    *,
    head_prefix: str,
    robust: str | None,
    clip_norm: float | None,
    ref_rows: dict[str, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Head row per global class from exactly the sites that have the class."""
    wkey, bkey = head_prefix + "weight", head_prefix + "bias"
    rows: dict[str, list[tuple[float, torch.Tensor]]] = {c: [] for c in global_classes}
    for w, p in zip(weights, parsed):
        W, b = _tensor(p.params[wkey]), _tensor(p.params[bkey])
        for key, t in ((wkey, W), (bkey, b)):
            if not _all_finite(t):
                raise UpdateRejected(f"site {p.site}: non-finite values (NaN or Inf) in {key!r}")
        site_rows = torch.cat([W, b[:, None]], dim=1).to(torch.float64)  # [K_site, N + 1]
        for j, c in enumerate(p.classes):
            rows[c].append((w, site_rows[j]))
    n_in = _shape(parsed[0].params[wkey])[1]
    merged = torch.empty(len(global_classes), n_in + 1, dtype=torch.float64)
    for i, c in enumerate(global_classes):
        contrib = rows[c]
        ref = ref_rows.get(c) if ref_rows is not None else None
        if not contrib:
            if ref is None:
                raise ValueError(
                    f"no site sent class {c!r}; pass reference= (the previous global params) to keep "
                    "its row, or leave it out of classes="
                )
            merged[i] = ref
        elif robust == "median":
            merged[i] = torch.from_numpy(np.median(np.stack([r.numpy() for _, r in contrib]), axis=0))
        else:
            total = sum(w for w, _ in contrib)
            if robust == "clip" and ref is not None and clip_norm is not None:
                delta = sum(
                    (w / total) * min(1.0, clip_norm / max(float(torch.linalg.vector_norm(r - ref)), 1e-300))
                    * (r - ref)
                    for w, r in contrib
                )
                merged[i] = ref + delta
            else:
                merged[i] = sum((w / total) * r for w, r in contrib)
    dtype = _tensor(parsed[0].params[wkey]).dtype
    return merged[:, :n_in].to(dtype), merged[:, n_in].to(dtype)


def _reference_tensors(
    reference: Mapping[str, Array],
    shapes: Mapping[str, tuple[int, ...]],
    classes: Sequence[str] | None,
    head_prefix: str,
    for_clip: bool,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """Reference body tensors (clipping only) and head rows per class (rows in ``classes`` order)."""
    body: dict[str, torch.Tensor] = {}
    wkey, bkey = head_prefix + "weight", head_prefix + "bias"
    for k, shape in shapes.items():
        if k in (wkey, bkey) or not for_clip:
            continue
        if k not in reference or _shape(reference[k]) != shape:
            found = _shape(reference[k]) if k in reference else "nothing"
            raise ValueError(f"reference must hold {k!r} with shape {shape}, found {found}")
        body[k] = _tensor(reference[k])
    has_head = wkey in reference and bkey in reference
    if for_clip and not has_head:
        raise ValueError(f"robust='clip' needs the reference head ({wkey!r}, {bkey!r})")
    if classes is None or not has_head:
        return body, None
    W, b = _tensor(reference[wkey]), _tensor(reference[bkey])
    want = (len(classes), shapes[wkey][1])
    if _shape(W) != want or _shape(b) != want[:1]:
        raise ValueError(
            f"reference head has shapes {_shape(W)} and {_shape(b)}; expected {want} and {want[:1]}: one row "
            "per entry of classes= (without classes=: per class of the sorted union of this round's sites)"
        )
    rows = torch.cat([W, b[:, None]], dim=1).to(torch.float64)
    return body, {c: rows[i] for i, c in enumerate(classes)}


def surgical_aggregate(
    updates: Iterable[Mapping[str, Any]],
    *,
    head_prefix: str = HEAD_PREFIX,
    weighting: str = "uniform",
    batchnorm: str = "fedavg",
    bn_keys: Iterable[str] = (),
    classes: Sequence[str] | None = None,
    robust: str | None = None,
    clip_norm: float | None = None,
    reference: Mapping[str, Array] | None = None,
    running: RunningSum | None = None,
) -> tuple[dict[str, Array], list[str]]:
    """Aggregate site updates whose heads cover different classes.

    Non-head keys: FedAvg (uniform mean, or weighted by ``num_samples``). Head row of class c:
    the (weighted) mean of the rows for c of exactly the sites that have c, so a class of one
    site keeps that site's row; with identical class sets everywhere this is FedAvg.

    Args:
        updates: site updates (see the module docstring); a one-shot iterator is read into a list.
        head_prefix: state-dict prefix of the head (``<prefix>weight`` [K, N], ``<prefix>bias`` [K]).
        weighting: ``uniform`` (the papers) or ``samples`` (weights = num_samples).
        batchnorm: ``fedavg`` (bn_keys averaged like the rest), ``fedbn`` (bn_keys left out of
            the result: sites keep their own) or ``fedbn+`` (left out too: sites keep them
            frozen at pretrained statistics). In both fedbn modes sites may omit bn_keys.
        bn_keys: state-dict names of BatchNorm entries (:func:`cxrfl.nn.models.batchnorm_keys`).
        classes: global class order; every site class must be in it. Default: sorted union.
        robust: None (mean), ``median`` (coordinate-wise, unweighted; head rows over the sites
            having the class) or ``clip`` (each site's ``params - reference`` clipped to L2 norm
            ``clip_norm`` before averaging: one norm over all float non-head keys, one per head
            row incl. its bias; the mean delta is added back to the reference).
        clip_norm: the clipping norm (robust='clip' only).
        reference: the previous global params, head rows in ``classes`` order (without
            ``classes``: in the order of the returned sorted union). Needed by robust='clip';
            with ``classes``, a class no site sent this round keeps its reference row.
        running: the non-head sum of exactly these updates, fed as they arrived (what
            :class:`cxrfl.fl.aggregator.SurgicalAggregator` does at accept time, so each update
            is read once); used only for the plain mean (``robust=None``) and when its sites,
            weights and keys match, else the mean is computed from the updates.

    Returns:
        (global params of the input kind, CPU for torch; global class names in head row order).

    Raises:
        UpdateRejected: an update fails :func:`validate_update` (incl. a class outside
            ``classes``), or two updates name the same site.
        ValueError: bad options, no updates, or a class of ``classes`` nobody sent and no reference.
    """
    _check_options(weighting, batchnorm, robust, clip_norm, reference)
    bn_keys = list(bn_keys)
    head_bn = [k for k in bn_keys if k.startswith(head_prefix)]
    if head_bn:
        raise ValueError(f"bn_keys may not include head parameters: {head_bn}")
    drop = frozenset(bn_keys) if batchnorm != "fedavg" else frozenset()
    order = _unique_names(classes, "classes") if classes is not None else None
    updates = updates if isinstance(updates, Sequence) else list(updates)
    if not updates:
        raise ValueError("no updates to aggregate")

    def parse(update: Mapping[str, Any], expected: dict[str, tuple[int, ...]] | None) -> _Update:
        return _check_update(
            update,
            expected_shapes=expected,
            head_prefix=head_prefix,
            announced_classes=order,
            check_finite=robust == "median",
            drop=drop,
        )

    first = parse(updates[0], None)
    expected = {k: _shape(v) for k, v in first.params.items()}
    parsed = [first]
    for update in updates[1:]:
        p = parse(update, expected)
        if p.site in {q.site for q in parsed}:
            raise UpdateRejected(f"site {p.site}: sent more than one update this round")
        parsed.append(p)
    global_classes = order if order is not None else sorted(set().union(*(p.classes for p in parsed)))
    wkey, bkey = head_prefix + "weight", head_prefix + "bias"
    keys = [k for k in parsed[0].params if not k.startswith(head_prefix)]
    weights = _site_weights(parsed, weighting)
    ref_body, ref_rows = (
        _reference_tensors(
            reference,
            expected,
            global_classes if order is not None or robust == "clip" else None,
            head_prefix,
            for_clip=robust == "clip",
        )
        if reference is not None
        else ({}, None)
    )

    body: Mapping[str, Array]
    if robust == "median":
        body = _median_body(parsed, keys)
    else:
        fits = (running is not None and running.usable and robust is None and running.keys == keys
                and running.added == [(p.site, w) for p, w in zip(parsed, weights)])
        body = _mean_body(parsed, keys, weights, ref_body or None, clip_norm, running if fits else None)
    head_w, head_b = _aggregate_head(
        parsed,
        global_classes,
        weights,
        head_prefix=head_prefix,
        robust=robust,
        clip_norm=clip_norm,
        ref_rows=ref_rows,
    )
    as_numpy = isinstance(parsed[0].params[wkey], np.ndarray)
    result: dict[str, Array] = {}
    for k in parsed[0].params:
        value = head_w if k == wkey else head_b if k == bkey else body[k]
        result[k] = _to_kind(value, as_numpy)
    return result, list(global_classes)


def site_payload(
    global_params: Mapping[str, Array],
    global_classes: Sequence[str],
    site_classes: Sequence[str],
    *,
    head_prefix: str = HEAD_PREFIX,
) -> dict[str, Array]:
    """What one site receives: every non-head parameter and the head rows of its own classes.

    Non-head values are the same objects as in ``global_params`` (not copies).

    Args:
        global_params: the aggregated parameters.
        global_classes: class names in the global head's row order.
        site_classes: the site's classes, in the row order the site's head uses.
        head_prefix: state-dict prefix of the head.

    Raises:
        ValueError: a site class the global model does not have, duplicates, or a head whose
            rows do not match ``global_classes``.
    """
    site_classes = _unique_names(site_classes, "site_classes")
    if not site_classes:
        raise ValueError("site_classes is empty")
    index = {c: i for i, c in enumerate(global_classes)}
    unknown = [c for c in site_classes if c not in index]
    if unknown:
        raise ValueError(f"class(es) {unknown} are not in the global model's classes {list(global_classes)}")
    wkey, bkey = head_prefix + "weight", head_prefix + "bias"
    odd = [k for k in global_params if k.startswith(head_prefix) and k not in (wkey, bkey)]
    if odd or wkey not in global_params or bkey not in global_params:
        raise ValueError(f"global params must hold exactly {wkey!r} and {bkey!r} under {head_prefix!r}")
    if _shape(global_params[wkey])[0] != len(index) or _shape(global_params[bkey]) != (len(index),):
        raise ValueError(
            f"the global head has {_shape(global_params[wkey])[0]} rows but {len(index)} global classes are named"
        )
    rows = [index[c] for c in site_classes]
    return {k: v[rows] if k in (wkey, bkey) else v for k, v in global_params.items()}
