"""Summarise a finished surgical-aggregation run for a person: how it went, how good it is, where it is.

``cxrfl report WS`` reads the server's records (``cxrfl/rounds.jsonl``, ``cxrfl/evaluation.json``)
and prints, in a few lines: the rounds with the mean validation loss curve (a sparkline and the
values) and why the run stopped, the selected model's test AUROC per site (shared vs unique
classes) and on an external set (by the classes each site annotates), where the models and
records are, and the next commands. ``--plots DIR`` writes the learning curves and per-class
AUROCs as PNG files.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cxrfl.common.io import read_records
from cxrfl.common.server import BEST_MODEL, GLOBAL_MODEL, RECORDS_DIR
from cxrfl.errors import DataError
from cxrfl.nn.metrics import summarise_auroc

SPARKS = "▁▂▃▄▅▆▇█"


def find_server_app(path: str | Path) -> Path:
    """Locate the server app folder of a run.

    Args:
        path: a simulator workspace (``-w``), a downloaded job result, or the app folder itself.
    """
    path = Path(path)
    for candidate in (path, *sorted(path.glob("**/app_server"))):
        if (candidate / RECORDS_DIR / "rounds.jsonl").is_file():
            return candidate
    raise DataError(
        f"no cxrfl server output (app_server/cxrfl/rounds.jsonl) under {path}; did the job run? "
        f"(an evaluation-only run has no rounds: cxrfl report {path} --clinical DIR)"
    )


def load_run(path: str | Path) -> dict[str, Any]:
    """Read the records of a run.

    Args:
        path: see :func:`find_server_app`.
    """
    app = find_server_app(path)
    evaluation_path = app / RECORDS_DIR / "evaluation.json"
    evaluation = json.loads(evaluation_path.read_text()) if evaluation_path.is_file() else None
    return {
        "app": app,
        "rounds": read_records(app / RECORDS_DIR / "rounds.jsonl"),
        "evaluation": evaluation,
        "evaluation_path": evaluation_path,
    }


def learning_curve(rounds: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The scored models in order: ``model`` round, mean validation ``loss`` and ``auroc``.

    Args:
        rounds: the run's records.
    """
    points: dict[int, dict[str, Any]] = {}
    for r in rounds:
        if not r.get("aggregated", r.get("phase") == "validate") or r.get("phase") not in ("train", "validate"):
            continue
        model = r.get("evaluated_round", r["round"] - 1 if r.get("phase") == "train" else r["round"])
        loss = r.get("mean_val_loss", r.get("mean_val_loss_of_previous_global"))  # older runs: the old key
        if loss is not None:
            points[int(model)] = {"model": int(model), "loss": loss, "auroc": r.get("mean_val_auroc")}
    return [points[k] for k in sorted(points)]


def sparkline(values: Sequence[float]) -> str:
    """One block character per value, low to high (NaN as a space).

    Args:
        values: the numbers.
    """
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return ""
    low, high = min(finite), max(finite)
    span = (high - low) or 1.0
    return "".join(
        " " if v is None or not math.isfinite(v) else SPARKS[round((v - low) / span * (len(SPARKS) - 1))]
        for v in values
    )


def command(name: str) -> str:
    """How to call one of this environment's commands from the current folder (``.venv/bin/cxrfl`` ...).

    Args:
        name: the command (``cxrfl``, ``tensorboard``).
    """
    exe = Path(sys.executable).with_name(name)
    if not exe.is_file():
        return name
    try:
        return str(exe.relative_to(Path.cwd()))
    except ValueError:
        return str(exe)


def _f(v: Any) -> str:
    return "n/a" if v is None or v != v else f"{v:.3f}"


def _stop_reason(rounds: Sequence[Mapping[str, Any]], curve: Sequence[Mapping[str, Any]], best: int | None) -> str:
    stopped = [r for r in rounds if r.get("phase") == "stopped"]
    if stopped:
        return f"stopped: {stopped[-1].get('reason', 'see the log')}"
    trained = [r["round"] for r in rounds if r.get("phase") == "train" and r.get("aggregated")]
    last = max(trained, default=0)
    budget = [r["time_budget"] for r in rounds if r.get("phase") == "time_budget"]
    ran = f"{last} round(s)" + (f" (then the time budget of {budget[-1]:g}s was spent)" if budget else "")
    after_best = (curve[-1]["model"] - best) if curve and best is not None else 0
    if curve and after_best > 0 and curve[-1]["model"] >= last:
        if budget:  # stopped by the clock, not by patience: a flat stretch this short proves nothing
            return f"{ran}; the last {after_best} scored model(s) did not improve on the selected one"
        return f"{ran}; the validation loss did not improve in the last {after_best} scored model(s): it has flattened"
    return f"{ran}; the best model is the last one scored (the loss may still fall: more rounds could help)"


def site_classes(evaluation: Mapping[str, Any]) -> dict[str, list[str]]:
    """Each training site's own classes, as its test evaluation lists them.

    Args:
        evaluation: ``cxrfl/evaluation.json``.
    """
    return {s: sorted(m.get("auroc") or {}) for s, m in (evaluation.get("sites") or {}).items()}


def external_parts(
    external: Mapping[str, Any], own: Mapping[str, Sequence[str]], shared: Sequence[str]
) -> dict[str, dict]:
    """External-set AUROC summarised over the shared classes and over each site's unique classes.

    Args:
        external: an evaluation with ``auroc`` (class -> AUROC).
        own: site -> its classes.
        shared: the classes of two or more sites.
    """
    auroc = external.get("auroc") or {}
    parts = {"all": summarise_auroc(auroc), "shared": summarise_auroc({c: auroc.get(c) for c in shared if c in auroc})}
    for site, classes in sorted(own.items()):
        unique = [c for c in classes if c not in shared and c in auroc]
        if unique:
            parts[f"{site} only"] = summarise_auroc({c: auroc[c] for c in unique})
    return parts


