"""The FedFew benchmark's data for one seed: the synthetic ``fedfew`` profile, partially labelled.

The seed draws the synthetic cohorts, the unlabelled share of the CC sites and the UC test
samples. Training sites are split ``train_fraction`` / rest (train/val) by patient (the UC sites
are written 1 / ``train_fraction`` times the paper's 220 images, so that their training split has
about 20 positives and 200 negatives); a share of
every CC site's training images loses its labels (the paper's partially labelled CC clients: those
images only serve stage 1). Each UC is tested on a balanced sample of its test site (up to
``test_per_class`` positives and as many negatives); the CCs on all test images.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from cxrfl.bench.fedfew.settings import FedFewBenchSettings
from cxrfl.data.site import SiteData, load_site
from cxrfl.data.site_config import SplitConfig, load_site_config
from cxrfl.synth.fedfew_profile import FEDFEW_CCS, FEDFEW_UCS


@dataclass
class SeedData:
    """One seed's sites: training sites by name, the UC test sets, the CC test set, and the site of each UC."""

    train: dict[str, SiteData]
    uc_test: dict[str, pd.DataFrame]
    cc_test: pd.DataFrame
    uc_site: dict[str, str]


def prepare_data(settings: FedFewBenchSettings, data_dir: Path, seed: int) -> SeedData:
    """Write (or reuse) the seed's synthetic profile and load its sites.

    Args:
        settings: the benchmark settings (sizes, label fraction, splits).
        data_dir: where the seed's sites are written.
        seed: draws the cohorts, the unlabelled share and the test samples.
    """
    import cxrfl.synth.fedfew_profile as fp
    from cxrfl.synth import write_profile

    n_uc = round((fp.UC_POSITIVES + fp.UC_NEGATIVES) / settings.train_fraction)  # ~20 + ~200 in the training split
    profile = fp.fedfew_profile(
        n_cc=settings.n_cc,
        n_test=settings.n_test,
        n_uc=n_uc,
        name=f"fedfew-bench-{settings.n_cc}-{n_uc}-{settings.n_test}",
    )
    fp.PROFILES.setdefault(profile.name, profile)
    configs = write_profile(profile.name, data_dir, image_size=settings.data_image_size, seed=seed)
    rng = np.random.default_rng([seed, 17])
    split = SplitConfig(train=settings.train_fraction, val=round(1.0 - settings.train_fraction, 6), test=0.0, seed=seed)
    train: dict[str, SiteData] = {}
    uc_test: dict[str, pd.DataFrame] = {}
    tests: dict[str, pd.DataFrame] = {}
    for path in configs:
        cfg = load_site_config(path)
        spec = profile.resolve(cfg.site)
        if spec.role == "test":
            tests[cfg.site] = load_site(cfg, check_images=False).table
            continue
        data = load_site(dataclasses.replace(cfg, split=split), check_images=False)
        if set(data.classes) & set(FEDFEW_CCS):  # a CC site: some training images lose their labels
            rows = np.flatnonzero((data.table["split"] == "train").to_numpy())
            drop = rng.choice(rows, size=int(round(len(rows) * (1 - settings.cc_label_fraction))), replace=False)
            data.table.loc[drop, data.classes] = np.nan
        train[cfg.site] = data
    test = pd.concat(list(tests.values()), ignore_index=True)
    uc_site = {}
    for uc in FEDFEW_UCS:
        t = tests[f"test-{fp.site_name(uc)}"]
        pos, neg = t[t[uc] == 1.0], t[t[uc] == 0.0]
        k = min(len(pos), len(neg), settings.test_per_class)
        uc_test[uc] = pd.concat([pos.sample(k, random_state=seed), neg.sample(k, random_state=seed)], ignore_index=True)
        uc_site[uc] = next(s for s, d in train.items() if d.classes == [uc])
    return SeedData(train, uc_test, test, uc_site)


def cc_training_rows(data: SeedData) -> pd.DataFrame:
    """The CC sites' labelled training images with their CC labels (the linear probe's training set).

    Args:
        data: the seed's sites.
    """
    tables = [d.split_table("train") for d in data.train.values() if set(d.classes) & set(FEDFEW_CCS)]
    rows = pd.concat(tables, ignore_index=True)
    return rows[rows[list(FEDFEW_CCS)].notna().any(axis=1)].reset_index(drop=True)


def site_counts(data: SeedData) -> dict[str, dict[str, object]]:
    """Per training site: its training images, how many of them are labelled, its positives per class.

    Args:
        data: the seed's sites.
    """
    return {
        s: {
            "train": int((d.table["split"] == "train").sum()),
            "labelled": int(d.split_table("train")[d.classes].notna().any(axis=1).sum()),
            "positives": d.positives("train"),
        }
        for s, d in data.train.items()
    }
