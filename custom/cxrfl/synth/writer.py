"""Write synthetic sites to disk in their real published formats, with site configs.

Layout under ``out``::

    hospital-a/Data_Entry_2017_v2020.csv, hospital-a/images/00000001_000.png     (NIH)
    hospital-b/CheXpert-v1.0-small/train.csv,
        hospital-b/CheXpert-v1.0-small/train/patient00001/study1/view1_frontal.jpg (CheXpert)
    external/labels.csv, external/images/p00001_s1.png                           (generic CSV)
    hospital-a.yaml, hospital-b.yaml, external.yaml                               (site configs)

A site's images and labels depend only on (generator version, its spec, image count, size,
seed); its random streams are seeded from the seed and the site's data key, so a site is the
same whether written alone or with others. A finished site folder holds a marker with a hash of
those parameters and is skipped when asked for again; writing happens in a temporary folder
renamed into place, under a per-site file lock, so concurrent writers are safe.
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import hashlib
import io
import json
import multiprocessing
import os
import shutil
import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

from cxrfl.data.labels import CHEXPERT_CLASSES, NIH_CLASSES, NIH_COLUMN_NAMES
from cxrfl.errors import ConfigError
from cxrfl.synth.anatomy import Anatomy, jitter_position, sample_anatomy
from cxrfl.synth.cohort import Exam, sample_cohort
from cxrfl.synth.profiles import DEFAULT_IMAGE_SIZE, SiteSpec, get_profile
from cxrfl.synth.render import render_cxr
from cxrfl.synth.styles import get_style

GENERATOR_VERSION = 1
"""Bump when the pixels or label files a given seed produces change."""
MARKER = ".cxrfl-synth.json"
NIH_LABELS = "Data_Entry_2017_v2020.csv"
NIH_HEADER = (
    "Image Index,Finding Labels,Follow-up #,Patient ID,Patient Age,Patient Gender,View Position,"
    "OriginalImage[Width,Height],OriginalImagePixelSpacing[x,y]"
)
"""The real NIH header: its two bracketed headers are unquoted and hold a comma each."""
CHEXPERT_ROOT = "CheXpert-v1.0-small"
CHEXPERT_COLUMNS = ("Path", "Sex", "Age", "Frontal/Lateral", "AP/PA", "No Finding", *CHEXPERT_CLASSES)
CSV_LABELS = "labels.csv"
_NIH_NAME = {v: k for k, v in NIH_COLUMN_NAMES.items()}
_NIH_DETECTORS = (
    (2500, 2048, "0.168"),
    (2048, 2500, "0.168"),
    (2992, 2991, "0.143"),
    (3056, 2544, "0.139"),
    (2021, 2021, "0.194311"),
)
_NIH_DETECTOR_P = (0.33, 0.08, 0.3, 0.18, 0.11)

_CHEXPERT_UNCERTAIN = {
    "Enlarged Cardiomediastinum": 0.055,
    "Cardiomegaly": 0.036,
    "Lung Opacity": 0.025,
    "Lung Lesion": 0.007,
    "Edema": 0.058,
    "Consolidation": 0.124,
    "Pneumonia": 0.084,
    "Atelectasis": 0.15,
    "Pneumothorax": 0.014,
    "Pleural Effusion": 0.052,
    "Pleural Other": 0.012,
    "Fracture": 0.003,
    "Support Devices": 0.005,
}
"""Share of CheXpert training rows with ``-1.0`` per class (CheXpert paper, Table 1)."""
_CHEXPERT_NEGATIVE = {
    "Enlarged Cardiomediastinum": 0.1,
    "Cardiomegaly": 0.05,
    "Lung Opacity": 0.03,
    "Lung Lesion": 0.01,
    "Edema": 0.09,
    "Consolidation": 0.13,
    "Pneumonia": 0.01,
    "Atelectasis": 0.005,
    "Pneumothorax": 0.25,
    "Pleural Effusion": 0.15,
    "Pleural Other": 0.002,
    "Fracture": 0.01,
    "Support Devices": 0.03,
}
"""Approximate share of absent findings written as an explicit ``0.0`` (the rest stay blank)."""


def site_seed(seed: int, spec: SiteSpec) -> list[int]:
    """Entropy of a site's random streams: the seed and a checksum of its data key."""
    return [int(seed), zlib.crc32(spec.key.encode())]


