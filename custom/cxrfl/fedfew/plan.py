"""Which classes are common (CCs) and which underrepresented (UCs), and which sites take part in which stage.

The server decides this once, from every site's ``fedfew_info`` answer (class names and training
label counts, never images); :class:`cxrfl.fedfew.server.FedFewServer` then sends each site its
own UCs only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cxrfl.fedfew.config import FedFewConfig


@dataclass
class ClassPlan:
    """Which classes are CCs and UCs, and who holds them.

    Args:
        cc_classes: the CCs, sorted (the network's output order, then "no CC").
        uc_classes: the UCs, sorted.
        uc_sites: UC -> the sites that label it.
        site_ucs: site -> the UCs it labels.
        stage2_sites: sites with labelled training images (stages 2 and 3).
        cc_sites: sites that label at least one CC (the only ones with a loss in warm-up rounds).
        ssl_sites: sites with images for stage 1.
        notes: messages about sites and classes left out, and why.
    """

    cc_classes: list[str]
    uc_classes: list[str]
    uc_sites: dict[str, list[str]]
    site_ucs: dict[str, list[str]]
    stage2_sites: list[str]
    cc_sites: list[str]
    ssl_sites: list[str]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-friendly values (``cxrfl/plan.json``)."""
        return {
            "cc_classes": self.cc_classes,
            "uc_classes": self.uc_classes,
            "uc_sites": self.uc_sites,
            "site_ucs": self.site_ucs,
            "stage2_sites": self.stage2_sites,
            "cc_sites": self.cc_sites,
            "ssl_sites": self.ssl_sites,
            "notes": self.notes,
        }


def split_classes(infos: Mapping[str, Mapping[str, Any]], config: FedFewConfig) -> ClassPlan:
    """Tell CCs from UCs using the sites' class names and training label counts.

    With ``config.uc_classes`` the UCs are those; otherwise a class is a UC when it is labelled
    at fewer than ``cc_min_sites`` sites and has fewer than ``uc_max_positives`` positive
    training images over the federation (few labels AND few clients, the paper's definition).
    Every other labelled class is a CC.

    Args:
        infos: site -> its ``info`` answer (:meth:`cxrfl.fedfew.learner.FedFewSite.info`).
        config: the settings.
    """
    notes: list[str] = []
    ssl_sites = sorted(s for s, i in infos.items() if int(i.get("n_ssl", 0)) >= 2)
    for s in sorted(set(infos) - set(ssl_sites)):
        notes.append(f"site {s} has fewer than 2 images for self-supervised training; it sits out stage 1")
    labelled = sorted(s for s, i in infos.items() if int(i.get("n_labelled", 0)) > 0)
    for s in sorted(set(infos) - set(labelled)):
        notes.append(
            f"site {s} has no labelled training image: it takes part in stage 1 only (no classifier "
            "training, no threshold statistics, no prototypes)"
        )
    sites_of: dict[str, list[str]] = {}
    positives: dict[str, int] = {}
    for s in labelled:
        for c in infos[s].get("classes", []):
            known = int(infos[s].get("positives", {}).get(c, 0)) + int(infos[s].get("negatives", {}).get(c, 0))
            if known == 0:
                continue
            sites_of.setdefault(c, []).append(s)
            positives[c] = positives.get(c, 0) + int(infos[s].get("positives", {}).get(c, 0))
    if config.uc_classes is not None:
        ucs = sorted(c for c in config.uc_classes if c in sites_of)
        for c in sorted(set(config.uc_classes) - set(sites_of)):
            notes.append(f"UC {c!r} (fedfew.uc_classes) is labelled at no site; it is left out")
    else:
        ucs = sorted(
            c for c in sites_of if len(sites_of[c]) < config.cc_min_sites and positives[c] < config.uc_max_positives
        )
    ccs = sorted(c for c in sites_of if c not in ucs)
    site_ucs = {s: [c for c in ucs if s in sites_of[c]] for s in labelled}
    for c in ucs:
        for s in sites_of[c]:
            n_pos = int(infos[s]["positives"].get(c, 0))
            n_neg = int(infos[s]["negatives"].get(c, 0))
            if min(n_pos, n_neg) < config.min_prototype_images:
                notes.append(
                    f"site {s} labels UC {c!r} with {n_pos} positive and {n_neg} negative training image(s), "
                    "fewer than "
                    f"fedfew.min_prototype_images={config.min_prototype_images}: it will refuse to send that prototype"
                )
    cc_sites = sorted({s for c in ccs for s in sites_of[c]})
    return ClassPlan(ccs, ucs, {c: sorted(sites_of[c]) for c in ucs}, site_ucs, labelled, cc_sites, ssl_sites, notes)
