"""A site's data summary (``cxrfl data summary``): counts per class and split, skips, problems."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cxrfl.data.site import load_site, training_refusal
from cxrfl.data.site_config import SiteConfig, load_site_config
from cxrfl.data.splits import SPLITS
from cxrfl.data.subgroups import describe_subgroups, subgroups_line

EXAMPLES = 5  # skipped images shown by name


def summarise(config: SiteConfig | str | Path, *, check_images: bool = True) -> dict[str, Any]:
    """Load a site and count what it holds (plain JSON-serialisable values).

    Args:
        config: a site config or the path of its YAML file.
        check_images: decode every image (see :func:`cxrfl.data.site.load_site`).

    Returns:
        ``site``, ``format``, ``labels`` (file), ``images`` (count), ``patients``, ``classes``,
        ``positives`` and ``negatives`` (class -> count), ``unknown`` (class -> images without a
        label), ``one_sided`` (class -> its only label value: :meth:`cxrfl.data.site.SiteData.one_sided_classes`),
        ``splits`` (split -> images), ``split_patients``, ``split_positives``
        (split -> class -> count), ``skipped`` (count), ``skipped_examples`` (first
        ``[path, reason]`` pairs), ``subgroups`` (:func:`cxrfl.data.subgroups.describe_subgroups`),
        ``problems`` and ``refused`` (why a federated job refuses the site
        at start-up: :func:`cxrfl.data.site.training_refusal`; None when it takes part).
    """
    if not isinstance(config, SiteConfig):
        config = load_site_config(config)
    data = load_site(config, check_images=check_images)
    table = data.table
    return {
        "site": data.site,
        "format": config.dataset.format,
        "labels": str(config.dataset.label_source.resolve()),
        "images": len(table),
        "patients": int(table["patient"].nunique()),
        "classes": list(data.classes),
        "positives": data.positives(),
        "negatives": data.negatives(),
        "unknown": {c: int(table[c].isna().sum()) for c in data.classes},
        "one_sided": data.one_sided_classes(),
        "splits": {s: int((table["split"] == s).sum()) for s in SPLITS},
        "split_patients": {s: int(table.loc[table["split"] == s, "patient"].nunique()) for s in SPLITS},
        "split_positives": {s: data.positives(s) for s in SPLITS},
        "skipped": len(data.skipped),
        "skipped_examples": [[p, r] for p, r in data.skipped[:EXAMPLES]],
        "subgroups": describe_subgroups(table),
        "problems": list(data.problems),
        "refused": training_refusal(data),
    }


def format_summary(summary: dict[str, Any]) -> str:
    """A terminal table of a :func:`summarise` result.

    Args:
        summary: the dict returned by :func:`summarise`.
    """
    lines = [
        f"site {summary['site']} ({summary['format']}: {summary['labels']})",
        f"{summary['images']} images, {summary['patients']} patients, {len(summary['classes'])} classes, "
        f"{summary['skipped']} skipped",
        "",
    ]
    width = max([len("class"), len("images (patients)"), *(len(c) for c in summary["classes"])])
    header = ["all", *SPLITS, "negatives", "unknown"]
    lines.append(f"{'class':<{width}}  " + "  ".join(f"{h:>14}" for h in header))
    for c in summary["classes"]:
        cells = [
            summary["positives"][c],
            *(summary["split_positives"][s][c] for s in SPLITS),
            summary["negatives"][c],
            summary["unknown"][c],
        ]
        lines.append(f"{c:<{width}}  " + "  ".join(f"{v:>14}" for v in cells))
    counts = [
        f"{summary['images']} ({summary['patients']})",
        *(f"{summary['splits'][s]} ({summary['split_patients'][s]})" for s in SPLITS),
        "",
        "",
    ]
    lines.append(f"{'images (patients)':<{width}}  " + "  ".join(f"{v:>14}" for v in counts))
    subgroups = subgroups_line(summary["subgroups"])
    if subgroups:
        lines += ["", subgroups]
    if summary["skipped_examples"]:
        lines += ["", "skipped images:"]
        lines += [f"  {p}: {r}" for p, r in summary["skipped_examples"]]
        if summary["skipped"] > len(summary["skipped_examples"]):
            lines.append(f"  ... and {summary['skipped'] - len(summary['skipped_examples'])} more")
    if summary["problems"]:
        lines += ["", "problems:"]
        lines += [f"  - {p}" for p in summary["problems"]]
    return "\n".join(lines)
