"""Patient-level train/val/test splits: stratified, deterministic, never a patient in two splits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from cxrfl.data.site_config import SplitConfig
from cxrfl.errors import DataError

SPLITS = ("train", "val", "test")


def patient_split(table: pd.DataFrame, classes: list[str], split: SplitConfig) -> pd.Series:
    """Assign every patient to one split, stratified over the classes.

    A greedy form of iterative stratification over patients: patients are visited in order of
    their rarest positive class (fewest positive patients first, then most positive images of
    it, then a seeded random order), each goes to the split that (1) has no positive image of that class yet, then
    (2) is furthest below its share of that class's positive images, then (3) has most patient
    places left. Patients without positives fill the remaining places. So every split with a
    non-zero fraction gets positives of a class whenever the class has enough positive patients.

    Args:
        table: one row per image with ``patient`` and the class columns (1.0 = positive).
        classes: the class columns to stratify on.
        split: fractions of patients per split and the seed.

    Returns:
        ``train``/``val``/``test`` per row, aligned with ``table.index``.
    """
    images = table[classes].eq(1.0).groupby(table["patient"].astype(str), sort=True).sum()
    patients = images.index.to_numpy()
    count = images.to_numpy(dtype=np.float64)  # positive images per patient and class
    pos = count > 0
    fractions = np.array([split.train, split.val, split.test])
    per_class = pos.sum(axis=0)
    want = fractions[:, None] * count.sum(axis=0)[None, :]  # positive images wanted per split and class
    places = fractions * len(patients)
    have = np.zeros_like(want)
    active = np.flatnonzero(fractions > 0)
    rank = np.random.default_rng(split.seed).permutation(len(patients))
    rarity = np.where(pos, per_class[None, :], np.iinfo(np.int64).max).astype(np.int64)
    rarest = rarity.argmin(axis=1)
    order = np.lexsort((rank, -count[np.arange(len(patients)), rarest], rarity.min(axis=1)))
    choice = np.empty(len(patients), dtype=np.int64)
    for p in order:
        if pos[p].any():
            c = rarest[p]
            keys = [(have[s, c] == 0, want[s, c] - have[s, c], places[s]) for s in active]
        else:
            keys = [(places[s],) for s in active]
        s = active[max(range(len(active)), key=keys.__getitem__)]
        choice[p] = s
        have[s] += count[p]
        places[s] -= 1
    names = {p: SPLITS[s] for p, s in zip(patients, choice)}
    return table["patient"].astype(str).map(names).rename("split")


def check_split(table: pd.DataFrame, source: str | Path) -> None:
    """Check that a split given by the data puts every patient in one split.

    Args:
        table: one row per image with ``patient`` and ``split``.
        source: the file the split came from, for the message.

    Raises:
        DataError: patients appear in more than one split (the message names them).
    """
    counts = table.groupby("patient")["split"].nunique()
    mixed = counts[counts > 1]
    if len(mixed):
        first = table[table["patient"].isin(mixed.index[:5])].groupby("patient")["split"].unique()
        shown = "; ".join(f"{p} in {'/'.join(sorted(s))}" for p, s in first.items())
        raise DataError(
            f"{len(mixed)} patient(s) appear in more than one split in {source} ({shown}"
            f"{', ...' if len(mixed) > 5 else ''}); put all images of a patient in one split, "
            "or remove the split so that cxrfl splits by patient"
        )
