"""Regenerate the generated blocks of BENCHMARKS.md from the benchmark results.

    python benchmarks/compare_md.py [--results benchmarks/results] [--out BENCHMARKS.md]
                                    [--intro benchmarks/compare_intro.md]
                                    [--fedfew-notes benchmarks/fedfew_notes.md]

Rewrites two blocks of ``--out``, each between its ``<!-- BEGIN name ... -->`` and
``<!-- END name -->`` lines; everything outside them is hand-written and left alone:

* ``compare`` (issues 4 and 14): ``--intro`` (protocol, caveats, one verdict row per binding target
  of every converged comparison at ``<!-- comparison verdict rows -->``, the framework-overhead
  verdict rows from ``speed.json`` at ``<!-- speed verdict rows -->``), the summary of every
  ``RESULTS/compare/<profile>/results.json`` (``cxrfl bench compare``: settings, machine, commit,
  time, convergence, the papers' Tables 1-4, effect sizes and tests, targets, the learning-curve
  plot), every ablation ``RESULTS/compare/<name>/ablation.json`` (``--ablation``), then the
  framework overhead from ``RESULTS/speed/speed.json`` (``cxrfl bench speed``);
* ``fedfew`` (issue 42): ``--fedfew-notes``, then the report of ``RESULTS/fedfew42/results.json`` (``cxrfl bench
  fedfew``: per-UC detection metrics, diagnostics, convergence, the targets and post-hoc designs with paired
  statistics, every method and seed, the plots);
* ``cwt`` (issue 15): ``RESULTS/cwt/results.json`` (``cxrfl bench cwt``): command, code, machine and time of the
  runs, per dataset the tables, the targets with paired statistics and the plots.

A comparison's targets are evaluated again with the current rules (Holm-adjusted p-values,
detectable differences: :mod:`cxrfl.bench.targets`) and written back into its ``results.json`` and
``report.md``, so the stored runs, the report and this document agree. A comparison's
``results.json`` records the commit and machine of every run, and its section says so; for the
other results files the commit named comes from git: the commit that added the
file (the run used that commit's working tree) and, when the file changed later, the last commit
that changed it; a file with uncommitted changes is credited to the commit that adds them.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path
from typing import Any

from cxrfl.bench.ablation_report import format_ablation
from cxrfl.bench.cwt_report import report_markdown as cwt_markdown
from cxrfl.bench.fedfew import code_text, format_markdown
from cxrfl.bench.report import format_report
from cxrfl.bench.report_text import markdown_table
from cxrfl.bench.speed import format_speed
from cxrfl.bench.targets import TARGET_PROFILES, evaluate_targets
from cxrfl.common.io import write_json

ORDER = ("two-hospitals", "two-hospitals-shared", "nih1000", "real", "ablation-sites", "two-hospitals-gpu")
SPEED_ROWS = "<!-- speed verdict rows -->"
TARGET_ROWS = "<!-- comparison verdict rows -->"


def _git(*args: str) -> str:
    proc = subprocess.run(["git", *args], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else ""


def commits(path: Path) -> dict[str, str]:
    """``added``: the commit that added ``path``; ``current``: the one that holds its present content."""
    log = _git("log", "--format=%h", "--", str(path)).split()
    pending = f"the commit that adds them (on top of `{_git('rev-parse', '--short', 'HEAD')}`)"
    dirty = bool(_git("status", "--porcelain", "--", str(path)))
    added = f"`{log[-1]}`" if log else pending
    return {"added": added, "current": pending if dirty or not log else f"`{log[0]}`"}


def provenance(path: Path) -> str:
    """One sentence: which commit's working tree produced the results in ``path``."""
    c = commits(path)
    text = f"Commit: {c['added']} (the run used the working tree committed there)"
    if c["current"] != c["added"]:
        text += f"; `{path.name}` last changed in {c['current']}"
    return text + "."


