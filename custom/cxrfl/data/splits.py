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
            "remove the split so that cxrfl splits by patient, or set dataset.overlap: move, drop or resplit"
        )


def resolve_overlap(table: pd.DataFrame, policy: str, source: str | Path, problems: list[str]) -> pd.DataFrame:
    """Apply ``dataset.overlap`` to the patients a given split puts in more than one split.

    Args:
        table: one row per image with ``patient`` and ``split``.
        policy: ``refuse`` (:func:`check_split`), ``move`` (all of such a patient's images go to
            their first split in the order train, val, test: the later splits stay free of them),
            ``drop`` (the images outside that first split are left out) or ``resplit`` (the given
            split is not used: the ``split`` column is removed).
        source: the file or folder the split came from, for messages.
        problems: receives one line saying what was done and to how many patients and images.

    Raises:
        DataError: ``refuse`` and a patient in two splits.
    """
    if policy == "refuse":
        check_split(table, source)
        return table
    if policy == "resplit":
        problems.append(f"the split given by {source} is not used (dataset.overlap: resplit); cxrfl splits patients")
        return table.drop(columns="split")
    order = table["split"].map({s: i for i, s in enumerate(SPLITS)})
    first = order.groupby(table["patient"]).transform("min")
    later = order > first
    if not later.any():
        return table
    patients, images = table.loc[later, "patient"].nunique(), int(later.sum())
    if policy == "move":
        table, done = table.assign(split=np.asarray(SPLITS)[first.to_numpy()]), "were moved to it"
    else:
        table, done = table[~later].reset_index(drop=True), "were left out"
    problems.append(
        f"{patients} patient(s) appear in more than one split in {source}: their {images} image(s) "
        f"outside the patient's first split (train, val, test order) {done} (dataset.overlap: {policy})"
    )
    return table


def val_from_train(table: pd.DataFrame, classes: list[str], split: SplitConfig, problems: list[str]) -> pd.DataFrame:
    """Give a given split without a val split one: a stratified share of the train patients.

    ``split.val / (split.train + split.val)`` of the train patients (:func:`patient_split`, seeded by
    ``split.seed``) go to val; nothing happens when the data has a val split or ``split.val`` is 0.

    Args:
        table: one row per image with ``patient``, ``split`` and the class columns.
        classes: the class columns to stratify on.
        split: the site's fractions and seed.
        problems: receives one line with the numbers moved.
    """
    train = table["split"].eq("train")
    if table["split"].eq("val").any() or split.val == 0 or not train.any():
        return table
    share = split.val / (split.train + split.val)
    within = SplitConfig(train=1.0 - share, val=share, test=0.0, seed=split.seed)
    chosen = patient_split(table[train], classes, within)
    table = table.copy()
    table.loc[train, "split"] = chosen
    moved = chosen.eq("val")
    problems.append(
        f"the data gives no val split: {table.loc[moved[moved].index, 'patient'].nunique()} of "
        f"{table.loc[train, 'patient'].nunique()} train patients ({int(moved.sum())} images) form it "
        f"(split.val / (split.train + split.val) = {share:.3f} of them, stratified)"
    )
    return table
