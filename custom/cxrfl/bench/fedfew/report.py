"""The FedFew benchmark's summary (mean and SD over seeds), targets with paired statistics, and ``report.md``.

Beside each method's F1 and CC AUROC, the summary keeps what tells which FedFew stage limits the
result: stage 1's linear-probe AUROC per round budget, stage 2's rounds and best round, and per
UC the AUROC of the energy alone (can stage 2's energy tell UC-positive images from negatives?),
of the prototype margin alone (can the features?), and the share of positives and negatives the
threshold flags (does the rule use what the energy knows?).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cxrfl.bench.arch import arch_label
from cxrfl.bench.fedfew.settings import BASELINES, ENERGY_VARIANTS, LABELS, METHODS
from cxrfl.bench.fedfew.target_report import target_lines
from cxrfl.bench.fedfew.targets import POST_HOC, targets, uc_values
from cxrfl.bench.protocol import code_label, load_text
from cxrfl.bench.selection_cost import COST_LIMIT, over_limit, run_cost
from cxrfl.synth.fedfew_profile import FEDFEW_UCS

UC_METRICS = ("auroc", "balanced_accuracy", "mcc", "f1", "f1_flag_all", "f1@prevalence", "precision", "recall")
"""Per-UC metrics summarised over seeds (:func:`cxrfl.nn.detection.detection_metrics`; ``f1@prevalence``:
F1 at the reported prevalence)."""
DIAGNOSTICS = ("energy_auroc", "prototype_margin_auroc")
FLAGGED = ("flagged_positives", "flagged_negatives")


def _ms(values: list[float | None]) -> dict[str, float | None]:
    kept = [v for v in values if v is not None and np.isfinite(v)]
    if not kept:
        return {"mean": None, "sd": None, "n": 0}
    return {"mean": float(np.mean(kept)), "sd": float(np.std(kept, ddof=1)) if len(kept) > 1 else None, "n": len(kept)}


def _fedfew_extras(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """Stage diagnostics of a FedFew method over seeds."""
    diag = {
        uc: {k: _ms([r["test_energy"][uc].get(k) for r in rs if uc in r.get("test_energy", {})]) for k in DIAGNOSTICS}
        for uc in FEDFEW_UCS
    }
    flagged = {uc: {k: _ms([r["uc"][uc].get(k) for r in rs if uc in r["uc"]]) for k in FLAGGED} for uc in FEDFEW_UCS}
    seen = {p for r in rs for p in r.get("stage2", {})}
    phases = [p for p in ("warm-up", "energy", "bce") if p in seen] + sorted(seen - {"warm-up", "energy", "bce"})
    stage2 = {
        p: {
            k: _ms([r["stage2"][p].get(k) for r in rs if p in r.get("stage2", {})])
            for k in ("rounds", "best_round", "best_val_loss", "uc_energy_gap")
        }
        for p in phases
    }
    out: dict[str, Any] = {"diagnostics": diag, "flagged": flagged, "stage2": stage2}
    rounds = sorted({p["round"] for r in rs for p in r.get("ssl_probe", [])})
    if rounds:
        out["ssl_probe"] = {
            str(k): _ms([p["mean_auroc"] for r in rs for p in r.get("ssl_probe", []) if p["round"] == k])
            for k in rounds
        }
    return out


def selection_curve(run: dict[str, Any]) -> dict[str, Any] | None:
    """A run's validation curve (``curve_rounds``, ``val_auroc``, ``val_loss``, ``best_round``) as
    :func:`cxrfl.bench.selection_cost.run_cost` reads it (None: not recorded).

    An MLC baseline: its rounds' CC validation AUROC and its best round. FedFew: stage 2's rounds over its
    phases, and the kept round of the last phase (the model stage 3 and the tests use).

    Args:
        run: one (method, seed) result (``training`` or ``stage2``).
    """
    training = run.get("training") or {}
    if training.get("val_cc_auroc"):
        aurocs = training["val_cc_auroc"]
        return {
            "curve_rounds": list(range(1, len(aurocs) + 1)),
            "val_auroc": aurocs,
            "val_loss": training["val_loss"],
            "best_round": training["best_round"],
        }
    phases = [p for p in (run.get("stage2") or {}).values() if p.get("curve")]
    if not phases:
        return None
    points = [c for p in phases for c in p["curve"]]
    return {
        "curve_rounds": [c["round"] for c in points],
        "val_auroc": [c["val_cc_auroc"] for c in points],
        "val_loss": [c["val_loss"] for c in points],
        "best_round": phases[-1]["best_round"],
    }


def _selection_cost(rs: list[dict[str, Any]]) -> dict[str, float | None]:
    """Per method over seeds: the CC validation AUROC its selection gave up (best round minus kept round)."""
    curves = [c for c in (selection_curve(r) for r in rs) if c is not None]
    return _ms([run_cost(c) for c in curves])


def _summarise_method(method: str, rs: list[dict[str, Any]]) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "label": LABELS[method],
        "seeds": len(rs),
        "mean_uc_f1": _ms([r["mean_uc_f1"] for r in rs]),
        "mean_cc_auroc": _ms([r.get("mean_cc_auroc") for r in rs]),
        "uc": {},
    }
    by_seed = {method: {str(k): r for k, r in enumerate(rs)}}
    for uc in FEDFEW_UCS:
        entry["uc"][uc] = {k: _ms(list(uc_values(by_seed, method, uc, k).values())) for k in UC_METRICS}
    if method.startswith("fedfew"):
        entry.update(_fedfew_extras(rs))
    if any("training" in r for r in rs):
        entry["training"] = {
            k: _ms([r["training"].get(k) for r in rs if "training" in r]) for k in ("rounds", "best_round")
        }
    entry["selection_cost"] = _selection_cost(rs)
    return entry


def summarise(runs: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Mean and SD over seeds of every metric of every method, and the target verdicts.

    Args:
        runs: method -> seed (as text) -> that run's results.
    """
    table = {m: _summarise_method(m, list(runs[m].values())) for m in METHODS if runs.get(m)}
    post_hoc = {m: targets(runs, m) for m in POST_HOC if runs.get(m)}
    return {"methods": table, "targets": targets(runs), **({"post_hoc": post_hoc} if post_hoc else {})}