def demote(markdown: str, levels: int = 1) -> str:
    """Every heading one level deeper (code blocks left alone)."""
    out, fenced = [], False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        out.append("#" * levels + line if not fenced and re.match(r"#+ ", line) else line)
    return "\n".join(out)


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def speed_verdict_rows(res: dict[str, Any]) -> list[str]:
    """The framework-overhead rows of the verdicts table."""
    rows = []
    sim = res.get("simulator")
    if sim:
        rows.append(
            f"| simulator >= 0.9x plain loop | {_met(sim['ratio'] >= 0.9)}: {sim['ratio']:.2f}x "
            f"({sim['simulator_mean']:.1f} vs {sim['plain_mean']:.1f} images/s) | |"
        )
    row = (res.get("aggregation") or {}).get("sites", {}).get("10")
    if row:
        core, comp, nv = row["surgical"], row["surgical_nvflare"], row["nvflare_fedavg"]
        r, rn = core["ratio_to_nvflare_fedavg"], comp["ratio_to_nvflare_fedavg"]
        rows.append(
            f"| surgical aggregation of 10 updates <= 1.5x NVFlare FedAvg | `surgical_aggregate` {_met(r <= 1.5)}: "
            f"{r:.2f}x ({core['median_seconds']:.3f} s vs {nv['median_seconds']:.3f} s); the job's NVFlare component "
            f"`SurgicalAggregator`, which also validates every update, {_met(rn <= 1.5)}: {rn:.2f}x "
            f"({comp['median_seconds']:.3f} s) | |"
        )
        if core["extra_model_sizes"] is not None:
            rows.append(
                f"| peak extra memory < 3 model sizes | {_met(core['extra_model_sizes'] < 3)}: "
                f"{core['extra_model_sizes']:.2f} (`surgical_aggregate`), {comp['extra_model_sizes']:.2f} "
                f"(`SurgicalAggregator`); NVFlare's FedAvg {nv['extra_model_sizes']:.2f} | |"
            )
    pay = res.get("payload")
    if pay:
        ok = all(r["surgical"]["equals_feature_extractor_plus_own_rows"] for r in pay["sites"].values())
        sizes = ", ".join(
            f"{r['surgical']['raw_bytes'] / 1e6:.3f} MB for {r['surgical']['head_rows']} rows"
            for r in pay["sites"].values()
        )
        share = 100 * pay["feature_extractor_bytes"] / pay["full_model_bytes"]
        rows.append(
            f"| payload = feature extractor + own head rows | {'met exactly' if ok else '**not met**'} ({sizes}, full "
            f"model {pay['full_model_bytes'] / 1e6:.3f} MB): the DenseNet feature extractor is {share:.1f} % of the "
            "model, so surgical aggregation saves almost no traffic; its point is privacy, not bandwidth | |"
        )
    return rows


def _p_text(stats: dict[str, Any] | None, over: str) -> str:
    if not stats or (stats.get("n") or 0) < 2 or stats.get("p") is None:
        return ""
    holm = f" (Holm {stats['p_holm']:.2g})" if stats.get("p_holm") is not None else ""
    return f"p {stats['p']:.2g}{holm} over {stats['n']} {over}"


def _cost_text(t: dict[str, Any], methods: dict[str, Any]) -> str:
    """Whose selection gave up too much validation AUROC for the comparison to be a result (empty: none)."""
    costs = t.get("selection_cost") or {}
    given = ", ".join(f"{methods[e]['label']} {c:.3f}" for e, c in costs.items())
    return f"; selection gave up validation AUROC: {given}" if costs else ""


def _old_rule_text(old: dict[str, Any] | None) -> str:
    """How far the difference moved from the old selection rule (empty: not run under it)."""
    if not old:
        return ""
    return f"; from the old {old['rule']!r} rule: {old['difference_change']:+.3f}"


def retarget(path: Path) -> dict[str, Any]:
    """A comparison's ``results.json`` with its targets evaluated by the current rules, written back with its
    ``report.md`` (results of the earlier short-budget protocol are returned as they are)."""
    res = json.loads(path.read_text())
    if "machines" in res and "methods" in res:
        res["targets"] = evaluate_targets(res)
        write_json(path, res)
        (path.parent / "report.md").write_text(format_report(res))
    return res


def target_verdict_rows(name: str, res: dict[str, Any]) -> list[str]:
    """One verdicts-table row per binding target of a converged comparison's ``results.json``."""
    rows = []
    for t in res.get("targets") or []:
        if not t.get("binding"):
            continue
        methods = res["methods"]
        where = f"`{t['view']}`" + (f", {t['part']} classes" if t.get("part") else "")
        unresolved = "**not a result**" if t.get("selection_cost") else "not measurable"
        verdict = unresolved if t["met"] is None else _met(t["met"])
        a = methods[t["method"]]["label"]
        if "statement" in t:
            measured = t["statement"]
        elif t["met"] is None and not t.get("selection_cost"):
            measured = ""
        elif t["against"] is None:
            lo, hi = t.get("value_ci") or (None, None)
            measured = f"{a} {t['value']:.3f}" + (f" (95% CI {lo:.3f}-{hi:.3f})" if lo is not None else "")
        else:
            tests = "; ".join(x for x in (_p_text(t.get("classes"), "classes"), _p_text(t.get("seeds"), "seeds")) if x)
            measured = (
                f"{a} {t['value']:.3f} vs {methods[t['against']]['label']} {t['other']:.3f}: "
                f"{t['difference']:+.3f}" + (f" ({tests})" if tests else "") + _old_rule_text(t.get("old_rule"))
            ) + _cost_text(t, methods)
        rows.append(f"| `{name}` | {t['target']} | {where} | {verdict} | {measured} |")
    return rows