def _params(spec: SiteSpec, n: int, size: int, seed: int) -> dict[str, object]:
    d = asdict(spec)
    for k in ("name", "role", "config_classes", "data_key"):
        d.pop(k)
    return {"version": GENERATOR_VERSION, "key": spec.key, "spec": d, "n": n, "size": size, "seed": seed}


def params_hash(spec: SiteSpec, n: int, size: int, seed: int) -> str:
    """Content hash of everything that determines a site's files."""
    return hashlib.sha256(json.dumps(_params(spec, n, size, seed), sort_keys=True, default=list).encode()).hexdigest()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive ``fcntl`` lock on ``path`` (created if needed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _render_range(
    spec: SiteSpec, exams: list[Exam], paths: list[Path], size: int, seed: int, start: int, stop: int
) -> None:
    """Render exams ``start:stop`` and save them to ``paths`` (one worker's share).

    Every image's random stream depends only on its index, its patient and study, so the
    pixels do not depend on how the work is split.
    """
    style = get_style(spec.style)
    base = site_seed(seed, spec)
    anatomy: dict[int, Anatomy] = {}
    for i in range(start, stop):
        ex = exams[i]
        if ex.patient not in anatomy:
            anatomy[ex.patient] = sample_anatomy(np.random.default_rng([*base, 1, ex.patient]), ex.sex, ex.age)
        anat = anatomy[ex.patient]
        if ex.study > 1:
            anat = jitter_position(anat, np.random.default_rng([*base, 3, ex.patient, ex.study]))
        aspect = float(np.random.default_rng([*base, 4, ex.patient, ex.study]).uniform(*style.aspect))
        rng = np.random.default_rng([*base, 2, i])
        img = render_cxr(ex.findings, style, rng, size, view=ex.view, supine=ex.supine, anatomy=anat, aspect=aspect)
        _save(img, paths[i], style.jpeg_quality)


def _workers(n: int) -> int:
    """Worker processes for ``n`` images: ``$CXRFL_SYNTH_WORKERS`` if set, else up to 4 CPUs,
    forked only from a single-threaded, non-daemonic process (e.g. the CLI); otherwise 1."""
    safe = (
        "fork" in multiprocessing.get_all_start_methods()
        and threading.active_count() == 1
        and not multiprocessing.current_process().daemon
    )
    if not safe or n < 200:
        return 1
    if os.environ.get("CXRFL_SYNTH_WORKERS"):
        return max(1, int(os.environ["CXRFL_SYNTH_WORKERS"]))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cpus, n // 100))


def _render_site(spec: SiteSpec, exams: list[Exam], paths: list[Path], size: int, seed: int) -> None:
    """Render and save all images of a site, in parallel processes when worthwhile."""
    for p in {p.parent for p in paths}:
        p.mkdir(parents=True, exist_ok=True)
    workers = _workers(len(exams))
    if workers == 1:
        _render_range(spec, exams, paths, size, seed, 0, len(exams))
        return
    bounds = np.linspace(0, len(exams), workers + 1).astype(int)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        jobs = [
            pool.submit(_render_range, spec, exams, paths, size, seed, int(a), int(b))
            for a, b in zip(bounds[:-1], bounds[1:])
        ]
        for job in jobs:
            job.result()


def _save(img: np.ndarray, path: Path, quality: int) -> None:
    """Save an 8-bit grayscale image as PNG, or as JPEG of the given quality (``.jpg``)."""
    if path.suffix == ".jpg":
        Image.fromarray(img).save(path, quality=quality)
    else:
        Image.fromarray(img).save(path)


def _write_nih(spec: SiteSpec, folder: Path, exams: list[Exam], size: int, seed: int) -> None:
    rng = np.random.default_rng([*site_seed(seed, spec), 5])
    names = [f"{ex.patient:08d}_{ex.study - 1:03d}.png" for ex in exams]
    _render_site(spec, exams, [folder / "images" / n for n in names], size, seed)
    lines = [NIH_HEADER]
    for ex, name in zip(exams, names):
        labels = "|".join(sorted(_NIH_NAME[c] for c in NIH_CLASSES if c in ex.findings)) or "No Finding"
        w, h, sp = _NIH_DETECTORS[int(rng.choice(len(_NIH_DETECTORS), p=_NIH_DETECTOR_P))]
        lines.append(f"{name},{labels},{ex.study - 1},{ex.patient},{ex.age},{ex.sex},{ex.view},{w},{h},{sp},{sp}")
    (folder / NIH_LABELS).write_text("\n".join(lines) + "\n")


def _chexpert_values(exams: list[Exam], rng: np.random.Generator) -> list[dict[str, str]]:
    """CheXpert label cells per study: 1.0, -1.0 (uncertain), 0.0 (explicit negative) or blank."""
    studies: dict[tuple[int, int], dict[str, str]] = {}
    prev = {c: float(np.mean([c in e.findings for e in exams])) for c in CHEXPERT_CLASSES}
    for ex in exams:
        key = (ex.patient, ex.study)
        if key in studies:
            continue
        cells: dict[str, str] = {}
        for c in CHEXPERT_CLASSES:
            u, p = _CHEXPERT_UNCERTAIN[c], max(prev[c], 1e-3)
            q_pos = min(0.35, 0.5 * u / p)
            q_neg = max(0.0, (u - p * q_pos) / max(1.0 - p, 1e-3))
            r = rng.random()
            if c in ex.findings:
                cells[c] = "-1.0" if r < q_pos * 2.0 * (1.0 - ex.findings[c]) else "1.0"
            else:
                cells[c] = "-1.0" if r < q_neg else "0.0" if r < q_neg + _CHEXPERT_NEGATIVE[c] else ""
        pathology = [c for c in CHEXPERT_CLASSES if c != "Support Devices"]
        cells["No Finding"] = "" if any(cells[c] in ("1.0", "-1.0") for c in pathology) else "1.0"
        studies[key] = cells
    return [studies[(ex.patient, ex.study)] for ex in exams]


def _write_chexpert(spec: SiteSpec, folder: Path, exams: list[Exam], size: int, seed: int) -> None:
    values = _chexpert_values(exams, np.random.default_rng([*site_seed(seed, spec), 6]))
    rels: list[str] = []
    view_no: dict[tuple[int, int], int] = {}
    for ex in exams:
        k = view_no[(ex.patient, ex.study)] = view_no.get((ex.patient, ex.study), 0) + 1
        kind = "lateral" if ex.view == "LL" else "frontal"
        rels.append(f"{CHEXPERT_ROOT}/train/patient{ex.patient:05d}/study{ex.study}/view{k}_{kind}.jpg")
    _render_site(spec, exams, [folder / r for r in rels], size, seed)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CHEXPERT_COLUMNS)
    for ex, cells, rel in zip(exams, values, rels):
        lateral = ex.view == "LL"
        sex = "Male" if ex.sex == "M" else "Female"
        row = [rel, sex, ex.age, "Lateral" if lateral else "Frontal", "" if lateral else ex.view, cells["No Finding"]]
        writer.writerow(row + [cells[c] for c in CHEXPERT_CLASSES])
    (folder / CHEXPERT_ROOT / "train.csv").write_text(buf.getvalue())


