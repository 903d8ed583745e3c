"""The roles of a FedFew site's images, as flag columns of its role table, and the energies per role.

Roles of the site's training images (``split == "train"``):

* CC-labelled: any CC label known. BCE over the CCs plus the extra "no CC" output; the hinge
  pushing E below ``m_in`` (unless the image is positive for a UC the site labels);
* UC positive: positive for a UC the site labels. The hinge pushing E above ``m_out``; an
  "out" example for the threshold, a positive for the detectors;
* UC negative: negative for the site's UCs. No loss (``uc_negatives="in"``: the ``m_in``
  hinge; ``uc_energy_on="all"``: the ``m_out`` hinge, when it has no CC label); an "in" example
  for the threshold, a negative for the detectors;
* unlabelled: no known label at all. Self-supervised stage only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from cxrfl.fedfew.config import FedFewConfig

IN_FLAG, OUT_FLAG, UC_NEG_FLAG = "__fedfew_in__", "__fedfew_out__", "_uc_neg"
"""The role table's flag columns: pushed below ``m_in``, pushed above ``m_out``, UC negative."""
ENERGY_GROUPS = {"in": IN_FLAG, "out": OUT_FLAG, "uc_neg": UC_NEG_FLAG}
"""The training images whose mean energy a stage-2 round reports, by metric suffix."""


def role_table(
    table: pd.DataFrame, cc_classes: Sequence[str], uc_classes: Sequence[str], config: FedFewConfig
) -> pd.DataFrame:
    """One split with the CC columns (NaN where the site does not label a CC), the site's UC columns
    and the role flags (see the module docstring).

    Args:
        table: the site's rows of one split.
        cc_classes: every CC, in the network's output order.
        uc_classes: the UCs the site labels.
        config: FedFew settings (``uc_negatives``, ``uc_energy_on``).
    """
    cc_classes, uc_classes = list(cc_classes), list(uc_classes)
    out = pd.DataFrame({"path": table["path"]})
    for c in cc_classes:
        out[c] = table[c] if c in table.columns else np.nan
    cc_known = out[cc_classes].notna().any(axis=1) if cc_classes else pd.Series(False, index=out.index)
    if uc_classes:
        ucs = table[uc_classes]
        uc_pos = (ucs == 1.0).any(axis=1)
        uc_neg = (ucs == 0.0).all(axis=1) & ~uc_pos
    else:
        uc_pos = uc_neg = pd.Series(False, index=out.index)
    for c in uc_classes:
        out[c] = table[c]
    in_flag = cc_known & ~uc_pos
    out[IN_FLAG] = (in_flag | uc_neg if config.uc_negatives == "in" else in_flag).astype(np.float32)
    out_flag = uc_pos | (uc_neg & ~cc_known) if config.uc_energy_on == "all" else uc_pos
    out[OUT_FLAG] = out_flag.astype(np.float32)
    out[UC_NEG_FLAG] = uc_neg.astype(np.float32)
    return out


def threshold_examples(
    energies: np.ndarray, roles: pd.DataFrame, uc_classes: Sequence[str], examples: str
) -> tuple[np.ndarray, np.ndarray]:
    """Energies of the threshold's training examples: without a UC (the UC negatives, and with
    ``examples="all"`` the CC-labelled images) and with one (UC positives).

    Args:
        energies: [n] joint energies of the role table's rows.
        roles: the role table of the training split.
        uc_classes: the UCs the site labels.
        examples: ``threshold_examples`` (:data:`cxrfl.fedfew.config.THRESHOLD_EXAMPLES`).
    """
    uc_classes = list(uc_classes)
    uc_pos = roles[uc_classes].eq(1.0).any(axis=1).to_numpy() if uc_classes else np.zeros(len(roles), bool)
    is_in = roles[UC_NEG_FLAG].to_numpy() == 1.0
    if examples == "all":
        is_in = is_in | (roles[IN_FLAG].to_numpy() == 1.0)
    return energies[is_in], energies[uc_pos]


def hinge_energy_sums(energies: np.ndarray, roles: pd.DataFrame) -> dict[str, float | int]:
    """Sums and counts of the energies over the two hinge populations (to choose the margins).

    Args:
        energies: [n] joint energies of the role table's rows.
        roles: the role table of the training split.

    Returns:
        ``sum_in``/``n_in``: CC-labelled images without a UC; ``sum_out``/``n_out``: UC positives.
    """
    e_in = energies[roles[IN_FLAG].to_numpy() == 1.0]
    e_out = energies[roles[OUT_FLAG].to_numpy() == 1.0]
    return {
        "sum_in": float(e_in.sum()),
        "n_in": int(len(e_in)),
        "sum_out": float(e_out.sum()),
        "n_out": int(len(e_out)),
    }
