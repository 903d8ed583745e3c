"""Streaming weighted sum of the parameters it is given: each site update is read once, as it arrives.

Part of the shared federated core (framework-free). Head-agnostic: it sums exactly the keys it is
given. Fed at accept time by :class:`cxrfl.core.streaming.StreamingFedAvg` and read by
:func:`cxrfl.core.fedavg.weighted_mean` for the plain mean.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from cxrfl.core.updates import SMALL, Array, as_tensor, first_nonfinite


def _flat(values: Sequence[Array]) -> torch.Tensor:
    """The arrays back to back as one 1-d CPU tensor (one copy of small arrays)."""
    if all(isinstance(v, np.ndarray) for v in values):
        return torch.from_numpy(np.concatenate(values, axis=None))  # axis=None: flattened
    return torch.cat([as_tensor(v).reshape(-1) for v in values])


class RunningSum:
    """Weighted sum of the given keys, fed one update at a time (streaming FedAvg).

    Large arrays are added one by one; small ones (BatchNorm vectors and counters, biases) as one
    flat array per dtype, so a DenseNet update is about 130 additions instead of 730. Floating
    keys are summed in float32 (float64 for float64 inputs), integer keys in float64.

    Args:
        keys: the parameter names to sum, in output order (other keys of an update are checked, never summed).
    """

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = list(keys)
        self.added: list[tuple[str, float]] = []  # (site, weight of its floating keys)
        self.usable = True  # False once its sums were consumed (or no longer match the updates)
        self._items: list[tuple[list[str], bool, bool]] | None = None  # (keys, flat, floating)
        self._shapes: dict[str, tuple[torch.Size, int]] = {}
        self._accs: list[torch.Tensor] = []

    def _plan(self, params: Mapping[str, Array]) -> None:
        firsts = {k: as_tensor(params[k]) for k in self.keys}
        self._shapes = {k: (t.shape, t.numel()) for k, t in firsts.items()}
        items: list[tuple[list[str], bool, bool]] = []
        small: dict[torch.dtype, list[str]] = {}
        for k, t in firsts.items():
            if t.numel() < SMALL:
                small.setdefault(t.dtype, []).append(k)
            else:
                items.append(([k], False, t.is_floating_point()))
        items += [(ks, True, dtype.is_floating_point) for dtype, ks in small.items()]
        self._items = items
        self._dtypes = {k: t.dtype for k, t in firsts.items()}

    def add(
        self,
        site: str,
        params: Mapping[str, Array],
        weight: float,
        *,
        int_weight: float | None = None,
        check_finite: bool = False,
    ) -> str | None:
        """Add ``weight`` x the update's arrays (``int_weight`` for integer buffers, default ``weight``).

        With ``check_finite``, every array of ``params`` (keys not summed included) is
        checked for NaN/Inf before anything is added (one cheap sum per summed array), so a
        rejected update leaves the sum as it was.

        Args:
            site: whose update it is (kept in :attr:`added`).
            params: the update's arrays (at least the summed keys).
            weight: the weight of its floating-point keys.
            int_weight: the weight of its integer keys (None: ``weight``).
            check_finite: check every array for NaN/Inf first.

        Returns:
            None, or the first key in ``params`` order holding a NaN/Inf; the update is then
            not added.
        """
        if self._items is None:
            self._plan(params)
        assert self._items is not None
        if check_finite:
            rest = [(k, v) for k, v in params.items() if k not in self._shapes]
            if first_nonfinite(rest) is not None:
                return first_nonfinite(params.items())
        xs = [_flat([params[k] for k in ks]) if flat else as_tensor(params[ks[0]]) for ks, flat, _ in self._items]
        if check_finite and any(
            is_float and not math.isfinite(float(x.sum())) for (_, _, is_float), x in zip(self._items, xs)
        ):
            bad = first_nonfinite(params.items())  # exact, in order (the sum may just overflow)
            if bad is not None:
                return bad
        iw = weight if int_weight is None else int_weight
        first = not self._accs
        for i, ((_, _, is_float), x) in enumerate(zip(self._items, xs)):
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
        """The dtype of ``key`` in the first update added.

        Args:
            key: a summed key.
        """
        return self._dtypes[key]
