"""Synthetic demo data: real label formats, determinism, signs drawn where they belong, site styles."""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from cxrfl.data.labels import CHEXPERT_CLASSES, KNOWN_CLASSES, NIH_CLASSES, NIH_COLUMN_NAMES
from cxrfl.data.site import load_site
from cxrfl.data.site_config import load_site_config
from cxrfl.errors import ConfigError
from cxrfl.synth import PROFILES, SHARED_CLASSES, demo_site_config, render_cxr, sample_cohort, write_profile
from cxrfl.synth.anatomy import sample_anatomy
from cxrfl.synth.profiles import CHEXPERT_MIX, NIH_MIX
from cxrfl.synth.styles import STYLES
from cxrfl.synth.writer import MARKER, NIH_HEADER, _chexpert_values
from PIL import Image
from scipy import ndimage

N = 40
SIZE = 64
# CheXpert's published train.csv header (../shared/NOTES.md, "CheXpert train.csv columns"), written out
# here rather than taken from the writer's constant
REAL_CHEXPERT_HEADER = [
    "Path",
    "Sex",
    "Age",
    "Frontal/Lateral",
    "AP/PA",
    "No Finding",
    "Enlarged Cardiomediastinum",
    "Cardiomegaly",
    "Lung Opacity",
    "Lung Lesion",
    "Edema",
    "Consolidation",
    "Pneumonia",
    "Atelectasis",
    "Pneumothorax",
    "Pleural Effusion",
    "Pleural Other",
    "Fracture",
    "Support Devices",
]
CLEAN = dataclasses.replace(
    STYLES["nih"], noise=0.0, texture=0.0, auto_window=0.0, collimation=0.0, marker=0.0, heel=0.0
)
"""A noise-free style without text, so image differences are the finding's sign alone."""


def _write(out: Path, profile: str = "two-hospitals", sites: list[str] | None = None) -> list[Path]:
    return write_profile(profile, out, n_per_site=N, image_size=SIZE, seed=3, sites=sites)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("synth")
    _write(out)
    return out


