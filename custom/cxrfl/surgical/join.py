"""Late joins: a site without a head warm-up (it failed, timed out or was down) enters a running run.

In every round's exchange the server (:class:`cxrfl.surgical.server.SurgicalServer`) sends the
sites of the run that have no warm-up yet the head warm-up task, on the round's global feature
extractor (no head rows: the site learns no other site's class), while the others train. A site
that answers validly joins after that round: from the next one on it receives its rows and trains
like the others. Its classes that the global head lacks are appended as new rows (its warm-up
rows; two joiners sharing a new class: their mean); the existing rows and their order stay as they
are, so every earlier site keeps receiving exactly the rows it had.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cxrfl.nn.models import HEAD_PREFIX


def waiting_sites(sites: Sequence[str], announced: Mapping[str, Sequence[str]]) -> list[str]:
    """The sites of the run that have not joined yet (no valid warm-up so far).

    Args:
        sites: the sites of the run (NVFlare: the job's clients).
        announced: site -> its classes, for the sites that joined.
    """
    return [s for s in sites if s not in announced]


def add_classes(
    params: Mapping[str, Any],
    classes: Sequence[str],
    joined_params: Mapping[str, Any],
    joined_classes: Sequence[str],
    head_prefix: str = HEAD_PREFIX,
) -> tuple[dict[str, Any], list[str], list[str]]:
    """The global model with the joiners' new classes appended to its head.

    Args:
        params: the global model (head rows in ``classes`` order).
        classes: the global head's class order.
        joined_params: the joiners' aggregated warm-up (head rows in ``joined_classes`` order).
        joined_classes: the classes the joiners announced, in their head's row order.
        head_prefix: state-dict prefix of the head.

    Returns:
        (the model, its class order, the classes added). Feature extractor and existing rows are
        the same values as in ``params``; nothing is added for classes the head already has.
    """
    new = [c for c in joined_classes if c not in set(classes)]
    out = dict(params)
    if new:
        rows = [list(joined_classes).index(c) for c in new]
        for key in (head_prefix + "weight", head_prefix + "bias"):
            old = np.asarray(params[key])
            out[key] = np.concatenate([old, np.asarray(joined_params[key])[rows].astype(old.dtype, copy=False)])
    return out, [*classes, *new], new