# ------------------------------------------------------------------------------------- markdown
def _fmt(x: dict[str, Any] | None, digits: int = 2) -> str:
    if not x or x.get("mean") is None:
        return "-"
    sd = x.get("sd")
    return f"{x['mean']:.{digits}f}" + (f" ± {sd:.{digits}f}" if sd is not None else "")


def code_text(result: dict[str, Any]) -> str | None:
    """The code that ran, as the report names it (None: not recorded).

    Args:
        result: the content of ``results.json``: ``code`` (:func:`~cxrfl.bench.protocol.code_version`), or
            ``commit`` in results written before 2026-11-25.
    """
    code = result.get("code") or {}
    if not code.get("commit"):
        return result.get("commit")
    return code_label(code)


def _gpu_text(gpu: Any) -> str:
    """The GPU of a run: its name, or whether there was one (older results record only that)."""
    return f"GPU {gpu}" if isinstance(gpu, str) else ("a GPU" if gpu else "no GPU")


def run_code_text(runs: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The code of each run, as "Runs by code: `abc1234`: fedfew (4, 5); ..." ("" when no run records one).

    Args:
        runs: method -> seed -> result (``code``: :func:`~cxrfl.bench.protocol.code_version`, missing in
            runs written before 2026-12-08).
    """
    by_code: dict[str, dict[str, list[str]]] = {}
    unrecorded = 0
    for method in [m for m in METHODS if m in runs]:
        for seed, run in sorted(runs[method].items(), key=lambda kv: int(kv[0])):
            if run.get("code"):
                by_code.setdefault(code_label(run["code"]), {}).setdefault(method, []).append(seed)
            else:
                unrecorded += 1
    if not by_code:
        return ""
    parts = [
        f"{label}: " + ", ".join(f"{m} ({', '.join(seeds)})" for m, seeds in methods.items())
        for label, methods in by_code.items()
    ]
    rest = f"; {unrecorded} earlier run(s) record none" if unrecorded else ""
    return "Runs by code: " + "; ".join(parts) + rest + "."


def missing_text(result: dict[str, Any]) -> str:
    """ "" for a complete benchmark, else a line naming it interim and each method's missing seeds (of the methods
    that have run for some seed).

    Args:
        result: the content of ``results.json`` (``complete``, ``seeds``, ``runs``).
    """
    if result.get("complete", True):
        return ""
    runs, seeds = result.get("runs") or {}, result.get("seeds") or []
    missing = {m: [s for s in seeds if str(s) not in runs[m]] for m in METHODS if m in runs}
    parts = [f"{m} ({', '.join(map(str, ss))})" for m, ss in missing.items() if ss]
    return "**Interim**: the benchmark goes on, so no verdict below is final. Missing runs: " + (
        "; ".join(parts) + "." if parts else "none of the methods that ran (others not run yet)."
    )


def _header(result: dict[str, Any], commit: str) -> list[str]:
    s, ff, machine = result["settings"], result["settings"]["fedfew"], result["machine"]
    seeds = result["seeds_done"]
    seed_minutes = sum(r.get("seconds", 0) for by_seed in result["runs"].values() for r in by_seed.values()) / 60
    # results written before 2026-11-25 name the machine "cpus", "cuda"
    cores, gpu = machine.get("cores", machine.get("cpus")), machine.get("gpu") or machine.get("cuda")
    return [
        f"Command: `{result['command']}`. Commit: {commit}. "
        f"Machine: {cores} CPU cores, {s['threads']} torch thread(s) per seed, "
        f"{_gpu_text(gpu)}, CPU capability {machine.get('cpu_capability', 'not recorded')}; "
        f"{len(seeds)} seed(s) ({', '.join(map(str, seeds))}), "
        f"{s.get('jobs', 1)} in parallel: {result.get('wall_seconds_total', 0) / 60:.0f} min wall "
        f"({seed_minutes:.0f} min of method time); load average {load_text(machine)} at the "
        "start." + (f" {result['note']}" if result.get("note") else ""),
        "",
        *([interim, ""] if (interim := missing_text(result)) else []),
        *([code, ""] if (code := run_code_text(result["runs"])) else []),
        f"Settings: {arch_label(s)} from scratch at {s['image_size']}x{s['image_size']} (images written at "
        f"{s['data_image_size']}); "
        f"3 CC sites of {s['n_cc']} images ({s['cc_label_fraction']:.0%} of training images labelled), 3 UC "
        "sites with ~20 "
        f"positives and ~200 negatives in their training split, {s['train_fraction']:.0%} train / rest "
        "validation by patient; "
        f"UC test sets balanced, "
        f"up to {s['test_per_class']} positives + as many negatives; CC AUROC on all "
        f"{3 * s.get('n_test', 200)} test images. "
        f"FedFew: {ff['ssl_rounds']} SimSiam round(s) (batch {ff['ssl_batch_size']}, projector {ff['ssl_proj_dim']}, "
        f"predictor {ff['ssl_pred_dim']}), linear probe of the encoder every {s.get('probe_every', '-')} "
        "round(s); stage 2 "
        f"at most {ff['warmup_rounds']} warm-up + {ff['rounds']} energy round(s), each phase stopped after "
        f"{ff.get('patience')} round(s) without a lower CC validation loss and its best round kept "
        f"({ff['local_epochs']} "
        f"local epoch(s), batch {ff['batch_size']}, Adam {ff['lr']}), T={ff['temperature']}, "
        f"lambda={ff['energy_weight']}, "
        f"margins from the warm-up (widen {ff['margin_widen']}), min {ff['min_prototype_images']} images per "
        "prototype, "
        f"threshold rule `{ff['threshold_weighting']}` (the paper's) on `{ff['threshold_examples']}` "
        "examples. MLC: at most "
        f"{s['mlc_rounds']} rounds x {s.get('mlc_local_epochs', 1)} local epoch(s), stopped after "
        f"{s.get('mlc_patience', '-')} "
        f"round(s) without a lower validation loss, the loss each trains on (CheXNet's weighted BCE; the "
        "surgical and pooled ones masked BCE), but not before round "
        f"{min(ff['warmup_rounds'], s['mlc_rounds'])} (FedFew's warm-up budget), batch {s['mlc_batch_size']}.",
    ]


def _table(table: dict[str, Any]) -> list[str]:
    lines = [
        "| Method | " + " | ".join(f"{uc} AUROC / BA / MCC" for uc in FEDFEW_UCS) + " | mean CC AUROC |",
        "| --- |" + " --- |" * (len(FEDFEW_UCS) + 1),
    ]
    for e in (table[m] for m in METHODS if m in table):
        cells = [" / ".join(_fmt(e["uc"][uc][k]) for k in ("auroc", "balanced_accuracy", "mcc")) for uc in FEDFEW_UCS]
        lines.append(f"| {e['label']} | {' | '.join(cells)} | {_fmt(e['mean_cc_auroc'], 3)} |")
    lines += [
        "",
        "| Method | " + " | ".join(f"{uc} F1 (flag all) / F1 at 9 %" for uc in FEDFEW_UCS) + " | mean UC F1 |",
        "| --- |" + " --- |" * (len(FEDFEW_UCS) + 1),
    ]
    for e in (table[m] for m in METHODS if m in table):
        cells = [
            f"{_fmt(e['uc'][uc]['f1'])} ({_fmt(e['uc'][uc]['f1_flag_all'])}) / {_fmt(e['uc'][uc]['f1@prevalence'])}"
            for uc in FEDFEW_UCS
        ]
        lines.append(f"| {e['label']} | {' | '.join(cells)} | {_fmt(e['mean_uc_f1'])} |")
    lines += [
        "",
        "Mean ± SD over seeds, each UC on its balanced test set. AUROC: of the method's detection score; BA, MCC: "
        "balanced accuracy and Matthews' correlation of its decisions (flagging everything: 0.5 and 0). F1 beside "
        "the F1 of flagging every image (0.667 on a balanced set), and at 9 % prevalence (the negatives re-weighted; "
        "flagging everything: 0.165). '-': not recorded (runs before issue 42 kept accuracy, precision, recall, F1).",
    ]
    if "fedfew-balanced" in table:
        lines.append(
            "\\* Not the paper's rule: the same stage-2 model, stage 3 re-run (through `resume_from`) with "
            "`threshold_weighting: balanced` instead of the most correctly classified training examples."
        )
    if "fedfew-scorer" in table:
        lines.append(
            "\\* FedFew, UC scorers: the same stage-2 model, stage 3 re-run with `detector: scorer` (each UC site's "
            "class-balanced logistic regression on its stage-2 features, threshold chosen out of fold; docs/fedfew.md)."
        )
    if "fedfew-prototype" in table:
        lines.append(
            "\\* FedFew, UC prototype scorers: the same, with `scorer_model: prototype` (the dual prototype's cosine "
            "margin, the paper's prototypes without the energy gate, its threshold chosen out of fold)."
        )
    if "fedfew-no-ebm-prototype" in table:
        lines.append(
            "\\* FedFew w/o EBM, UC prototype scorers: the prototype scorers on the stage-2 model trained without the "
            "energy term (lambda = 0, FedFew's schedule): what the energy training adds to that detector."
        )
    if any(m in table for m in ENERGY_VARIANTS):
        lines.append(
            "\\* "
            + "; ".join(LABELS[m].rstrip("*") for m in ENERGY_VARIANTS if m in table)
            + ": labelled variants of stage 2, not the paper's recipe (below: what they change)."
        )
    return lines


def _diagnostics(table: dict[str, Any]) -> list[str]:
    ff = table.get("fedfew")
    if not ff or not ff.get("diagnostics"):
        return []
    lines = [
        "",
        "Which stage limits FedFew w/ EBM (UC test sets, mean ± SD over seeds): the AUROC of the energy alone "
        "(stage 2: does the energy rank UC positives above negatives?), of the prototype margin alone (stage 2's "
        "features: are positives nearer their prototype?), and the share of positives and of negatives the "
        "threshold flags (stage 3's rule)"
        + (", also under the balanced rule*" if "fedfew-balanced" in table else "")
        + ".",
        "",
        "| UC | energy AUROC | prototype-margin AUROC | flagged positives | flagged negatives | "
        + ("flagged pos. / neg. (balanced*) | " if "fedfew-balanced" in table else "")
        + "F1 |",
        "| --- | --- | --- | --- | --- | " + ("--- | " if "fedfew-balanced" in table else "") + "--- |",
    ]
    for uc in FEDFEW_UCS:
        d, f = ff["diagnostics"][uc], ff["flagged"][uc]
        cells = [
            _fmt(d["energy_auroc"]),
            _fmt(d["prototype_margin_auroc"]),
            _fmt(f["flagged_positives"]),
            _fmt(f["flagged_negatives"]),
        ]
        if "fedfew-balanced" in table:
            fb = table["fedfew-balanced"]["flagged"][uc]
            cells.append(f"{_fmt(fb['flagged_positives'])} / {_fmt(fb['flagged_negatives'])}")
        lines.append(f"| {uc} | {' | '.join(cells)} | {_fmt(ff['uc'][uc]['f1'])} |")
    return lines


VARIANT_NOTES = {
    "fedfew-lambda1": "stages 2-3 re-run from the same stage-1 encoder with the hinge terms weighted by lambda = 1 "
    "instead of 0.1",
    "fedfew-neg-in": "stages 2-3 re-run from the same stage-1 encoder with the UC sites' negatives also pushed below "
    "`m_in` (`uc_negatives: in`; the paper names no loss for them)",
}
"""What each energy variant changes (:data:`~cxrfl.bench.fedfew.settings.ENERGY_VARIANTS`)."""


def _energy_variants(table: dict[str, Any]) -> list[str]:
    """FedFew against its energy variants: does the energy separate a UC's positives from its negatives?"""
    shown = [m for m in ("fedfew", *ENERGY_VARIANTS) if m in table]
    if len(shown) < 2:
        return []
    lines = [
        "",
        "What opens the energy gap (mean ± SD over seeds): the energy AUROC per UC test set, the training-time "
        "energy of the UC sites' positives minus their negatives at stage 2's kept round (> 0: positives above), "
        "F1 and CC AUROC. " + " ".join(f"{LABELS[m]}: {VARIANT_NOTES[m]}." for m in shown if m in VARIANT_NOTES),
        "",
        "| Method | "
        + " | ".join(f"{uc} energy AUROC" for uc in FEDFEW_UCS)
        + " | UC training energy gap | mean UC F1 | mean CC AUROC |",
        "| --- |" + " --- |" * (len(FEDFEW_UCS) + 3),
    ]
    for m in shown:
        e = table[m]
        cells = [_fmt(e["diagnostics"][uc]["energy_auroc"]) for uc in FEDFEW_UCS]
        gap = (e.get("stage2") or {}).get("energy", {}).get("uc_energy_gap")
        lines.append(
            f"| {e['label']} | {' | '.join(cells)} | {_fmt(gap)} | {_fmt(e['mean_uc_f1'])} | "
            f"{_fmt(e['mean_cc_auroc'], 3)} |"
        )
    return lines