def _write_csv(spec: SiteSpec, folder: Path, exams: list[Exam], size: int, seed: int) -> None:
    test = spec.role == "test"
    rels = [f"images/p{ex.patient:05d}_s{ex.study}.png" for ex in exams]
    _render_site(spec, exams, [folder / r for r in rels], size, seed)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["path", "patient_id", *(["split"] if test else []), *spec.classes])
    for ex, rel in zip(exams, rels):
        writer.writerow(
            [rel, f"p{ex.patient:05d}", *(["test"] if test else []), *(int(c in ex.findings) for c in spec.classes)]
        )
    (folder / CSV_LABELS).write_text(buf.getvalue())


_WRITERS = {"nih": _write_nih, "chexpert": _write_chexpert, "csv": _write_csv}


def write_site_data(spec: SiteSpec, out: Path, n: int, size: int, seed: int) -> bool:
    """Write one site's images and label file to ``out/<name>`` unless already complete.

    Call with the site's lock held (:func:`write_profile` does).

    Args:
        spec: the site.
        out: the profile folder.
        n: number of images.
        size: image width in pixels.
        seed: the profile seed.

    Returns:
        True when the site was (re)generated, False when an identical one was already there.

    Raises:
        ConfigError: the folder exists but was not written by this generator.
    """
    folder = out / spec.name
    digest = params_hash(spec, n, size, seed)
    marker = folder / MARKER
    if marker.is_file():
        with contextlib.suppress(ValueError, OSError):
            if json.loads(marker.read_text()).get("hash") == digest:
                return False
    elif folder.exists():
        raise ConfigError(
            f"{folder} exists but was not written by 'cxrfl data synth'; remove it or choose another --out"
        )
    for stale in out.glob(f".{spec.name}.tmp-*"):  # left by an interrupted writer (we hold the lock)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out / f".{spec.name}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True)
    exams = sample_cohort(spec.mix, n, np.random.default_rng([*site_seed(seed, spec), 0]), spec.lateral_fraction)
    _WRITERS[spec.format](spec, tmp, exams, size, seed)
    (tmp / MARKER).write_text(json.dumps({"hash": digest, **_params(spec, n, size, seed)}, indent=1, default=list))
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return True


