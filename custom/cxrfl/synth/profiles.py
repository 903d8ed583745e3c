"""Demo profiles: sets of synthetic sites, each with a label scheme, file format, style and case mix.

A :class:`SiteSpec` says everything that makes a site different: the published format its
label file follows (``nih``, ``chexpert`` or a generic ``csv``), the classes it annotates, its
acquisition style, its case mix and size. A site's images are determined by its ``data_key``
(its name by default) and the seed, so profiles that describe the same hospital differently
(e.g. with a restricted ``classes`` list in the site config) share the very same images.

Profiles:

* ``two-hospitals``: ``hospital-a`` (NIH format, 14 findings, PA-heavy outpatient mix),
  ``hospital-b`` (CheXpert format, 13 findings, bedside AP/ICU mix, laterals, uncertain
  labels) and ``external`` (all 20 findings, a third style, test only).
* ``two-hospitals-shared``: the same sites and images, both hospitals restricted to their 7
  shared classes (the no-class-heterogeneity control).
* ``sites-4``: four generic-CSV hospitals sharing 4 classes and splitting the other 16.
* ``fedfew``: the FedFew paper's setting, three common-class sites and three sites with one
  rare class each (defined in :mod:`cxrfl.synth.fedfew_profile`, registered here when
  :mod:`cxrfl.synth` is imported, which any import of this module does first).
* ``load-10``: ten small sites alternating NIH and CheXpert formats (load test); ``load-<K>`` the same
  with K sites (:func:`get_profile`).

New profiles are a few lines with :func:`nih_site`, :func:`chexpert_site`, :func:`csv_site`
and :func:`partition_profile`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from cxrfl.data.labels import CHEXPERT_CLASSES, KNOWN_CLASSES, NIH_CLASSES
from cxrfl.errors import ConfigError
from cxrfl.synth.cohort import CaseMix
from cxrfl.synth.styles import STYLES

FORMATS = ("nih", "chexpert", "csv")
SHARED_CLASSES: tuple[str, ...] = tuple(sorted(set(NIH_CLASSES) & set(CHEXPERT_CLASSES)))
"""The 7 findings both NIH and CheXpert annotate."""
DEFAULT_IMAGE_SIZE = 128


@dataclass(frozen=True)
class SiteSpec:
    """One synthetic site.

    Args:
        name: the site name (folder, config file and NVFlare client name).
        format: label file format: ``nih``, ``chexpert`` or ``csv``.
        classes: the classes its label file annotates (canonical names).
        style: acquisition style name (:data:`cxrfl.synth.styles.STYLES`).
        n_images: default number of images.
        mix: case mix.
        role: ``train`` (an FL client) or ``test`` (held-out evaluation site).
        config_classes: ``classes`` written into the site config (None: all annotated).
        data_key: identity of the images (default: ``name``); equal keys, equal images.
        lateral_fraction: share of studies with an extra lateral image (CheXpert format).
    """

    name: str
    format: str
    classes: tuple[str, ...]
    style: str
    n_images: int
    mix: CaseMix
    role: str = "train"
    config_classes: tuple[str, ...] | None = None
    data_key: str | None = None
    lateral_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"site {self.name}: format {self.format!r} is not one of {', '.join(FORMATS)}")
        if self.style not in STYLES:
            raise ValueError(f"site {self.name}: unknown style {self.style!r}")
        bad = [c for c in (*self.classes, *(self.config_classes or ())) if c not in KNOWN_CLASSES]
        if bad:
            raise ValueError(f"site {self.name}: unknown classes {bad}")
        if self.format == "nih" and set(self.classes) != set(NIH_CLASSES):
            raise ValueError(f"site {self.name}: an NIH-format file annotates exactly the 14 NIH findings")
        if self.format == "chexpert" and set(self.classes) != set(CHEXPERT_CLASSES):
            raise ValueError(f"site {self.name}: a CheXpert-format file annotates exactly the 13 CheXpert findings")

    @property
    def key(self) -> str:
        """The identity of this site's images (seed derivation, marker)."""
        return self.data_key or self.name