def verdict_rows(root: Path) -> list[str]:
    """The comparison rows of the verdicts table: every binding target, or why a profile has none yet."""
    rows = []
    for name in ORDER:
        path = root / "compare" / name / "results.json"
        res = retarget(path) if path.is_file() else {}
        if "machines" in res:
            rows += target_verdict_rows(name, res)
        elif name in TARGET_PROFILES:
            rows.append(f"| `{name}` | every target | | pending | not yet run to the end with the converged protocol |")
    return rows


def ablation_settings(res: dict[str, Any], folder: Path) -> list[str]:
    """Per setting of an ablation: the selected round of every run, training time, commits and
    machine (from each setting's ``results.json``), with a link to its learning curves.

    Args:
        res: the ablation's ``ablation.json``.
        folder: the folder holding it and the settings' folders.
    """
    rows = []
    for value in res["values"]:
        setting = folder / f"{res['ablation']}-{value}"
        r = json.loads((setting / "results.json").read_text())
        runs = [run for d in r["methods"].values() for run in d["runs"]]
        rounds = "; ".join(
            f"{d['label']} {', '.join(str(run['best_round']) for run in d['runs'])}" for d in r["methods"].values()
        )
        early = sum(bool(run["stopped_early"]) for run in runs)
        commits_ = ", ".join(f"`{c['commit'][:7]}`" + (" (dirty)" if c["dirty"] else "") for c in r["commits"])
        machines = "; ".join(
            f"{m['cpu']}, {m['cores']} cores, {m['torch_threads']} thread(s), {m['device']}" for m in r["machines"]
        )
        rows.append(
            [
                str(value),
                str(len(runs)),
                rounds,
                f"{early} of {len(runs)}",
                f"{r['run_seconds'] / 3600:.2f}",
                commits_,
                machines,
                f"[curves]({setting / 'learning_curves.png'})",
            ]
        )
    header = [
        res["ablation"],
        "runs",
        "selected round per seed",
        "stopped early",
        "training (h)",
        "commits",
        "machine",
        "learning curves",
    ]
    return [
        "Convergence and provenance per setting (each run trains until the mean validation loss has not "
        "improved for the protocol's patience; a run that reached the max-rounds guard did not stop early):",
        "",
        markdown_table(header, rows),
        "",
    ]


def comparison_section(name: str, path: Path) -> list[str]:
    """One comparison's summary (``results.json``) or ablation (``ablation.json``), with its provenance."""
    res = json.loads(path.read_text()) if path.name == "ablation.json" else retarget(path)
    if path.name == "ablation.json":
        title, _, rest = demote(format_ablation(res), 2).partition("\n")
        plot = path.parent / f"ablation_{res['ablation']}.png"
        return [
            title,
            "",
            provenance(path),
            rest,
            "",
            *ablation_settings(res, path.parent),
            *([f"![mean AUROC per setting, {name}]({plot})", ""] if plot.is_file() else []),
            f"Each setting's full report (per-class AUROCs, intervals, plots): "
            f"`{path.parent}/{res['ablation']}-<value>/report.md`.",
            "",
        ]
    if "machines" not in res:  # written by the short-budget protocol this one replaced
        return [
            f"### `{name}`",
            "",
            f"`{path}` holds results of the earlier short-budget protocol (issue 4); rerun "
            "`cxrfl bench compare` with the converged protocol (issue 14) to report it here.",
            "",
        ]
    c = commits(path)
    origin = (
        f"Every run's commit and machine are recorded with it (Code and Machine below); this summary is of "
        f"`{path.name}` as committed in {c['current']}."
    )
    text = format_report(res, summary=True, heading="###")
    if name != res["profile"]:  # e.g. the same profile from a pretrained feature extractor, or on a GPU
        text = text.replace(f"`{res['profile']}`", f"`{res['profile']}` ({name})", 1)
    title, _, rest = text.partition("\n")
    curves = path.parent / "learning_curves.png"
    return [
        title,
        "",
        origin,
        rest,
        "",
        *([f"![learning curves of every run, {name}]({curves})", ""] if curves.is_file() else []),
        f"Full report with per-class AUROCs, intervals and plots: `{path.parent / 'report.md'}`.",
        "",
    ]


