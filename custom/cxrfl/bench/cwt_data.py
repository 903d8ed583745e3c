"""The data of the CWT benchmark: the paper's splits 1-10 drawn from a pool of images, by patient.

The pools: the real NIH images of ``../shared/data/nih1000`` (:data:`DEFAULT_SITE_CONFIG`), and a
larger synthetic NIH-format cohort (:func:`synthetic_site_config`, :mod:`cxrfl.synth`) with NIH's
own finding rates and co-occurrence (about 45 % of the images abnormal; the draws below balance
the labels exactly).

1. every patient keeps at most ``max_patient_images`` images (abnormal ones first: the scarce
   label; None: all); patients (never images) are drawn into a balanced held-out test set, a
   balanced validation set and a balanced training set of ``per_class`` abnormal + ``per_class``
   normal images (the paper's 3,200 + 3,200, scaled down; None: as many as the pool has left);
2. the training set is partitioned by patient into 4 sites with exactly the paper's per-site
   counts, scaled: Table 1 (splits 1-5: sample-size variability) and Table 3 (splits 6-10:
   label-distribution variability). Every split uses the same training images, so central
   hosting (one site holding all of them) is one run per seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from cxrfl.cwt.config import BINARY_CLASS
from cxrfl.cwt.site import binary_labels
from cxrfl.data.site import SiteData, load_site
from cxrfl.errors import DataError
from cxrfl.synth.cohort import CaseMix
from cxrfl.synth.profiles import PROFILES, Profile, nih_site

REPO = Path(__file__).resolve().parents[3]
DEFAULT_SITE_CONFIG = REPO / "site_configs" / "nih1000.yaml"

TABLE_1: dict[int, list[tuple[int, int]]] = {
    1: [(800, 800), (800, 800), (800, 800), (800, 800)],
    2: [(960, 960), (853, 853), (747, 747), (640, 640)],
    3: [(1120, 1120), (907, 907), (693, 693), (480, 480)],
    4: [(1280, 1280), (960, 960), (640, 640), (320, 320)],
    5: [(1440, 1440), (1013, 1013), (587, 587), (160, 160)],
}
"""The paper's Table 1: (abnormal, normal) training images per institution, splits 1-5."""

TABLE_3: dict[int, list[tuple[int, int]]] = {
    6: [(800, 800), (800, 800), (800, 800), (800, 800)],
    7: [(960, 640), (853, 747), (747, 853), (640, 960)],
    8: [(1120, 480), (907, 693), (693, 907), (480, 1120)],
    9: [(1280, 320), (960, 640), (640, 960), (320, 1280)],
    10: [(1440, 160), (1013, 587), (587, 1013), (160, 1440)],
}
"""The paper's Table 3: (abnormal, normal) training images per institution, splits 6-10."""

PAPER_SPLITS = {**TABLE_1, **TABLE_3}
PAPER_PER_CLASS = 3200
SITES = ("inst-1", "inst-2", "inst-3", "inst-4")


def scale_split(rows: Sequence[tuple[int, int]], per_class: int) -> list[tuple[int, int]]:
    """The paper's per-institution counts scaled to ``per_class`` images per label (sums kept exact).

    Largest-remainder rounding per label column, so each column sums to ``per_class``.

    Args:
        rows: (abnormal, normal) per institution, each column summing to 3,200.
        per_class: the scaled column sum.
    """
    out = []
    cols = []
    for j in range(2):
        raw = np.array([r[j] for r in rows], dtype=np.float64) * per_class / PAPER_PER_CLASS
        base = np.floor(raw).astype(int)
        for i in np.argsort(-(raw - base), kind="stable")[: per_class - base.sum()]:
            base[i] += 1
        cols.append(base)
    for i in range(len(rows)):
        out.append((int(cols[0][i]), int(cols[1][i])))
    return out


def synthetic_site_config(folder: str | Path, n_images: int, image_size: int, seed: int = 0) -> Path:
    """Write (or reuse) a synthetic NIH-format cohort of ``n_images`` images with NIH's own finding
    rates (no rare finding raised); its site config.

    Args:
        folder: where it is written (reused when already there with these settings).
        n_images: images in the cohort.
        image_size: image side in pixels.
        seed: the cohort's seed.
    """
    from cxrfl.synth import write_profile

    name = f"cwt-pool-{n_images}"
    PROFILES.setdefault(
        name,
        Profile(
            name,
            "one NIH-like cohort for the CWT benchmark's synthetic table",
            (nih_site("cwt-pool", n_images, mix=CaseMix.make(0.4)),),
        ),
    )
    (path,) = write_profile(name, Path(folder), image_size=image_size, seed=seed)
    return path