def _convergence(table: dict[str, Any]) -> list[str]:
    ff = table.get("fedfew") or {}
    lines = []
    probe = ff.get("ssl_probe")
    if probe:
        rounds = list(probe)
        lines += [
            "",
            "Stage 1: linear-probe AUROC of the SimSiam encoder's features (one logistic regression per CC on the "
            "CC sites' labelled training images, mean AUROC over the CCs on the CC test set), per SimSiam round "
            "budget; 0 = the initial weights:",
            "",
            "| rounds | " + " | ".join(rounds) + " |",
            "| --- |" + " --- |" * len(rounds),
            "| probe AUROC | " + " | ".join(_fmt(probe[r], 3) for r in rounds) + " |",
        ]
    parts = [
        f"{p} {_fmt(v['rounds'], 1)} round(s) (best: stage-2 round {_fmt(v['best_round'], 1)}, CC validation loss "
        f"{_fmt(v['best_val_loss'], 3)})"
        for p, v in (ff.get("stage2") or {}).items()
    ]
    parts += [
        f"{table[m]['label']} {_fmt(table[m]['training']['rounds'], 1)} round(s) (best "
        f"{_fmt(table[m]['training']['best_round'], 1)})"
        for m in BASELINES
        if m in table and "training" in table[m]
    ]
    if parts:
        lines += ["", "Rounds run (mean ± SD over seeds): FedFew stage 2: " + "; ".join(parts) + "."]
    return lines + _selection(table)