@dataclass(frozen=True)
class Profile:
    """A named set of sites.

    Args:
        name: profile name.
        description: one line for listings.
        sites: the sites; training sites first, in NVFlare ``site-1``, ``site-2`` ... order.
    """

    name: str
    description: str
    sites: tuple[SiteSpec, ...]

    @property
    def training_sites(self) -> tuple[SiteSpec, ...]:
        """The sites that take part in federated training, in ``site-N`` order."""
        return tuple(s for s in self.sites if s.role == "train")

    def resolve(self, site: str) -> SiteSpec:
        """The site named ``site``, or for NVFlare's ``site-N`` the N-th training site.

        Raises:
            ConfigError: no such site in this profile.
        """
        for spec in self.sites:
            if spec.name == site:
                return spec
        match = re.fullmatch(r"site-(\d+)", site)
        train = self.training_sites
        if match and 1 <= int(match.group(1)) <= len(train):
            return train[int(match.group(1)) - 1]
        names = ", ".join(s.name for s in self.sites)
        nv = f"site-1 ... site-{len(train)}" if len(train) > 1 else "site-1"
        raise ConfigError(
            f"demo profile {self.name!r} has no site {site!r}; its sites are {names} "
            f"(NVFlare names {nv} map to its training sites in that order)"
        )


NIH_MIX = CaseMix.make(
    0.4,
    {
        "Hernia": 0.03,
        "Pneumonia": 0.04,
        "Edema": 0.04,
        "Fibrosis": 0.04,
        "Emphysema": 0.04,
        "Cardiomegaly": 0.06,
        "Pleural Thickening": 0.04,
    },
    {"Support Devices": 0.15, "Fracture": 0.02},
)
"""NIH-like outpatient mix: NIH's own co-occurrence and view mix, rare findings raised to >= 3%
(as in the nih1000 sample) so that a 500-image site has positives of every class."""

CHEXPERT_MIX = CaseMix.make(
    0.82,
    {
        "Cardiomegaly": 0.12,
        "Edema": 0.22,
        "Pleural Effusion": 0.38,
        "Consolidation": 0.07,
        "Pneumonia": 0.04,
        "Atelectasis": 0.15,
        "Pneumothorax": 0.09,
        "Nodule": 0.025,
        "Mass": 0.02,
    },
    {"Support Devices": 0.5, "Fracture": 0.035, "Enlarged Cardiomediastinum": 0.02, "Lung Opacity": 0.03},
    supine_fraction=0.5,
    severity=(1.5, 1.4),
)
"""CheXpert-like inpatient mix (its published positive rates): mostly bedside AP, many devices,
effusions and edema."""

EXTERNAL_MIX = CaseMix.make(
    0.55,
    {
        "Cardiomegaly": 0.14,
        "Edema": 0.1,
        "Pleural Effusion": 0.2,
        "Consolidation": 0.06,
        "Pneumonia": 0.06,
        "Atelectasis": 0.16,
        "Pneumothorax": 0.06,
        "Nodule": 0.05,
        "Mass": 0.04,
        "Hernia": 0.03,
        "Emphysema": 0.05,
        "Fibrosis": 0.04,
        "Pleural Thickening": 0.04,
    },
    {
        "Support Devices": 0.3,
        "Fracture": 0.05,
        "Enlarged Cardiomediastinum": 0.03,
        "Lung Opacity": 0.03,
        "Pleural Other": 0.02,
    },
)
"""MIMIC-like mixed mix for the external test site, every class >= 3%."""


def nih_site(name: str, n_images: int = 500, style: str = "nih", mix: CaseMix = NIH_MIX, **kw: object) -> SiteSpec:
    """An NIH ChestX-ray14-format site (14 findings).

    Args:
        name: site name.
        n_images: default number of images.
        style: acquisition style.
        mix: case mix.
        kw: further :class:`SiteSpec` fields.
    """
    return SiteSpec(name, "nih", NIH_CLASSES, style, n_images, mix, **kw)  # type: ignore[arg-type]


def chexpert_site(
    name: str, n_images: int = 500, style: str = "chexpert", mix: CaseMix = CHEXPERT_MIX, **kw: object
) -> SiteSpec:
    """A CheXpert-format site (13 findings, uncertain labels, some lateral images).

    Args:
        name: site name.
        n_images: default number of images.
        style: acquisition style.
        mix: case mix.
        kw: further :class:`SiteSpec` fields.
    """
    kw.setdefault("lateral_fraction", 0.1)
    return SiteSpec(name, "chexpert", CHEXPERT_CLASSES, style, n_images, mix, **kw)  # type: ignore[arg-type]