def _digest(folder: Path) -> dict[str, str]:
    """Hash of every label file's text and every image's decoded pixels under ``folder``."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.suffix in (".png", ".jpg"):
            out[str(p.relative_to(folder))] = hashlib.sha256(np.asarray(Image.open(p)).tobytes()).hexdigest()
        elif p.suffix in (".csv", ".yaml"):
            out[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def test_same_seed_same_files_and_site_alone_equals_site_with_others(demo: Path, tmp_path: Path) -> None:
    again, alone = tmp_path / "again", tmp_path / "alone"
    _write(again)
    _write(alone, sites=["hospital-b"])
    assert _digest(demo) == _digest(again)
    assert _digest(demo / "hospital-b") == _digest(alone / "hospital-b")
    assert not (alone / "hospital-a").exists()


def test_rewrite_is_skipped_and_changed_parameters_regenerate(tmp_path: Path) -> None:
    _write(tmp_path, sites=["external"])
    marker = tmp_path / "external" / MARKER
    stamp = marker.stat().st_mtime_ns
    _write(tmp_path, sites=["external"])
    assert marker.stat().st_mtime_ns == stamp
    write_profile("two-hospitals", tmp_path, n_per_site=N + 2, image_size=SIZE, seed=3, sites=["external"])
    assert len(pd.read_csv(tmp_path / "external" / "labels.csv")) == N + 2
    (tmp_path / "hospital-a").mkdir()
    with pytest.raises(ConfigError, match="not written by"):
        _write(tmp_path, sites=["hospital-a"])


def test_nih_file_has_the_real_format(demo: Path) -> None:
    path = demo / "hospital-a" / "Data_Entry_2017_v2020.csv"
    assert path.read_text().splitlines()[0] == NIH_HEADER
    table = pd.read_csv(path)
    assert list(table.columns) == [
        "Image Index",
        "Finding Labels",
        "Follow-up #",
        "Patient ID",
        "Patient Age",
        "Patient Gender",
        "View Position",
        "OriginalImage[Width",
        "Height]",
        "OriginalImagePixelSpacing[x",
        "y]",
    ]
    assert table["Image Index"].str.fullmatch(r"\d{8}_\d{3}\.png").all()
    tokens = set(table["Finding Labels"].str.split("|").explode())
    assert tokens <= set(NIH_COLUMN_NAMES) | {"No Finding"}
    assert "Pleural Effusion" not in tokens and "No Finding" in tokens
    assert set(table["View Position"]) <= {"PA", "AP"} and set(table["Patient Gender"]) <= {"M", "F"}
    assert table.groupby("Patient ID").size().max() > 1, "several images per patient"
    first = table.drop_duplicates("Patient ID")
    assert (first["Follow-up #"] == 0).all()
    assert all((demo / "hospital-a" / "images" / name).is_file() for name in table["Image Index"])


def test_chexpert_file_has_the_real_format(demo: Path) -> None:
    root = demo / "hospital-b"
    with open(root / "CheXpert-v1.0-small" / "train.csv", newline="") as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == REAL_CHEXPERT_HEADER  # issue 44 point 3: was compared with the writer's own constant
    table = pd.DataFrame(rows[1:], columns=rows[0])
    labels = REAL_CHEXPERT_HEADER[5:]
    # issue 44 point 3: CheXpert's published coding, every code in use: 1.0 positive, 0.0 negative, -1.0
    # uncertain, blank not mentioned (a writer that lost the uncertain or the explicit negative code passed)
    assert set(table[labels].to_numpy().ravel()) == {"1.0", "0.0", "-1.0", ""}
    # the CheXpert labeler's "No Finding": 1.0 exactly when no pathology (Support Devices aside) is positive
    # or uncertain, else blank
    pathology = table[[c for c in labels[1:] if c != "Support Devices"]].isin(["1.0", "-1.0"]).any(axis=1)
    assert (table["No Finding"] == pathology.map({True: "", False: "1.0"})).all()
    assert table["Age"].str.fullmatch(r"\d{1,3}").all()
    pattern = r"CheXpert-v1\.0-small/train/patient\d{5}/study\d+/view\d_(frontal|lateral)\.jpg"
    assert table["Path"].str.fullmatch(pattern).all()
    assert all((root / p).is_file() for p in table["Path"])
    lateral = table["Frontal/Lateral"] == "Lateral"
    assert 0 < lateral.sum() < 0.3 * len(table)
    assert table.loc[lateral, "Path"].str.endswith("_lateral.jpg").all() and (table.loc[lateral, "AP/PA"] == "").all()
    assert set(table.loc[~lateral, "AP/PA"]) <= {"AP", "PA"} and set(table["Sex"]) <= {"Male", "Female"}
    # labels are per study (one report): every view of a study has the study's cells; views numbered 1, 2, ...
    study = table["Path"].str.rsplit("/", n=1).str[0]
    assert (table.groupby(study)[labels].nunique() == 1).all().all() and study.duplicated().any()
    view = table["Path"].str.extract(r"/view(\d)_", expand=False).astype(int)
    assert all(sorted(v) == list(range(1, len(v) + 1)) for v in view.groupby(study).agg(list))


def test_chexpert_uncertain_labels_are_a_few_percent() -> None:
    exams = [e for e in sample_cohort(CHEXPERT_MIX, 3000, np.random.default_rng(0)) if e.view != "LL"]
    cells = pd.DataFrame(_chexpert_values(exams, np.random.default_rng(1)))
    uncertain = (cells[list(CHEXPERT_CLASSES)] == "-1.0").to_numpy().mean()
    assert 0.01 < uncertain < 0.08
    no_finding = cells["No Finding"] == "1.0"
    assert not (cells.loc[no_finding, [c for c in CHEXPERT_CLASSES if c != "Support Devices"]] == "1.0").any().any()


def test_each_site_labels_only_its_scheme_but_shows_everything(demo: Path) -> None:
    external = pd.read_csv(demo / "external" / "labels.csv")
    assert list(external.columns) == ["path", "patient_id", "split", *KNOWN_CLASSES]
    assert set(external["split"]) == {"test"} and set(external[list(KNOWN_CLASSES)].to_numpy().ravel()) <= {0, 1}
    exams = sample_cohort(NIH_MIX, 2000, np.random.default_rng(0))
    unlabelled = {c: np.mean([c in e.findings for e in exams]) for c in ("Support Devices", "Fracture")}
    assert unlabelled["Support Devices"] > 0.08 and unlabelled["Fracture"] > 0.005, unlabelled


def test_full_vectors_follow_chexpert_hierarchy() -> None:
    for e in sample_cohort(CHEXPERT_MIX, 2000, np.random.default_rng(2)):
        f = e.findings
        if any(
            c in f for c in ("Consolidation", "Pneumonia", "Edema", "Atelectasis", "Infiltration", "Nodule", "Mass")
        ):
            assert "Lung Opacity" in f
        if "Nodule" in f or "Mass" in f:
            assert "Lung Lesion" in f
        if "Cardiomegaly" in f:
            assert "Enlarged Cardiomediastinum" in f
        if "Pleural Thickening" in f:
            assert "Pleural Other" in f
        assert set(f) <= set(KNOWN_CLASSES) and all(0 < s <= 1 for s in f.values())


def _pair(finding: str, severity: float = 0.9, seed: int = 5, size: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """The same patient and acquisition without and with one finding (clean style), as floats."""
    anat = sample_anatomy(np.random.default_rng(seed))
    base = render_cxr({}, CLEAN, np.random.default_rng(1), size, anatomy=anat).astype(float)
    with_ = render_cxr({finding: severity}, CLEAN, np.random.default_rng(1), size, anatomy=anat).astype(float)
    return base, with_


@pytest.mark.parametrize("finding", KNOWN_CLASSES)
def test_every_finding_changes_the_image(finding: str) -> None:
    base, with_ = _pair(finding)
    assert np.abs(with_ - base).max() > 20, finding


def _bright_width(img: np.ndarray, rows: slice, level: float) -> float:
    return float((img[rows] > level).sum(axis=1).mean())


def test_cardiomegaly_widens_the_heart() -> None:
    for seed in range(3):
        base, big = _pair("Cardiomegaly", seed=seed)
        rows = slice(int(0.55 * 128), int(0.68 * 128))
        level = np.percentile(base[rows], 70)
        assert _bright_width(big, rows, level) > _bright_width(base, rows, level) + 6


def test_effusion_brightens_the_lower_zone() -> None:
    for seed in range(3):
        base, eff = _pair("Pleural Effusion", 0.6, seed=seed)
        diff = eff - base
        lower = np.abs(diff[int(0.6 * 128) : int(0.85 * 128)]).mean()
        upper = np.abs(diff[int(0.1 * 128) : int(0.4 * 128)]).mean()
        assert diff[int(0.6 * 128) : int(0.85 * 128)].mean() > 3 and lower > 4 * upper


def _detail(im: np.ndarray, mask: np.ndarray) -> float:
    """Mean high-frequency detail (image minus its blur) inside ``mask``."""
    return float(np.abs(im - ndimage.gaussian_filter(im, 2))[mask].mean())


def test_pneumothorax_darkens_and_clears_the_periphery() -> None:
    for seed in range(3):
        base, ptx = _pair("Pneumothorax", seed=seed)
        diff = ptx - base
        darker = diff < -8
        assert darker.sum() > 60
        rows, cols = np.nonzero(darker)
        assert rows.mean() < 0.6 * 128, "apical / lateral, not basal"
        assert _detail(ptx, darker) < _detail(base, darker), "no lung markings beyond the pleural line"


def test_render_api_contract() -> None:
    img = render_cxr({"Edema": 0.5}, "chexpert", np.random.default_rng(0), 48)
    assert img.dtype == np.uint8 and img.shape == (48, 48)
    again = render_cxr({"Edema": 0.5}, "chexpert", np.random.default_rng(0), 48)
    assert np.array_equal(img, again)
    with pytest.raises(ValueError, match="unknown finding"):
        render_cxr({"Effusion": 0.5}, "nih", np.random.default_rng(0), 48)
    with pytest.raises(ValueError, match="severity"):
        render_cxr({"Edema": 0.0}, "nih", np.random.default_rng(0), 48)


def _stats(paths: list[Path]) -> tuple[float, float, float]:
    """Mean intensity, mean contrast (std) and a noise estimate (high-pass residual) of images."""
    imgs = [np.asarray(Image.open(p), dtype=float) for p in paths]
    noise = [np.median(np.abs(i - ndimage.median_filter(i, 3))) for i in imgs]
    return float(np.mean([i.mean() for i in imgs])), float(np.mean([i.std() for i in imgs])), float(np.mean(noise))


def test_site_styles_differ_measurably(demo: Path) -> None:
    a = _stats(sorted((demo / "hospital-a" / "images").glob("*.png")))
    b = _stats(sorted((demo / "hospital-b").rglob("*_frontal.jpg")))
    c = _stats(sorted((demo / "external" / "images").glob("*.png")))
    for one, two in ((a, b), (a, c), (b, c)):
        noise_ratio = max(one[2], two[2]) / min(one[2], two[2])
        assert abs(one[0] - two[0]) > 5 or abs(one[1] - two[1]) > 5 or noise_ratio > 1.5, (a, b, c)
    assert b[2] > 1.5 * a[2], "the bedside (CheXpert-like) hospital is noisier"


def test_site_configs_are_valid(demo: Path) -> None:
    for name in ("hospital-a", "hospital-b", "external"):
        cfg = load_site_config(demo / f"{name}.yaml")
        assert cfg.site == name and cfg.dataset.labels.is_file() and cfg.dataset.images.is_dir()
    assert load_site_config(demo / "hospital-b.yaml").dataset.uncertain == "zeros"


def test_load_site_reads_every_site_with_its_classes(demo: Path, tmp_path: Path) -> None:
    sites = {name: load_site(demo / f"{name}.yaml") for name in ("hospital-a", "hospital-b", "external")}
    assert set(sites["hospital-a"].classes) == set(NIH_CLASSES)
    assert set(sites["hospital-b"].classes) == set(CHEXPERT_CLASSES)
    assert set(sites["external"].classes) == set(KNOWN_CLASSES) and set(sites["external"].table["split"]) == {"test"}
    a, b = set(sites["hospital-a"].classes), set(sites["hospital-b"].classes)
    assert len(a | b) == 20 and a & b == set(SHARED_CLASSES) and len(SHARED_CLASSES) == 7
    shared = _write(tmp_path, "two-hospitals-shared", sites=["hospital-a", "hospital-b"])
    for cfg in shared:
        assert load_site(cfg).classes == list(SHARED_CLASSES)
    assert _digest(tmp_path / "hospital-a") == _digest(demo / "hospital-a"), "same images as two-hospitals"


def test_demo_site_config_maps_nvflare_names(tmp_path: Path) -> None:
    cfg = demo_site_config("site-1", root=tmp_path, n_per_site=6, image_size=32)
    assert cfg == tmp_path / "hospital-a.yaml" and load_site_config(cfg).site == "hospital-a"
    assert load_site_config(demo_site_config("site-2", root=tmp_path, n_per_site=6, image_size=32)).site == "hospital-b"
    assert demo_site_config("external", root=tmp_path, n_per_site=6, image_size=32) == tmp_path / "external.yaml"
    for bad in ("site-3", "hospital-c"):
        with pytest.raises(ConfigError, match="hospital-a, hospital-b, external"):
            demo_site_config(bad, root=tmp_path)
    with pytest.raises(ConfigError, match="unknown demo profile"):
        demo_site_config("site-1", root=tmp_path, profile="nope")
    assert set(PROFILES) >= {"two-hospitals", "two-hospitals-shared"}


def test_cxrfl_demo_images_sizes_every_demo_site_and_names_itself_when_bad(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CXRFL_DEMO_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXRFL_DEMO_IMAGES", "7")
    for site in ("site-1", "external"):
        cfg = demo_site_config(site, image_size=32)
        assert cfg.parent == tmp_path / "cache" / "two-hospitals-n7-s32-seed0"  # its own folder: no mix of sizes
        assert len(load_site(cfg).table) == 7
    assert len(load_site(demo_site_config("site-1", root=tmp_path / "own", n_per_site=5, image_size=32)).table) == 5
    for bad in ("0", "-3", "many", "2.5"):
        monkeypatch.setenv("CXRFL_DEMO_IMAGES", bad)
        with pytest.raises(ConfigError, match=rf"\$CXRFL_DEMO_IMAGES='{re.escape(bad)}': set it to a whole number"):
            demo_site_config("site-2", image_size=32)


def test_demo_site_config_is_safe_from_two_processes(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from cxrfl.synth import demo_site_config; "
        "print(demo_site_config('site-1', root=Path(sys.argv[1]), n_per_site=30, image_size=48))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and outs[0] == outs[1] == str(tmp_path / "hospital-a.yaml")
    table = pd.read_csv(tmp_path / "hospital-a" / "Data_Entry_2017_v2020.csv")
    assert len(table) == 30 and len(list((tmp_path / "hospital-a" / "images").glob("*.png"))) == 30
    assert json.loads((tmp_path / "hospital-a" / MARKER).read_text())["n"] == 30
    assert not [p for p in tmp_path.iterdir() if re.search(r"\.tmp-", p.name)]


def test_fedfew_profile_is_the_paper_setting_however_it_is_reached(tmp_path: Path) -> None:
    """One `fedfew` profile: 3 CC sites (11 classes), 3 UC sites (Edema, Pneumonia, Hernia), 3 test sites."""
    sites = {s.name: s for s in PROFILES["fedfew"].sites}
    assert list(sites) == [
        "cc-1",
        "cc-2",
        "cc-3",
        "uc-edema",
        "uc-pneumonia",
        "uc-hernia",
        "test-edema",
        "test-pneumonia",
        "test-hernia",
    ]
    ucs = [tuple(sites[f"uc-{u}"].classes) for u in ("edema", "pneumonia", "hernia")]
    assert ucs == [("Edema",), ("Pneumonia",), ("Hernia",)]
    assert len(sites["cc-1"].classes) == 11 and "Edema" not in sites["cc-1"].classes
    code = (
        "from cxrfl.synth.profiles import get_profile; "  # a fresh process importing only the profiles module
        "print(','.join(s.name for s in get_profile('fedfew').sites))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == ",".join(sites), proc.stderr[-2000:]
    (cfg,) = write_profile("fedfew", tmp_path, n_per_site=6, image_size=SIZE, seed=0, sites=["uc-hernia"])
    assert load_site_config(cfg).site == "uc-hernia"