def _selection(table: dict[str, Any]) -> list[str]:
    """What each method's selection rule gave up: its best CC validation AUROC minus that of the kept round."""
    rows = [m for m in METHODS if m in table and (table[m].get("selection_cost") or {}).get("mean") is not None]
    if not rows:
        return []
    lines = [
        "",
        "What the selection rule gave up (mean ± SD over seeds): the CC sites' best mean validation AUROC over the "
        "rounds minus that of the round kept by the lowest validation loss (FedFew: over stage 2's rounds, the "
        f"last phase's kept round). Above {COST_LIMIT}, the kept model is not the one the method learned, and its "
        "comparisons are marked as not results.",
        "",
        "| Method | CC validation AUROC given up |",
        "| --- | --- |",
    ]
    for m in rows:
        cost = table[m]["selection_cost"]
        mark = " (over the limit)" if over_limit(cost["mean"]) else ""
        lines.append(f"| {table[m]['label']} | {_fmt(cost, 3)}{mark} |")
    return lines


def _per_seed(runs: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """Every method and seed: mean CC AUROC and per UC detection AUROC / balanced accuracy."""

    def num(x: Any, digits: int) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    seeds = sorted({int(s) for by_seed in runs.values() for s in by_seed})
    lines = [
        "",
        "Per seed (every finished run):",
        "",
        "| seed | method | mean CC AUROC | " + " | ".join(f"{uc} AUROC / BA" for uc in FEDFEW_UCS) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in FEDFEW_UCS) + " |",
    ]
    for seed in seeds:
        for m in [m for m in METHODS if str(seed) in runs.get(m, {})]:
            r = runs[m][str(seed)]
            ucs = [(r.get("uc") or {}).get(uc) or {} for uc in FEDFEW_UCS]
            cells = [f"{num(u.get('auroc'), 3)} / {num(u.get('balanced_accuracy'), 3)}" for u in ucs]
            lines.append(f"| {seed} | {LABELS[m]} | {num(r.get('mean_cc_auroc'), 3)} | {' | '.join(cells)} |")
    return lines


def format_markdown(result: dict[str, Any], commit: str | None = None) -> str:
    """The report of a FedFew benchmark (``report.md``; also BENCHMARKS.md's FedFew section).

    Args:
        result: the ``results.json`` written by :func:`cxrfl.bench.fedfew.run.run_fedfew_benchmark`.
        commit: the commit named as the code that ran (default: the one the results name).
    """
    summary = result.get("summary", {})
    methods = summary.get("methods", {})
    lines = [
        "## FedFew: underrepresented classes held by few sites (synthetic `fedfew` profile)",
        "",
        *_header(result, commit or code_text(result) or "unknown"),
        "",
        *_table(methods),
        *_diagnostics(methods),
        *_energy_variants(methods),
        *_convergence(methods),
        *target_lines(summary.get("targets", {}), methods),
        *[line for m, t in (summary.get("post_hoc") or {}).items() for line in target_lines(t, methods, m)],
        *(_per_seed(result["runs"]) if result.get("runs") else []),
    ]
    if result.get("plots"):
        lines += ["", "Plots:", "", *[f"![{p.removesuffix('.png').replace('_', ' ')}]({p})" for p in result["plots"]]]
    return "\n".join(lines) + "\n"
