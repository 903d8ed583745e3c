"""Write benchmarks/COMPARE.md from the comparison and speed results.

    python benchmarks/compare_md.py [--results benchmarks/results] [--out benchmarks/COMPARE.md] [--commit COMMIT]

Reads ``RESULTS/compare/<profile>/results.json`` (``cxrfl bench compare``) and
``RESULTS/speed/speed.json`` (``cxrfl bench speed``); ``--intro FILE`` puts a hand-written
preamble (settings, caveats) first.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cxrfl.bench.report import format_report
from cxrfl.bench.speed import format_speed

ORDER = ("two-hospitals", "two-hospitals-shared", "nih1000", "two-hospitals-pretrained")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default="benchmarks/results")
    p.add_argument("--out", default="benchmarks/COMPARE.md")
    p.add_argument("--commit", default="COMMIT")
    p.add_argument("--intro", default=None, help="Markdown file to put first")
    args = p.parse_args()
    root = Path(args.results)
    parts = ["# Method comparison and framework overhead", "", f"Commit: `{args.commit}`.", ""]
    if args.intro:
        parts += [Path(args.intro).read_text().rstrip(), ""]
    found = {d.name: d / "results.json" for d in sorted((root / "compare").glob("*")) if (d / "results.json").is_file()}
    for name in [*ORDER, *sorted(set(found) - set(ORDER))]:
        if name in found:
            res = json.loads(found[name].read_text())
            text = format_report(res, summary=True, heading="##")
            if name != res["profile"]:  # e.g. the same profile from a pretrained feature extractor
                text = text.replace(f"`{res['profile']}`", f"`{res['profile']}` ({name})", 1)
            parts += [text, "",
                      f"Full report with per-class AUROCs, intervals and plots: `{found[name].parent / 'report.md'}`.", ""]
    speed = root / "speed" / "speed.json"
    if speed.is_file():
        parts += [format_speed(json.loads(speed.read_text())), ""]
    Path(args.out).write_text("\n".join(parts))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