def load_pool(
    site_config: str | Path = DEFAULT_SITE_CONFIG, max_patient_images: int | None = 10, seed: int = 0
) -> pd.DataFrame:
    """A pool's images with the binary label, at most ``max_patient_images`` per patient.

    Args:
        site_config: the pool's site config (default: the real nih1000 images).
        max_patient_images: cap per patient (abnormal images kept first, then normal, at random; None: no cap).
        seed: seed of which images of a large patient are kept.
    """
    data = load_site(site_config, check_images=False)
    table = data.table[["path", "patient"]].copy()
    table["y"] = binary_labels(data.table, data.classes).to_numpy()
    table = table[table["y"].notna()].reset_index(drop=True)
    rng = np.random.default_rng(seed)
    table["_r"] = rng.random(len(table))
    table = table.sort_values(["patient", "y", "_r"], ascending=[True, False, True])
    if max_patient_images is not None:
        table = table.groupby("patient", sort=False).head(max_patient_images)
    return table.drop(columns="_r").reset_index(drop=True)


def _patients(table: pd.DataFrame) -> pd.DataFrame:
    g = table.groupby("patient")["y"].agg(["size", "sum"])
    return pd.DataFrame(
        {"patient": g.index, "a": g["sum"].astype(int).to_numpy(), "b": (g["size"] - g["sum"]).astype(int).to_numpy()}
    )


def pick_patients(patients: pd.DataFrame, a: int, b: int, rng: np.random.Generator, tries: int = 500) -> list[str]:
    """Whole patients whose images sum to exactly ``a`` abnormal and ``b`` normal images.

    Args:
        patients: ``patient``, ``a`` (abnormal images), ``b`` (normal images).
        a: abnormal images wanted.
        b: normal images wanted.
        rng: random generator (random greedy passes until one is exact).
        tries: greedy passes before giving up.

    Raises:
        DataError: no exact selection was found.
    """
    pa, pb, names = patients["a"].to_numpy(), patients["b"].to_numpy(), patients["patient"].to_numpy()
    best = None
    for _ in range(tries):
        order = rng.permutation(len(names))
        ra, rb, chosen = a, b, []
        for i in order:
            if pa[i] <= ra and pb[i] <= rb:
                chosen.append(names[i])
                ra, rb = ra - pa[i], rb - pb[i]
                if ra == 0 and rb == 0:
                    return chosen
        if best is None or ra + rb < best[0]:
            best = (ra + rb, ra, rb)
    assert best is not None  # tries >= 1
    raise DataError(
        f"cannot draw whole patients with exactly {a} abnormal + {b} normal images "
        f"(closest: {a - best[1]} + {b - best[2]}); lower per_class or the test/val sizes"
    )


def partition(
    patients: pd.DataFrame, quotas: Sequence[tuple[int, int]], rng: np.random.Generator, tries: int = 2000
) -> dict[str, int]:
    """Assign whole patients to sites so that site i gets exactly ``quotas[i]`` (abnormal, normal) images.

    Random greedy passes, patients with both labels first (the hard ones at sites with few images
    of one label), then by size: each patient goes to a site it fits in, chosen with probability
    proportional to the room left there, times ``exp(-4 |d|)`` with d the difference between the
    patient's abnormal share and the room's.

    Args:
        patients: ``patient``, ``a``, ``b``; their sums equal the quotas' sums.
        quotas: (abnormal, normal) per site.
        rng: random generator.
        tries: passes before giving up.

    Raises:
        DataError: no exact partition found.
    """
    pa, pb, names = patients["a"].to_numpy(), patients["b"].to_numpy(), patients["patient"].to_numpy()
    q = np.array(quotas, dtype=np.int64)
    if pa.sum() != q[:, 0].sum() or pb.sum() != q[:, 1].sum():
        raise ValueError(
            f"patients hold {pa.sum()}+{pb.sum()} images, the quotas sum to {q[:, 0].sum()}+{q[:, 1].sum()}"
        )
    size = pa + pb
    mixed = (pa > 0) & (pb > 0)
    for _ in range(tries):
        jitter = rng.random(len(names))
        order = np.lexsort((jitter, -size, ~mixed))
        room = q.copy()
        choice: dict[str, int] = {}
        for i in order:
            fits = np.flatnonzero((room[:, 0] >= pa[i]) & (room[:, 1] >= pb[i]))
            if not len(fits):
                break
            left = room[fits].sum(axis=1)
            share = np.abs(room[fits, 0] / np.maximum(left, 1) - pa[i] / size[i]) if size[i] else np.zeros(len(fits))
            weight = (left - size[i] + 1) * np.exp(-4.0 * share)
            site = int(rng.choice(fits, p=weight / weight.sum()))
            room[site] -= (pa[i], pb[i])
            choice[names[i]] = site
        else:
            return choice
    raise DataError(f"no exact patient partition into {quotas} found in {tries} passes")