def _evaluation_lines(evaluation: Mapping[str, Any] | None, external: Mapping[str, Any] | None) -> list[str]:
    if not evaluation:
        return ["", "no evaluation.json: the run did not finish its evaluation"]
    shared = list(evaluation.get("shared_classes") or [])
    lines = [
        "",
        f"test AUROC of the selected model (round {evaluation.get('best_round', '?')}; "
        f"{len(evaluation.get('classes') or [])} classes, {len(shared)} shared by two or more sites):",
    ]
    for site, m in sorted((evaluation.get("sites") or {}).items()):
        lines.append(
            f"  {site:<14} mean {_f(m.get('mean'))} ± {_f(m.get('sd'))}   "
            f"shared {_f((m.get('shared') or {}).get('mean'))}"
            f"   unique {_f((m.get('unique') or {}).get('mean'))}   ({len(m.get('auroc') or {})} classes"
            + (f", {m['images']} images)" if "images" in m else ")")
        )
    for ext in (evaluation.get("external"), external):
        if ext:
            parts = external_parts(ext, site_classes(evaluation), shared)
            detail = "   ".join(f"{name} {_f(p.get('mean'))}" for name, p in parts.items() if name != "all")
            lines.append(
                f"  external {ext.get('site', '')}: mean {_f(parts['all'].get('mean'))} ± {_f(parts['all'].get('sd'))}"
                f"   {detail}" + (f"   ({ext['images']} images)" if "images" in ext else "")
            )
    return lines


def format_report(
    run: Mapping[str, Any],
    external: Mapping[str, Any] | None = None,
    *,
    workspace: str | Path | None = None,
    example_image: str | Path | None = None,
) -> str:
    """The summary a person reads after a run.

    Args:
        run: output of :func:`load_run`.
        external: optional evaluation on an external set (:func:`cxrfl.nn.evaluation.evaluate_on_site`).
        workspace: the path the user gave (for the next commands; default: the app folder).
        example_image: an image to show the ``cxrfl predict`` command with.
    """
    app, rounds, evaluation = Path(run["app"]), run["rounds"], run["evaluation"]
    curve = learning_curve(rounds)
    best = (evaluation or {}).get("best_round")
    lines = [f"run: {_stop_reason(rounds, curve, best)}; selected model: round {best if best is not None else '?'}"]
    if curve:
        lines += [
            "",
            "mean validation loss of the global model per round (lower is better)   "
            f"{sparkline([p['loss'] for p in curve])}",
            "  round  " + " ".join(f"{p['model']:>6}" for p in curve),
            "  loss   " + " ".join(f"{p['loss']:>6.3f}" for p in curve),
            "  AUROC  " + " ".join(f"{_f(p['auroc']):>6}" for p in curve),
        ]
    lines += _evaluation_lines(evaluation, external)
    ws = Path(workspace) if workspace is not None else app
    best_model = app / BEST_MODEL
    lines += [
        "",
        "files:",
        f"  selected model   {best_model}",
        f"  latest model     {app / GLOBAL_MODEL}",
        f"  round records    {app / RECORDS_DIR / 'rounds.jsonl'}",
        f"  evaluation       {run['evaluation_path']}",
        "",
        "next:",
        f"  {command('cxrfl')} predict --model {best_model} {example_image or 'IMAGE.png|.dcm'}",
        f"  {command('cxrfl')} report {ws} --plots {ws / 'plots'}     (learning curves and per-class AUROC as PNG)",
    ]
    if (evaluation or {}).get("pooled"):
        lines.append(
            f"  {command('cxrfl')} report {ws} --clinical {ws / 'clinical'}     (per-class report for clinicians)"
        )
    tb = app.parent / "tb_events"
    if tb.is_dir():
        lines.append(f"  {command('tensorboard')} --logdir {tb}")
    return "\n".join(lines)


def write_plots(run: Mapping[str, Any], out: str | Path, external: Mapping[str, Any] | None = None) -> list[Path]:
    """Learning curves and per-class test AUROC as PNG files.

    Args:
        run: output of :func:`load_run`.
        out: the folder.
        external: optional external evaluation (plotted beside the sites).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    curve = learning_curve(run["rounds"])
    if curve:
        fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
        a.plot([p["model"] for p in curve], [p["loss"] for p in curve], marker="o")
        a.set(xlabel="round of the global model", ylabel="mean validation BCE", title="validation loss")
        b.plot([p["model"] for p in curve], [p["auroc"] for p in curve], marker="o", color="tab:green")
        b.set(xlabel="round of the global model", ylabel="mean validation AUROC", title="validation AUROC")
        fig.tight_layout()
        written.append(out / "learning_curve.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    sets = {s: m.get("auroc") or {} for s, m in ((run["evaluation"] or {}).get("sites") or {}).items()}
    if external:
        sets[f"external {external.get('site', '')}"] = external.get("auroc") or {}
    if sets:
        classes = sorted(set().union(*sets.values()))
        fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(classes)), 3.6))
        width = 0.8 / len(sets)
        for i, (name, auroc) in enumerate(sets.items()):
            ax.bar(
                [k + i * width for k in range(len(classes))], [auroc.get(c) or 0 for c in classes], width, label=name
            )
        ax.axhline(0.5, color="grey", lw=0.8, ls="--")
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(classes))], classes, rotation=60, ha="right", fontsize=8)
        ax.set(ylabel="test AUROC", ylim=(0, 1), title="selected model: test AUROC per class")
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(out / "auroc_per_class.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written
