"""Cyclical weight transfer on the real NIH images: the paper's splits 1-10 (see benchmarks/CWT.md).

    python benchmarks/cwt_splits.py --seeds 3 --out benchmarks/results

is ``cxrfl bench-cwt`` (= ``cxrfl bench compare --method cwt --profile cwt-splits``); every
option is ``cxrfl bench-cwt --help``. Writes ``cwt.json`` and ``cwt.png`` to ``--out``.
"""

from __future__ import annotations

import sys

from cxrfl.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench-cwt", *sys.argv[1:]]))
