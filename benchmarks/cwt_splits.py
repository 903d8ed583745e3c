"""Cyclical weight transfer, the paper's splits 1-10, on the real NIH images and a synthetic cohort (docs/cwt.md).

    python benchmarks/cwt_splits.py --seeds 5 --out benchmarks/results/cwt

is ``cxrfl bench cwt`` (:func:`cxrfl.bench.cwt.run_cwt_benchmark`); every option is
``cxrfl bench cwt --help``. Writes ``results.json``, ``report.md``, ``cwt_<dataset>.png``,
``cwt_curves_<dataset>.png`` and one file per finished run (``runs/<dataset>/``) to ``--out``;
run it again to go on from the runs already there.
"""

from __future__ import annotations

import sys

from cxrfl.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "cwt", *sys.argv[1:]]))
