"""One site's usable data: labels read, images checked, patients split, problems listed."""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from cxrfl.data.images import ImageError, read_image
from cxrfl.data.readers import read_labels
from cxrfl.data.site_config import SiteConfig, load_site_config
from cxrfl.data.splits import SPLITS, patient_split, resolve_overlap, val_from_train
from cxrfl.data.subgroups import SUBGROUP_FIELDS
from cxrfl.errors import DataError

log = logging.getLogger(__name__)


@dataclass
class SiteData:
    """A site's images, labels and splits.

    Args:
        site: the site name.
        classes: canonical class names the site contributes, in label column order (never a
            subgroup field).
        table: one row per usable image: ``path`` (absolute), ``patient``, ``split``
            (``train``/``val``/``test``), then one float column per class: 1.0, 0.0 or NaN
            (NaN = not annotated, masked out of loss and metrics), then the subgroup fields the
            data has (``sex``, ``age``, ``view``; NaN = unknown: :mod:`cxrfl.data.subgroups`).
        skipped: ``(image path, reason)`` of images left out as missing or unreadable.
        problems: warnings that do not stop the site (a class without positives in a split ...).
        cache_dir: the site's preprocessing cache on disk, a folder of its own workspace
            (:mod:`cxrfl.data.cache`; NVFlare sites: ``<workspace>/cxrfl_state/image_cache``);
            None: images are decoded every epoch (evaluation splits cached in memory).
    """

    site: str
    classes: list[str]
    table: pd.DataFrame
    skipped: list[tuple[str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    cache_dir: Path | None = None

    def split_table(self, name: str) -> pd.DataFrame:
        """The rows of one split, re-indexed from 0.

        Args:
            name: ``train``, ``val`` or ``test``.
        """
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; use one of {', '.join(SPLITS)}")
        return self.table[self.table["split"] == name].reset_index(drop=True)

    def split_sizes(self) -> dict[str, int]:
        """Images per split (``train``, ``val``, ``test``)."""
        return {s: int((self.table["split"] == s).sum()) for s in SPLITS}

    def positives(self, split: str | None = None) -> dict[str, int]:
        """Positive images per class.

        Args:
            split: count in this split only (default: all images).
        """
        table = self.table if split is None else self.split_table(split)
        return {c: int((table[c] == 1.0).sum()) for c in self.classes}

    def negatives(self, split: str | None = None) -> dict[str, int]:
        """Negative images per class.

        Args:
            split: count in this split only (default: all images).
        """
        table = self.table if split is None else self.split_table(split)
        return {c: int((table[c] == 0.0).sum()) for c in self.classes}

    def one_sided_classes(self, split: str | None = None) -> dict[str, float]:
        """Classes whose labelled images all have one value: class -> that value.

        1.0: no negatives (a registry of one disease: its head row cannot learn to say no);
        0.0: no positives. Classes without any labelled image are left out.

        Args:
            split: look at this split only (default: all images).
        """
        pos, neg = self.positives(split), self.negatives(split)
        return {c: 1.0 if pos[c] else 0.0 for c in self.classes if (pos[c] == 0) != (neg[c] == 0)}


def untrainable_classes(data: SiteData) -> list[str]:
    """The classes a site leaves out of its training and validation loss: those whose training
    images all carry one label value (logged in one line).

    Trained on such labels, a head row learns a constant: with 1.0 (a registry of one disease) it
    cannot learn to say no, with 0.0 it cannot learn to say yes. So a site never trains a row on one
    value alone, whatever the method (individual model, personalized FL, vanilla FL, FL with partial
    loss, surgical aggregation; issue 41): the row is trained where both values exist. A site cannot
    see whether another site has the other value, so it leaves the class out even then; with the
    same rule at every site, vanilla FL over identical label sets stays surgical aggregation. The
    test split is evaluated as it is. Centralized training pools the images first: there a class
    is one-sided only if it is so over all sites (another site's missing label counts as negative).
    Cyclical weight transfer keeps its paper's protocol instead: a site trains the relay's one model
    on whatever labels it has, and LWMS/CWL say when they cannot balance a one-sided class
    (:func:`cxrfl.cwt.optimizations.label_warnings`).

    Args:
        data: the loaded site.

    Raises:
        DataError: every class of the site is such a class (it would train nothing).
    """
    found = data.one_sided_classes("train")
    if not found:
        return []
    parts = [f"{c!r} ({'positive' if v == 1.0 else 'negative'} only)" for c, v in sorted(found.items())]
    what = (
        f"site {data.site}: class(es) {', '.join(parts)} have one label value in every training image here, so "
        "their head row(s) cannot learn to tell the two apart"
    )
    if len(found) == len(data.classes):
        raise DataError(
            f"{what}; they are all its classes, so it has nothing to train: add images with the other value "
            "or leave the site out of this job"
        )
    log.warning("%s: left out of this site's training and validation loss (add images with the other value)", what)
    return sorted(found)


def training_refusal(data: SiteData) -> str | None:
    """Why a federated job refuses this site at start-up (an empty train or val split), or None.

    The one check both the job's site start-up (:class:`cxrfl.fl.base.TaskExecutor`) and
    ``cxrfl data summary`` run.

    Args:
        data: the loaded site.
    """
    splits = data.split_sizes()
    if splits["train"] == 0 or splits["val"] == 0:
        return f"site {data.site}: empty train or val split {splits}; add images or change split fractions"
    return None


def _image_problem(path: str, decode: bool) -> str | None:
    """Why an image cannot be used, or None."""
    if not decode:
        return None if os.path.isfile(path) else "missing"
    try:
        read_image(path)
    except ImageError as exc:
        return exc.reason
    return None


def _check_images(table: pd.DataFrame, config: SiteConfig, decode: bool) -> list[tuple[str, str]]:
    """Find missing (and, with ``decode``, unreadable) images; apply ``bad_images``."""
    paths = table["path"].tolist()
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        reasons = list(pool.map(lambda p: _image_problem(p, decode), paths, chunksize=64))
    bad = [(p, r) for p, r in zip(paths, reasons) if r is not None]
    where = f" (site config {config.source})" if config.source else ""
    if bad and config.bad_images == "error":
        path, reason = bad[0]
        raise DataError(
            f"cannot use image {path}: {reason}; fix or remove it, or set bad_images: skip{where} "
            f"({len(bad)} bad image(s) in all)"
        )
    if bad and len(bad) > config.max_bad_fraction * len(paths):
        path, reason = bad[0]
        raise DataError(
            f"{len(bad)} of {len(paths)} images of site {config.site!r} are missing or unreadable "
            f"({len(bad) / len(paths):.1%} > max_bad_fraction {config.max_bad_fraction:.1%}); first: {path}: "
            f"{reason}. Check dataset.images ({config.dataset.images}){where}"
        )
    return bad


def _split_problems(table: pd.DataFrame, classes: list[str], expected: tuple[str, ...], minimum: int) -> list[str]:
    """Warnings about empty splits, one-sided classes, and classes with no or fewer than ``minimum``
    positive or negative images in a split."""
    problems = [f"split {name!r} has no images" for name in expected if not (table["split"] == name).any()]
    present = [s for s in SPLITS if (table["split"] == s).any()]
    for c in classes:
        for side, value in (("positive", 1.0), ("negative", 0.0)):
            hit = table[c] == value
            if not hit.any() and side == "positive":
                problems.append(
                    f"class {c!r} has no positive image at this site; its AUROC cannot be computed and every "
                    "federated method leaves it out of this site's loss (cxrfl.data.site.untrainable_classes)"
                )
                break
            if not hit.any():
                problems.append(
                    f"class {c!r} has no negative image at this site ({int((table[c] == 1.0).sum())} "
                    "labelled, all positive); its head row cannot learn to say no and its AUROC cannot "
                    "be computed; every federated method leaves it out of this site's loss "
                    "(cxrfl.data.site.untrainable_classes)"
                )
                break
            counts = {s: int(hit[table["split"] == s].sum()) for s in present}
            empty = [s for s in present if counts[s] == 0]
            if empty:
                problems.append(
                    f"class {c!r} has no {side} image in split(s) {', '.join(empty)} ({int(hit.sum())} in all)"
                )
            few = [f"{s} ({counts[s]})" for s in present if 0 < counts[s] < minimum]
            if few:
                problems.append(
                    f"class {c!r} has fewer than {minimum} {side} images in split(s) {', '.join(few)} "
                    "(min_class_images); its AUROC there is unreliable"
                )
    return problems


def load_site(config: SiteConfig | str | Path, *, check_images: bool = True) -> SiteData:
    """Read, check and split one site's data.

    Missing images are always detected; with ``check_images`` every image is also decoded.
    Bad images are skipped (``bad_images: skip``, up to ``max_bad_fraction``) or raise
    (``bad_images: error``). A split given by the data (``split_file``/``split_column``/
    ``split_folders``) is used after ``dataset.overlap`` settled the patients in two splits
    (:func:`cxrfl.data.splits.resolve_overlap`); without a val split, one is taken from the train
    patients (:func:`cxrfl.data.splits.val_from_train`). Otherwise patients are split by
    :func:`cxrfl.data.splits.patient_split`.

    Args:
        config: a site config or the path of its YAML file.
        check_images: decode every image (slow for very large sites).

    Raises:
        ConfigError: the config is invalid.
        DataError: labels or images cannot be used (the message names the file).
    """
    if not isinstance(config, SiteConfig):
        config = load_site_config(config)
    table = read_labels(config)
    problems = list(table.attrs.get("problems", []))
    classes = [c for c in table.columns if c not in ("path", "patient", "split", *SUBGROUP_FIELDS)]
    skipped = _check_images(table, config, decode=check_images)
    if skipped:
        table = table[~table["path"].isin({p for p, _ in skipped})].reset_index(drop=True)
        problems.append(f"{len(skipped)} image(s) skipped as missing or unreadable")
    if table.empty:
        raise DataError(f"site {config.site!r} has no usable image ({config.dataset.label_source})")
    if "split" in table:
        source = config.dataset.split_file or config.dataset.label_source
        table = resolve_overlap(table, config.dataset.overlap, source, problems)
    if "split" in table:
        table = val_from_train(table, classes, config.split, problems)
        expected = SPLITS
    else:
        table.insert(2, "split", patient_split(table, classes, config.split))
        fractions = (config.split.train, config.split.val, config.split.test)
        expected = tuple(s for s, f in zip(SPLITS, fractions) if f > 0)
    problems += _split_problems(table, classes, expected, config.min_class_images)
    return SiteData(site=config.site, classes=classes, table=table, skipped=skipped, problems=problems)