def csv_site(
    name: str,
    classes: tuple[str, ...] = KNOWN_CLASSES,
    n_images: int = 300,
    style: str = "mimic",
    mix: CaseMix = EXTERNAL_MIX,
    **kw: object,
) -> SiteSpec:
    """A generic-CSV site annotating ``classes`` (0/1 columns).

    Args:
        name: site name.
        classes: the annotated classes.
        n_images: default number of images.
        style: acquisition style.
        mix: case mix.
        kw: further :class:`SiteSpec` fields.
    """
    return SiteSpec(name, "csv", tuple(classes), style, n_images, mix, **kw)  # type: ignore[arg-type]


def partition_profile(name: str, n_sites: int, n_shared: int, n_images: int = 300) -> Profile:
    """N generic-CSV hospitals that share ``n_shared`` classes and split the rest round-robin.

    Args:
        name: profile name.
        n_sites: number of training sites.
        n_shared: number of classes every site annotates (the most common ones first).
        n_images: images per site.
    """
    common = (
        "Pleural Effusion",
        "Atelectasis",
        "Cardiomegaly",
        "Pneumothorax",
        "Consolidation",
        "Edema",
        "Pneumonia",
        "Lung Opacity",
        "Support Devices",
        "Nodule",
        "Mass",
        "Infiltration",
    )
    order = list(common) + [c for c in KNOWN_CLASSES if c not in common]
    shared, rest = order[:n_shared], order[n_shared:]
    styles = ("nih", "chexpert", "community", "mimic")
    mixes = (NIH_MIX, CHEXPERT_MIX, EXTERNAL_MIX)
    sites = tuple(
        csv_site(
            f"hospital-{k + 1}",
            tuple(sorted(shared + rest[k::n_sites])),
            n_images,
            styles[k % len(styles)],
            mixes[k % len(mixes)],
        )
        for k in range(n_sites)
    )
    test = csv_site("external", KNOWN_CLASSES, 300, "mimic", EXTERNAL_MIX, role="test")
    return Profile(
        name, f"{n_sites} CSV hospitals sharing {n_shared} classes, the rest split between them", (*sites, test)
    )


def _two_hospitals() -> Profile:
    sites = (
        nih_site("hospital-a", 2000),
        chexpert_site("hospital-b", 2000),
        csv_site("external", n_images=1000, role="test"),
    )
    return Profile(
        "two-hospitals", "NIH-like hospital-a (14 classes), CheXpert-like hospital-b (13), external test (20)", sites
    )


def _shared(base: Profile) -> Profile:
    sites = tuple(replace(s, config_classes=SHARED_CLASSES) if s.role == "train" else s for s in base.sites)
    return Profile(
        "two-hospitals-shared", "two-hospitals with both hospitals restricted to their 7 shared classes", sites
    )


def _load(n_sites: int) -> Profile:
    sites = tuple(
        nih_site(f"clinic-{k + 1:02d}", 60) if k % 2 == 0 else chexpert_site(f"clinic-{k + 1:02d}", 60)
        for k in range(n_sites)
    )
    return Profile(f"load-{n_sites}", f"{n_sites} small sites alternating NIH and CheXpert formats (load test)", sites)


_TWO = _two_hospitals()
PROFILES: dict[str, Profile] = {p.name: p for p in (_TWO, _shared(_TWO), partition_profile("sites-4", 4, 4), _load(10))}
"""The registered demo profiles by name (``fedfew`` is added by :mod:`cxrfl.synth.fedfew_profile`)."""


def get_profile(name: str) -> Profile:
    """The profile called ``name``.

    ``load-<K>`` exists for every K >= 2 (K small sites for ``cxrfl bench load``).

    Raises:
        ConfigError: unknown profile.
    """
    if name.startswith("load-") and name[5:].isdigit() and int(name[5:]) >= 2:
        return PROFILES.get(name) or _load(int(name[5:]))
    if name not in PROFILES:
        raise ConfigError(f"unknown demo profile {name!r}; available: {', '.join(PROFILES)}, load-<K>")
    return PROFILES[name]
