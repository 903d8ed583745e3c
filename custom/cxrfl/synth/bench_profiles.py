"""Synthetic profiles the comparison benchmark needs beyond the demo profiles (registered into
:data:`cxrfl.synth.profiles.PROFILES` on import).

* ``nih-pool``: one NIH-format site (14 findings, NIH-like case mix and style) that
  :mod:`cxrfl.bench.profiles` splits IID into K sites with pruned label sets: the synthetic
  stand-in for the papers' ablations on NIH subsets (number of sites, number of shared classes).
* ``pretrain-pool``: a fully annotated cohort (all 20 findings) in the ``community`` style, which
  no benchmark site uses, with its own patients: :mod:`cxrfl.bench.pretrain` trains a feature
  extractor on it as a stand-in for the ImageNet weights the papers start from (they cannot be
  downloaded here).
"""

from __future__ import annotations

from cxrfl.data.labels import KNOWN_CLASSES
from cxrfl.synth.profiles import EXTERNAL_MIX, PROFILES, Profile, csv_site, nih_site

NIH_POOL = Profile(
    "nih-pool",
    "one NIH-like site (14 findings) to be split IID into K sites with pruned label sets (ablations)",
    (nih_site("nih-pool", 1500),),
)

PRETRAIN_POOL = Profile(
    "pretrain-pool",
    "a fully annotated cohort in a style no benchmark site uses, to pretrain a feature extractor",
    (csv_site("pretrain-pool", KNOWN_CLASSES, 2000, "community", EXTERNAL_MIX),),
)

for _profile in (NIH_POOL, PRETRAIN_POOL):
    PROFILES.setdefault(_profile.name, _profile)
