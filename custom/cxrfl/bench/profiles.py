"""The data of a comparison: training sites and fully annotated external test sets.

Profiles:

* ``two-hospitals``: synthetic NIH-like ``hospital-a`` (14 findings) and CheXpert-like
  ``hospital-b`` (13 findings, 7 shared), non-IID styles and case mixes, and a synthetic
  ``external`` test site with all 20 findings (the papers' MIMIC role). By default 2,200 images
  per hospital split 55/12/33 % by patient (at least 1,000 training and 600 test images each;
  hospital-b loses its lateral views) and 2,000 external images.
* ``two-hospitals-shared``: the same images, both hospitals restricted to their 7 shared
  classes (the no-class-heterogeneity control).
* ``nih1000``: the 1,000 real NIH images of ``../shared/data/nih1000`` (264 patients). The
  pool's stratified test split (20 % of patients) is held out as ``nih-test`` with all 14
  findings; the other patients are split IID into sites whose label sets are pruned at random:
  by default 2 sites with 11 and 7 findings, 4 in common (the MIDL draft's first experiment).
* ``synth-nih``: the same construction on a synthetic NIH-like pool (3,000 images: 600 held out).

``n_sites``/``n_shared`` turn the two pool profiles into the papers' ablations: K sites
(IID, each 1/K of the pool) that all annotate ``n_shared`` random classes and split the other
classes round-robin, so every class is annotated somewhere. Pool sites split 70/10/20 % (the
papers' split).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from cxrfl.data.labels import NIH_CLASSES
from cxrfl.data.site import SiteData, load_site
from cxrfl.errors import ConfigError

PROFILE_NAMES = ("two-hospitals", "two-hospitals-shared", "nih1000", "synth-nih")
ABLATION_SITES = (2, 4, 6, 10)
"""Numbers of sites of the sites ablation (the papers ran 2, 3, 4, 5, 6, 8, 10; ``--ablation-values``)."""
ABLATION_SHARED = (0, 1, 2, 4, 8, 12, 14)
"""The papers' numbers of shared classes over 4 clients (ablation 2)."""
MIDL_UNIQUE = (7, 3)
"""MIDL draft, first experiment: 4 shared classes + 7 and 3 own ones = 11 and 7 findings."""
MIDL_SHARED = 4
SYNTH_TRAIN_DEFAULT = 2200
"""Images per synthetic hospital (two-hospitals profiles)."""
SYNTH_EXTERNAL_DEFAULT = 2000
"""Images of the synthetic external test site."""
SYNTH_SPLIT = (0.55, 0.12, 0.33)
"""Train/val/test fractions (by patient) of the synthetic hospitals: large test splits for per-class AUROCs."""
SYNTH_POOL_DEFAULT = 3000
"""Images of the synthetic NIH-like pool (synth-nih)."""


@dataclass
class BenchData:
    """What one comparison trains and tests on.

    Args:
        profile: profile name (with the ablation setting, if any).
        sites: the training sites (each with train/val/test splits).
        external: fully annotated test sets (every row is a test image).
        notes: sentences for the report (sizes, provenance).
        configs: site name -> the site config file written for it (usable with the NVFlare jobs).
    """

    profile: str
    sites: list[SiteData]
    external: dict[str, SiteData] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    configs: dict[str, Path] = field(default_factory=dict)

    @property
    def union(self) -> list[str]:
        """Sorted union of the training sites' classes."""
        return sorted(set().union(*(s.classes for s in self.sites)))

    @property
    def every_site_labels_every_class(self) -> bool:
        """Every site labels every class of the union head: the selection rules count the same classes."""
        return all(set(s.classes) == set(self.union) for s in self.sites)


