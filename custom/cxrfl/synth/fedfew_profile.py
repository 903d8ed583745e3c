"""The FedFew paper's setting as the synthetic demo profile ``fedfew`` (registered into
:data:`cxrfl.synth.profiles.PROFILES` by :mod:`cxrfl.synth`'s ``__init__``, so
``cxrfl data synth --profile fedfew`` and ``write_profile("fedfew", ...)`` always give it).

Dong et al. (FedFew) simulate six clients with batches 2-7 of NIH ChestX-ray14: three clients
annotate the 11 common classes (CCs), and each of the other three annotates one
underrepresented class (UC: Edema, Pneumonia, Hernia) with 20 positives and 200 negatives; the
test set holds 100 positives and 100 negatives per UC. Here:

* ``cc-1``, ``cc-2``, ``cc-3``: generic-CSV sites annotating the 11 CCs only (their images
  still show the UCs at NIH's own low rates, unlabelled), NIH-like case mix with the rarest CCs
  raised to >= 4% so that a few hundred images hold positives of every CC;
* ``uc-edema``, ``uc-pneumonia``, ``uc-hernia``: 220 images each, annotated for their one UC
  only, prevalence 20/220 (about 20 positives, 200 negatives; the exact count varies with the
  seed, as a real cohort does);
* ``test-edema``, ``test-pneumonia``, ``test-hernia`` (test only): 200 images each (``n_test``)
  annotated for all 14 NIH findings, with their UC at prevalence 0.5 (about 100 positives, 100
  negatives; the benchmark writes 500 for at least 200 of each).

All sites share the NIH acquisition style: the paper's clients are batches of one dataset, so
the only heterogeneity is in the labels (a style per site would let the energy score learn the
hospital rather than the finding).
"""

from __future__ import annotations

from cxrfl.data.labels import NIH_CLASSES
from cxrfl.synth.cohort import CaseMix
from cxrfl.synth.profiles import PROFILES, Profile, csv_site

FEDFEW_UCS: tuple[str, ...] = ("Edema", "Pneumonia", "Hernia")
"""The paper's underrepresented classes."""
FEDFEW_CCS: tuple[str, ...] = tuple(c for c in NIH_CLASSES if c not in FEDFEW_UCS)
"""The paper's 11 common classes (NIH findings minus the UCs)."""

UC_POSITIVES, UC_NEGATIVES = 20, 200
"""Images per UC site: positives and negatives as in the paper (expected counts)."""

CC_MIX = CaseMix.make(
    0.4,
    {
        "Cardiomegaly": 0.06,
        "Emphysema": 0.04,
        "Fibrosis": 0.04,
        "Pleural Thickening": 0.04,
        "Pneumothorax": 0.05,
        "Mass": 0.05,
        "Nodule": 0.06,
        "Consolidation": 0.05,
    },
)
"""NIH co-occurrence and view mix, the rarest CCs raised; the UCs keep NIH's own low rates."""


def uc_mix(uc: str, prevalence: float) -> CaseMix:
    """NIH-like case mix with one UC at ``prevalence`` (co-occurrence with the CCs kept).

    Args:
        uc: an NIH finding.
        prevalence: its target share of images.
    """
    return CaseMix.make(0.4, {uc: prevalence})


def site_name(uc: str) -> str:
    """The site-name part of a UC (``Pleural Effusion`` -> ``pleural-effusion``)."""
    return uc.lower().replace(" ", "-")


def fedfew_profile(n_cc: int = 400, name: str = "fedfew", n_test: int = 200, n_uc: int | None = None) -> Profile:
    """The paper-like FedFew profile.

    Args:
        n_cc: images per CC site (default; ``--n-per-site`` overrides every site's count).
        name: profile name.
        n_test: images per test site (half of them positive for its UC).
        n_uc: images per UC site, its UC at prevalence 20/220 (None: 220; the benchmark writes more
            so that its training split alone has about 20 positives and 200 negatives).
    """
    cc_sites = tuple(csv_site(f"cc-{k}", FEDFEW_CCS, n_cc, "nih", CC_MIX) for k in (1, 2, 3))
    prevalence = UC_POSITIVES / (UC_POSITIVES + UC_NEGATIVES)
    n_uc = n_uc or UC_POSITIVES + UC_NEGATIVES
    uc_sites = tuple(csv_site(f"uc-{site_name(uc)}", (uc,), n_uc, "nih", uc_mix(uc, prevalence)) for uc in FEDFEW_UCS)
    test_sites = tuple(
        csv_site(f"test-{site_name(uc)}", NIH_CLASSES, n_test, "nih", uc_mix(uc, 0.5), role="test") for uc in FEDFEW_UCS
    )
    return Profile(
        name,
        "FedFew (paper setting): 3 sites with the 11 common classes, 3 sites with one rare class each "
        "(Edema, Pneumonia, Hernia; ~20 positives, ~200 negatives), 3 test sites (~100/100 per rare class)",
        (*cc_sites, *uc_sites, *test_sites),
    )


FEDFEW = fedfew_profile()
PROFILES[FEDFEW.name] = FEDFEW
