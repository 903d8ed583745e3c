"""Load benchmark (issue 8): ``cxrfl bench load`` (every option: ``cxrfl bench load --help``).

python benchmarks/load_sites.py --sites 10 --rounds 3 --out benchmarks/results/load
"""

from __future__ import annotations

import sys

from cxrfl.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "load", *sys.argv[1:]]))
