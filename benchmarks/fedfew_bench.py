"""FedFew on the synthetic ``fedfew`` profile against the paper's baselines: ``cxrfl bench fedfew``
(every option: ``cxrfl bench fedfew --help``; results: BENCHMARKS.md, FedFew).

    python benchmarks/fedfew_bench.py --seeds 4 --out benchmarks/results/fedfew
"""

from __future__ import annotations

import sys

from cxrfl.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "fedfew", *sys.argv[1:]]))