def site_config(spec: SiteSpec, seed: int) -> dict[str, object]:
    """The site config (as a dict, paths relative to the profile folder) of a written site.

    The external test site's label file marks every row ``test`` (``split_column``).

    Args:
        spec: the site.
        seed: the profile seed (also the split seed).
    """
    name = spec.name
    if spec.format == "nih":
        dataset: dict[str, object] = {"format": "nih", "labels": f"{name}/{NIH_LABELS}", "images": f"{name}/images"}
    elif spec.format == "chexpert":
        dataset = {
            "format": "chexpert",
            "labels": f"{name}/{CHEXPERT_ROOT}/train.csv",
            "images": name,
            "uncertain": "zeros",
        }
    else:
        dataset = {
            "format": "csv",
            "labels": f"{name}/{CSV_LABELS}",
            "images": name,
            "path_column": "path",
            "patient_column": "patient_id",
        }
        if spec.role == "test":
            dataset["split_column"] = "split"
    cfg: dict[str, object] = {"site": name, "dataset": dataset}
    if spec.config_classes:
        cfg["classes"] = list(spec.config_classes)
    cfg["split"] = {"train": 0.7, "val": 0.1, "test": 0.2, "seed": int(seed)}
    return cfg


def _write_config(spec: SiteSpec, out: Path, profile: str, seed: int) -> Path:
    path = out / f"{spec.name}.yaml"
    head = (
        f"# synthetic demo site ({profile}, seed {seed}) written by 'cxrfl data synth'; paths relative to this file\n"
    )
    text = head + yaml.safe_dump(site_config(spec, seed), sort_keys=False)
    if not path.is_file() or path.read_text() != text:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
    return path


