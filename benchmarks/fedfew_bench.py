"""FedFew on the synthetic ``fedfew`` profile against the paper's baselines (results: BENCHMARKS.md, FedFew).

    python benchmarks/fedfew_bench.py --seeds 3 --out benchmarks/results

is ``cxrfl bench-fedfew`` (what ``cxrfl bench compare --method fedfew --profile fedfew`` runs);
every option is ``cxrfl bench-fedfew --help``. Writes ``fedfew.json`` to ``--out``; then
``python benchmarks/compare_md.py`` puts its table into BENCHMARKS.md.
"""

from __future__ import annotations

import sys

from cxrfl.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench-fedfew", *sys.argv[1:]]))