def shared_data_root() -> Path:
    """``$CXRFL_SHARED_DATA``, else the ``shared/data`` folder beside the checkout."""
    env = os.environ.get("CXRFL_SHARED_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3].parent / "shared" / "data"


def partition_classes(
    classes: list[str],
    n_sites: int,
    n_shared: int,
    *,
    seed: int = 0,
    unique_sizes: tuple[int, ...] | None = None,
) -> list[list[str]]:
    """Random label sets: ``n_shared`` classes at every site, the rest split among the sites.

    Args:
        classes: all classes of the pool.
        n_sites: number of sites (>= 1).
        n_shared: classes every site annotates (0 ... len(classes)).
        seed: seed of the random choice.
        unique_sizes: how many of the other classes each site gets (default: round-robin).

    Returns:
        per site, its classes in ``classes`` order; every class is somewhere.
    """
    if n_sites < 1 or not 0 <= n_shared <= len(classes):
        raise ConfigError(f"need n_sites >= 1 and 0 <= n_shared <= {len(classes)}, got {n_sites}, {n_shared}")
    order = [classes[i] for i in np.random.default_rng(seed).permutation(len(classes))]
    shared, rest = order[:n_shared], order[n_shared:]
    if unique_sizes is not None:
        if len(unique_sizes) != n_sites or sum(unique_sizes) != len(rest):
            raise ConfigError(f"unique_sizes {unique_sizes} must give {len(rest)} classes to {n_sites} sites")
        bounds = np.cumsum((0, *unique_sizes))
        own = [rest[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    else:
        own = [rest[k::n_sites] for k in range(n_sites)]
    sets = [set(shared) | set(o) for o in own]
    empty = [k for k, s in enumerate(sets) if not s]
    if empty:
        raise ConfigError(
            f"{n_sites} sites sharing {n_shared} of {len(classes)} classes leaves site(s) {empty} without a class"
        )
    return [[c for c in classes if c in s] for s in sets]


def _site_assignment(table: pd.DataFrame, classes: list[str], n_sites: int, seed: int) -> pd.Series:
    """Site index per row: patients dealt round-robin, ordered by their rarest positive class."""
    pos = table[classes].eq(1.0).groupby(table["patient"].astype(str), sort=True).any()
    prevalence = pos.sum(axis=0)
    rng = np.random.default_rng(seed)
    patients = pos.index.to_numpy()
    shuffled = rng.permutation(len(patients))
    rarest = np.array([prevalence[row].min() if row.any() else np.inf for row in pos.to_numpy()], dtype=float)
    order = np.lexsort((shuffled, rarest))
    site_of = {patients[p]: k % n_sites for k, p in enumerate(order)}
    return table["patient"].astype(str).map(site_of)


def _write_csv_site(
    out: Path, name: str, rows: pd.DataFrame, classes: list[str], *, split: str | None, seed: int
) -> Path:
    """A generic-CSV site over existing images (absolute paths) and its site config."""
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame({"path": rows["path"].values, "patient_id": rows["patient"].astype(str).values})
    if split is not None:
        frame["split"] = split
    for c in classes:
        frame[c] = rows[c].map(lambda v: "" if pd.isna(v) else str(int(v))).values
    frame.to_csv(folder / "labels.csv", index=False)
    # the pool's images live outside this site's folder: the config says so explicitly
    dataset = {
        "format": "csv",
        "labels": f"{name}/labels.csv",
        "images": name,
        "path_column": "path",
        "patient_column": "patient_id",
        "allow_outside_images": True,
    }
    if split is not None:
        dataset["split_column"] = "split"
    cfg = {"site": name, "dataset": dataset, "split": {"train": 0.7, "val": 0.1, "test": 0.2, "seed": int(seed)}}
    path = out / f"{name}.yaml"
    path.write_text(
        "# written by 'cxrfl bench compare' from a pool of images; paths relative to this file\n"
        + yaml.safe_dump(cfg, sort_keys=False)
    )
    return path


def _pool_profile(
    name: str,
    pool: SiteData,
    out: Path,
    *,
    n_sites: int | None,
    n_shared: int | None,
    seed: int,
) -> BenchData:
    classes = [c for c in pool.classes if c in NIH_CLASSES] or list(pool.classes)
    if n_sites is None and n_shared is None:
        n_sites, n_shared, unique = 2, MIDL_SHARED, MIDL_UNIQUE
        tag = ""
    else:
        n_sites = n_sites or 4
        n_shared = MIDL_SHARED if n_shared is None else n_shared
        unique = None
        tag = f"-k{n_sites}-s{n_shared}"
    label_sets = partition_classes(classes, n_sites, n_shared, seed=seed, unique_sizes=unique)
    table = pool.table
    test_rows = table[table["split"] == "test"]
    rest = table[table["split"] != "test"].reset_index(drop=True)
    site_idx = _site_assignment(rest, classes, n_sites, seed)
    folder = out / f"{name}{tag}"
    configs = {"nih-test": _write_csv_site(folder, "nih-test", test_rows, classes, split="test", seed=seed)}
    names = []
    for k, site_classes in enumerate(label_sets):
        site_name = f"site-{k + 1}"
        names.append(site_name)
        configs[site_name] = _write_csv_site(
            folder, site_name, rest[site_idx == k], site_classes, split=None, seed=seed
        )
    sites = [load_site(configs[n], check_images=False) for n in names]
    external = {"nih-test": load_site(configs["nih-test"], check_images=False)}
    shared = sorted(set.intersection(*(set(s) for s in label_sets)))
    notes = [
        f"{name}: {len(table)} images of {table['patient'].nunique()} patients; {len(test_rows)} images "
        f"({test_rows['patient'].nunique()} patients) held out as the fully annotated test set 'nih-test' "
        f"({len(classes)} findings); the other {len(rest)} images split IID by patient into {n_sites} sites "
        f"({', '.join(f'{s.site}: {len(s.table)} images, {len(s.classes)} findings' for s in sites)}), "
        f"{len(shared)} findings shared by all sites: {', '.join(shared) or 'none'}.",
    ]
    return BenchData(f"{name}{tag}", sites, external, notes, configs)


def with_split(config: Path, split: tuple[float, ...], seed: int) -> Path:
    """A copy of a site config beside it (``<name>.compare.yaml``) with other split fractions.

    Args:
        config: the site config written by the synthetic generator.
        split: train, val and test fractions.
        seed: the split seed.
    """
    if len(split) != 3 or any(f <= 0 for f in split) or abs(sum(split) - 1) > 1e-6:
        raise ConfigError(f"split must be three positive train/val/test fractions summing to 1, got {list(split)}")
    cfg = yaml.safe_load(config.read_text())
    cfg["split"] = {"train": float(split[0]), "val": float(split[1]), "test": float(split[2]), "seed": int(seed)}
    path = config.with_name(f"{config.stem}.compare.yaml")
    path.write_text(
        "# the benchmark's copy of the synthetic site config, with its own split; paths relative to this file\n"
        + yaml.safe_dump(cfg, sort_keys=False)
    )
    return path


def _split_text(s: SiteData) -> str:
    return f"{s.site}: {len(s.classes)} classes, " + ", ".join(
        f"{k} {len(s.split_table(k))}" for k in ("train", "val", "test")
    )


def _two_hospitals(
    profile: str, out: Path, *, image_size: int, n_train: int, n_ext: int, split: tuple[float, ...], seed: int
) -> BenchData:
    from cxrfl.synth import write_profile

    folder = out / profile
    cfgs = write_profile(
        profile, folder, n_per_site=n_train, image_size=image_size, seed=seed, sites=["hospital-a", "hospital-b"]
    )
    cfgs = [with_split(c, split, seed) for c in cfgs]
    cfgs += write_profile(profile, folder, n_per_site=n_ext, image_size=image_size, seed=seed, sites=["external"])
    loaded = {p.name.split(".")[0]: load_site(p, check_images=False) for p in cfgs}
    sites = [loaded["hospital-a"], loaded["hospital-b"]]
    external = {"external": loaded["external"]}
    notes = [
        f"{profile}: synthetic, {n_train} images written per hospital ({image_size}x{image_size} px; "
        "hospital-b's lateral "
        f"views are left out), split {'/'.join(f'{100 * f:.0f}' for f in split)} % by patient; "
        f"{len(external['external'].table)} "
        f"images in the external test site; " + "; ".join(_split_text(s) for s in sites) + "."
    ]
    return BenchData(profile, sites, external, notes, {p.name.split(".")[0]: p for p in cfgs})


def prepare(
    profile: str,
    out: Path,
    *,
    image_size: int = 64,
    n_per_site: int | None = None,
    n_external: int | None = None,
    n_sites: int | None = None,
    n_shared: int | None = None,
    split: tuple[float, ...] = SYNTH_SPLIT,
    seed: int = 0,
) -> BenchData:
    """Write (or reuse) a profile's data under ``out`` and load its sites.

    Args:
        profile: one of :data:`PROFILE_NAMES`.
        out: data folder (synthetic images are reused when already written with the same settings).
        image_size: size the synthetic images are written at (>= the model input).
        n_per_site: images per synthetic hospital (default :data:`SYNTH_TRAIN_DEFAULT`), or of the
            synth-nih pool (default :data:`SYNTH_POOL_DEFAULT`).
        n_external: images of the synthetic external test site (default :data:`SYNTH_EXTERNAL_DEFAULT`).
        n_sites: pool profiles: number of sites (ablation); default: the MIDL 2-site split.
        n_shared: pool profiles: classes every site annotates (ablation).
        split: train/val/test fractions of the synthetic hospitals (pool sites: 70/10/20).
        seed: data seed (images, splits, label-set choice); fixed across training seeds.
    """
    out = Path(out)
    if profile in ("two-hospitals", "two-hospitals-shared"):
        if n_sites is not None or n_shared is not None:
            raise ConfigError("--sites/--shared (ablations) apply to the pool profiles nih1000 and synth-nih")
        return _two_hospitals(
            profile,
            out,
            image_size=image_size,
            n_train=n_per_site or SYNTH_TRAIN_DEFAULT,
            n_ext=n_external or SYNTH_EXTERNAL_DEFAULT,
            split=tuple(split),
            seed=seed,
        )
    if profile == "nih1000":
        root = shared_data_root() / "nih1000"
        labels = root / "Data_Entry_2017_v2020.csv"
        if not labels.is_file():
            raise ConfigError(f"the real NIH sample is not at {root}; set $CXRFL_SHARED_DATA to the shared/data folder")
        cfg = out / "nih1000-pool.yaml"
        out.mkdir(parents=True, exist_ok=True)
        cfg.write_text(
            yaml.safe_dump(
                {
                    "site": "nih1000",
                    "dataset": {"format": "nih", "labels": str(labels), "images": str(root / "images")},
                    "split": {"train": 0.7, "val": 0.1, "test": 0.2, "seed": int(seed)},
                },
                sort_keys=False,
            )
        )
        pool = load_site(cfg, check_images=False)
        data = _pool_profile("nih1000", pool, out, n_sites=n_sites, n_shared=n_shared, seed=seed)
        data.notes.append(
            "nih1000 is very small: real NIH images at 64x64, a few hundred per site and tens of "
            "positives for most findings; expect wide confidence intervals and differences within noise."
        )
        return data
    if profile == "synth-nih":
        import cxrfl.synth.bench_profiles  # noqa: F401  (registers nih-pool)
        from cxrfl.synth import write_profile

        (cfg,) = write_profile(
            "nih-pool", out / "nih-pool", n_per_site=n_per_site or SYNTH_POOL_DEFAULT, image_size=image_size, seed=seed
        )
        pool = load_site(cfg, check_images=False)
        return _pool_profile("synth-nih", pool, out, n_sites=n_sites, n_shared=n_shared, seed=seed)
    raise ConfigError(f"unknown benchmark profile {profile!r}; available: {', '.join(PROFILE_NAMES)}")


def from_site_configs(
    site_configs: Sequence[str | Path], external_configs: Sequence[str | Path] = (), name: str = "custom"
) -> BenchData:
    """A comparison on your own data: one site config per training site (train/val/test splits as
    the configs say) and optional fully annotated external test sets (every image is a test image).

    Args:
        site_configs: the training sites' config files.
        external_configs: external test sets' config files.
        name: the profile name in the results.
    """
    if not site_configs:
        raise ConfigError("give at least one --site-config")
    sites = [load_site(p, check_images=True) for p in site_configs]
    external = {}
    for p in external_configs:
        d = load_site(p, check_images=True)
        external[d.site] = d
    names = [s.site for s in sites] + list(external)
    if len(set(names)) != len(names):
        raise ConfigError(f"site names must differ, got {names}")
    notes = [
        f"{name}: "
        + "; ".join(_split_text(s) for s in sites)
        + "".join(f"; external {k}: {len(v.table)} images, {len(v.classes)} classes" for k, v in external.items())
        + "."
    ]
    configs = {s.site: Path(p) for s, p in zip(sites, site_configs)}
    configs.update({k: Path(p) for k, p in zip(external, external_configs)})
    return BenchData(name, sites, external, notes, configs)


def pooled_site(sites: list[SiteData], name: str = "pooled", selection: str = "annotated") -> SiteData:
    """All sites' images in one site with the union of their classes; a class a site does not
    annotate is 0.0 for its training images (the centralized baseline: missing labels are
    negatives) and, in the other splits, NaN (``selection="annotated"``: the validation loss that
    selects the model counts each image's own site's classes) or 0.0 (``"head"``).

    Args:
        sites: the training sites.
        name: the pooled site's name.
        selection: :data:`cxrfl.surgical.head_modes.SELECTION_RULES`.
    """
    union = sorted(set().union(*(s.classes for s in sites)))
    parts = []
    for s in sites:
        t = s.table[["path", "patient", "split", *s.classes]].copy()
        t["patient"] = s.site + "/" + t["patient"].astype(str)
        for c in union:
            if c not in s.classes:
                t[c] = np.where((t["split"] == "train") | (selection == "head"), 0.0, np.nan)
        parts.append(t[["path", "patient", "split", *union]])
    return SiteData(site=name, classes=union, table=pd.concat(parts, ignore_index=True))
