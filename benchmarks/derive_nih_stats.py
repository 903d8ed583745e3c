"""Derive the compact NIH ChestX-ray14 statistics embedded in ``cxrfl/synth/_nih_stats.py``.

Run once where the real label file is available (the package never reads it at run time)::

    python benchmarks/derive_nih_stats.py ../shared/data/nih/Data_Entry_2017_v2020.csv.gz

It prints the module to stdout: every 14-finding label vector seen at least three times with
its PA and AP image counts (99.6% of the 112,120 images), the images-per-patient histogram and
the age histogram.
"""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pandas as pd
from cxrfl.data.labels import NIH_CLASSES, NIH_COLUMN_NAMES

MIN_COUNT = 3


def main(path: str) -> None:
    """Print the statistics module for the NIH label file at ``path``."""
    df = pd.read_csv(path)
    canon_to_nih = {v: k for k, v in NIH_COLUMN_NAMES.items()}
    tokens = df["Finding Labels"].str.split("|")
    y = np.stack([tokens.apply(lambda t, c=canon_to_nih[c]: c in t).to_numpy() for c in NIH_CLASSES], 1)
    codes = (y.astype(np.int64) << np.arange(len(NIH_CLASSES))).sum(1)
    ap = df["View Position"].eq("AP").to_numpy()
    table = pd.DataFrame({"code": codes, "pa": ~ap, "ap": ap}).groupby("code")[["pa", "ap"]].sum()
    table = table[(table.pa + table.ap) >= MIN_COUNT].sort_index()
    combos = " ".join(f"{c:x}:{int(r.pa)}:{int(r.ap)}" for c, r in table.iterrows())
    per_patient = df.groupby("Patient ID").size().clip(upper=10).value_counts().sort_index()
    ages = np.histogram(df["Patient Age"].clip(0, 95), bins=np.arange(0, 101, 10))[0]
    male = float(df["Patient Gender"].eq("M").mean())
    print('"""NIH ChestX-ray14 label statistics (derived by benchmarks/derive_nih_stats.py; do not edit)."""')
    print()
    print("COMBOS = (")
    for line in textwrap.wrap(combos, 92):
        print(f'    "{line} "')
    print(")")
    print('"""Label vectors seen >= 3 times: ``hex code:PA count:AP count``; bit i = ``NIH_CLASSES[i]``."""')
    print()
    print(f"IMAGES_PER_PATIENT = {tuple(int(v) for v in per_patient.to_numpy())}")
    print('"""Patients with 1, 2, ..., 9, >=10 images."""')
    print(f"AGE_DECADES = {tuple(int(v) for v in ages)}")
    print('"""Images with patient age 0-9, 10-19, ..., 90-99."""')
    print(f"MALE_FRACTION = {male:.4f}")


if __name__ == "__main__":
    main(sys.argv[1])