@dataclass
class CWTBenchData:
    """The benchmark's images: held-out test, validation and training sets, and per-split sites."""

    test: pd.DataFrame
    val: pd.DataFrame
    train: pd.DataFrame
    splits: dict[int, list[tuple[int, int]]]
    assignment: dict[int, dict[str, int]]

    def sites(self, split: int) -> list[SiteData]:
        """The 4 institutions of one split (validation images spread over them by patient)."""
        out = []
        val_patients = sorted(self.val["patient"].unique())
        for i, name in enumerate(SITES):
            train = self.train[self.train["patient"].map(self.assignment[split]) == i]
            val = self.val[self.val["patient"].isin(val_patients[i :: len(SITES)])]
            out.append(_site_data(name, train, val))
        return out

    def central(self) -> SiteData:
        return _site_data("central", self.train, self.val)

    def test_site(self) -> SiteData:
        return SiteData(site="test", classes=[BINARY_CLASS], table=_frame(self.test, "test"))


def _frame(table: pd.DataFrame, split: str) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "path": table["path"].to_numpy(),
            "patient": table["patient"].to_numpy(),
            "split": split,
            BINARY_CLASS: table["y"].to_numpy(dtype=np.float64),
        }
    )


def _site_data(name: str, train: pd.DataFrame, val: pd.DataFrame) -> SiteData:
    """A site whose only finding column is the binary label (so the binary task keeps it as is)."""
    table = pd.concat([_frame(train, "train"), _frame(val, "val")], ignore_index=True)
    return SiteData(site=name, classes=[BINARY_CLASS], table=table)


def prepare_data(
    *,
    per_class: int | None,
    test_per_class: int,
    val_per_class: int,
    max_patient_images: int | None = 10,
    data_seed: int = 0,
    splits: Sequence[int] = tuple(PAPER_SPLITS),
    site_config: str | Path = DEFAULT_SITE_CONFIG,
) -> CWTBenchData:
    """Draw the test, validation and training sets by patient and partition the training set per split.

    Args:
        per_class: abnormal (= normal) training images over all sites (None: every usable image
            left after the test and validation sets, balanced).
        test_per_class: abnormal (= normal) held-out test images.
        val_per_class: abnormal (= normal) validation images.
        max_patient_images: at most this many images per patient (None: no cap).
        data_seed: seed of the draws and the partitions.
        splits: which of the paper's splits 1-10.
        site_config: the pool's site config (default: the real nih1000 images).
    """
    pool = load_pool(site_config, max_patient_images, data_seed)
    rng = np.random.default_rng(data_seed)
    left = _patients(pool)
    chosen = {}
    for name, n in (("test", test_per_class), ("val", val_per_class)):
        picked = pick_patients(left, n, n, rng)
        chosen[name] = pool[pool["patient"].isin(picked)].reset_index(drop=True)
        left = left[~left["patient"].isin(picked)]
    most = int(min(left["a"].sum(), left["b"].sum()))
    sizes = [per_class] if per_class is not None else range(most, 0, -2)
    problem = None
    for n in sizes:  # automatic size: the largest balanced training set every split can partition exactly
        try:
            train = pool[pool["patient"].isin(pick_patients(left, n, n, rng))].reset_index(drop=True)
            quotas, assignment = _partitions(_patients(train), n, splits, data_seed, 2000 if per_class else 200)
        except DataError as exc:
            if per_class is not None:
                raise
            problem = exc
            continue
        return CWTBenchData(test=chosen["test"], val=chosen["val"], train=train, splits=quotas, assignment=assignment)
    raise DataError(f"no balanced training set can be partitioned into the paper's splits: {problem}")


def _partitions(
    patients: pd.DataFrame, per_class: int, splits: Sequence[int], data_seed: int, tries: int
) -> tuple[dict[int, list[tuple[int, int]]], dict[int, dict[str, int]]]:
    """Each split's (abnormal, normal) quotas per site and its patient -> site assignment (equal
    quotas, e.g. splits 1 and 6, share one)."""
    quotas_of, assignment, by_quota = {}, {}, {}
    for split in splits:
        quotas = scale_split(PAPER_SPLITS[split], per_class)
        quotas_of[split] = quotas
        key = tuple(quotas)
        if key not in by_quota:
            seed = [data_seed, *[x for q in quotas for x in q]]
            by_quota[key] = partition(patients, quotas, np.random.default_rng(seed), tries=tries)
        assignment[split] = by_quota[key]
    return quotas_of, assignment