def compare_block(root: Path, intro: Path | None) -> str:
    """The ``compare`` block: intro, one summary per comparison and ablation, the framework overhead."""
    speed_path = root / "speed" / "speed.json"
    speed = json.loads(speed_path.read_text()) if speed_path.is_file() else None
    parts = ["## Method comparison (issues 4 and 14)", ""]
    if intro:
        text = demote(intro.read_text().rstrip())
        text = text.replace(TARGET_ROWS, "\n".join(verdict_rows(root)))
        parts += [text.replace(SPEED_ROWS, "\n".join(speed_verdict_rows(speed) if speed else [])), ""]
    found = {}
    for d in sorted((root / "compare").glob("*")):
        for file in ("results.json", "ablation.json"):
            if (d / file).is_file():
                found[d.name] = d / file
    for name in [*ORDER, *sorted(set(found) - set(ORDER))]:
        if name in found:
            parts += comparison_section(name, found[name])
    if speed:
        c = commits(speed_path)
        ran = [
            p for p in ("simulator", "aggregation", "payload") if p in speed and p not in speed.get("carried_over", {})
        ]
        kept = list(speed.get("carried_over", {}))

        def names(parts: list[str]) -> str:
            return " and ".join(parts) + (" parts were" if len(parts) > 1 else " part was")

        done = [f"the {names(ran)} measured with the working tree of {c['current']}"] if ran else []
        done += [f"the {names(kept)} measured with the working tree of {c['added']}"] if kept else []
        note = "Commits: " + "; ".join(done) + "."
        title, _, rest = format_speed(speed).partition("\n")
        parts += [title, "", note, rest, ""]
    return "\n".join(parts).rstrip() + "\n"


def fedfew_block(root: Path, notes: Path | None) -> str:
    """The ``fedfew`` block: the hand-written ``notes``, then the report of issue 42's benchmark
    (``RESULTS/fedfew42/results.json``; its plots linked from the repository root)."""
    path = root / "fedfew42" / "results.json"
    intro = notes.read_text().rstrip() + "\n\n" if notes and notes.is_file() else ""
    if not path.is_file():
        return intro + "(no `fedfew42/results.json` yet: run `cxrfl bench fedfew --seeds 8 --out OUT`)\n"
    res = json.loads(path.read_text())
    commit = code_text(res) or commits(path)["added"]
    return intro + demote(relink(format_markdown(res, commit=commit), path.parent)).rstrip() + "\n"


def relink(markdown: str, folder: Path) -> str:
    """Relative image links of a report written in ``folder`` made relative to the repository root."""
    return re.sub(r"(!\[[^\]]*\]\()(?![a-z]+:|/)([^)]+\))", lambda m: f"{m.group(1)}{folder}/{m.group(2)}", markdown)


def cwt_block(root: Path) -> str:
    """The ``cwt`` block: the CWT benchmark's report, its headings under the hand-written section."""
    path = root / "cwt" / "results.json"
    if not path.is_file():
        return "(no `cwt/results.json` yet: run `cxrfl bench cwt --seeds 5 --out benchmarks/results/cwt`)\n"
    res = json.loads(path.read_text())
    title, _, rest = demote(relink(cwt_markdown(res), path.parent), 2).partition("\n")
    origin = (
        f"The runs went on across sessions; each names the commit it was trained with (Code below). This summary "
        f"is of `{path}` as committed in {commits(path)['current']}."
    )
    return "\n".join([title, "", origin, rest.rstrip(), ""])


def fill(document: str, blocks: dict[str, str | None]) -> str:
    """``document`` with the text between each block's BEGIN and END markers replaced (a None block is kept)."""
    for name, body in blocks.items():
        if body is None:
            continue
        pattern = re.compile(rf"(<!-- BEGIN {name}\b[^\n]*-->\n)(.*?)(<!-- END {name} -->)", re.S)
        if not pattern.search(document):
            raise SystemExit(f"no '<!-- BEGIN {name} ... -->' ... '<!-- END {name} -->' markers in the document")
        document = pattern.sub(lambda m, body=body: m.group(1) + body + m.group(3), document, count=1)
    return document


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default="benchmarks/results")
    p.add_argument("--out", default="BENCHMARKS.md")
    p.add_argument("--intro", default="benchmarks/compare_intro.md", help="hand-written start of the comparison block")
    p.add_argument(
        "--fedfew-notes", default="benchmarks/fedfew_notes.md", help="hand-written start of the FedFew block"
    )
    args = p.parse_args()
    root = Path(args.results)
    out = Path(args.out)
    blocks = {
        "compare": compare_block(root, Path(args.intro) if args.intro else None),
        "fedfew": fedfew_block(root, Path(args.fedfew_notes) if args.fedfew_notes else None),
        "cwt": cwt_block(root),
    }
    out.write_text(fill(out.read_text(), blocks))
    print(f"wrote the generated blocks of {out}")


if __name__ == "__main__":
    main()
