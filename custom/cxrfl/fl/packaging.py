"""How a job carries its code: one vocabulary for the recipes (``custom``), :func:`cxrfl.jobs.write_job`
and ``cxrfl deploy job --mode`` (no NVFlare import: :mod:`cxrfl.jobs` reads it before any job is written).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

PACKAGING = ("readme", "preinstalled", "byoc")
"""``readme``: ``app/custom`` holds only a README, so NVFlare counts the job as bring-your-own-code and a
simulator or a site without ``cxrfl.`` in its ``class_allow_list`` runs it; the code is the installed
package (the committed jobs). ``preinstalled``: no ``app/custom``, for sites that pre-install cxrfl and
allow ``cxrfl.``. ``byoc``: the package itself copied into ``app/custom`` (:func:`cxrfl.jobs.write_job`;
a recipe alone writes the first two)."""

LEGACY_PACKAGING = {"none": "preinstalled", "package": "byoc"}
"""Old names of :data:`PACKAGING` values, taken for one more release with a warning."""


def packaging(value: str, setting: str) -> str:
    """``value`` in :data:`PACKAGING` terms: an old name mapped (one warning line naming ``setting``).

    Args:
        value: the given value.
        setting: where it was given, for the warning (``job.custom``, ``write_job(custom=...)``).
    """
    if value in LEGACY_PACKAGING:
        log.warning(f"{setting}={value!r} is deprecated and goes in the next release: use {LEGACY_PACKAGING[value]!r}")
        return LEGACY_PACKAGING[value]
    return value
