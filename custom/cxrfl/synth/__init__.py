"""Synthetic chest X-ray demo data: realistic signs, real label-file formats, non-IID sites.

``write_profile`` writes a demo profile's sites (images + label files in the published NIH,
CheXpert or generic-CSV format + site configs); ``demo_site_config`` lazily generates one site
for the NVFlare simulator; ``render_cxr`` draws a single radiograph from a finding vector.
See ``shared/SYNTHETIC.md`` for what the images show and why.
"""

from cxrfl.synth import fedfew_profile as _fedfew_profile  # noqa: F401  registers the `fedfew` profile
from cxrfl.synth.cohort import CaseMix, Exam, sample_cohort
from cxrfl.synth.profiles import PROFILES, SHARED_CLASSES, Profile, SiteSpec, get_profile
from cxrfl.synth.render import render_cxr
from cxrfl.synth.styles import STYLES, AcquisitionStyle
from cxrfl.synth.writer import demo_site_config, write_profile

__all__ = [
    "PROFILES",
    "SHARED_CLASSES",
    "STYLES",
    "AcquisitionStyle",
    "CaseMix",
    "Exam",
    "Profile",
    "SiteSpec",
    "demo_site_config",
    "get_profile",
    "render_cxr",
    "sample_cohort",
    "write_profile",
]