def write_profile(
    profile: str,
    out: Path,
    *,
    n_per_site: int | None = None,
    image_size: int | None = None,
    seed: int = 0,
    sites: list[str] | None = None,
) -> list[Path]:
    """Write a demo profile's sites (images, label files, site configs) under ``out``.

    Args:
        profile: profile name (:data:`cxrfl.synth.PROFILES`).
        out: output folder.
        n_per_site: images per site (default: each site's own number).
        image_size: image width in pixels (default 128).
        seed: random seed; with it the output is byte-for-byte reproducible.
        sites: only these sites (names or NVFlare ``site-N``), default all.

    Returns:
        the site config paths, in site order.

    Raises:
        ConfigError: unknown profile or site, bad sizes, or an output folder not written by this generator.
    """
    prof = get_profile(profile)
    specs = [prof.resolve(s) for s in sites] if sites else list(prof.sites)
    size = int(image_size or DEFAULT_IMAGE_SIZE)
    if size < 16 or (n_per_site is not None and n_per_site < 1):
        raise ConfigError(f"image size must be >= 16 and n_per_site >= 1 (got {size}, {n_per_site})")
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for spec in specs:
        with _locked(out / f".{spec.name}.lock"):
            write_site_data(spec, out, int(n_per_site or spec.n_images), size, seed)
            paths.append(_write_config(spec, out, prof.name, seed))
    return paths


DEMO_IMAGES_ENV = "CXRFL_DEMO_IMAGES"
"""Images per demo site when a caller names no number (default: the profile's own): a smaller demo."""


def demo_images() -> int | None:
    """``$CXRFL_DEMO_IMAGES`` as a number of images per demo site (None where unset).

    Raises:
        ConfigError: it is set but not a whole number >= 1.
    """
    value = os.environ.get(DEMO_IMAGES_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"${DEMO_IMAGES_ENV}={value!r}: set it to a whole number of images >= 1 or unset it")
    return int(value)


def default_demo_root(profile: str, n_per_site: int | None, image_size: int | None, seed: int) -> Path:
    """Where :func:`demo_site_config` writes: ``$CXRFL_DEMO_DIR`` (default ``~/.cache/cxrfl/demo``)
    / ``<profile>-n<N>-s<S>-seed<K>``."""
    base = Path(os.environ.get("CXRFL_DEMO_DIR") or Path.home() / ".cache" / "cxrfl" / "demo").expanduser()
    n = n_per_site if n_per_site else "default"
    return base / f"{profile}-n{n}-s{int(image_size or DEFAULT_IMAGE_SIZE)}-seed{seed}"


def demo_site_config(
    site: str,
    *,
    root: Path | None = None,
    profile: str = "two-hospitals",
    n_per_site: int | None = None,
    image_size: int | None = None,
    seed: int = 0,
) -> Path:
    """The config of one demo site, generating that site on first use.

    NVFlare's simulator names map to the profile's training sites: ``site-1`` ->
    ``hospital-a``, ``site-2`` -> ``hospital-b``; a profile's own site names map to themselves.
    Safe to call from several processes at once (a file lock per site).

    Args:
        site: the site name or ``site-N``.
        root: output folder (default: :func:`default_demo_root`).
        profile: demo profile.
        n_per_site: images per site (default: ``$CXRFL_DEMO_IMAGES``, else the profile's numbers).
        image_size: image width in pixels (default 128).
        seed: random seed.

    Raises:
        ConfigError: unknown profile or site name, or a bad ``$CXRFL_DEMO_IMAGES``.
    """
    spec = get_profile(profile).resolve(site)
    n_per_site = n_per_site or demo_images()
    root = Path(root) if root is not None else default_demo_root(profile, n_per_site, image_size, seed)
    return write_profile(profile, root, n_per_site=n_per_site, image_size=image_size, seed=seed, sites=[spec.name])[0]
