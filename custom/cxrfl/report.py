"""Summarise a finished job's server output for an operator: where the models are, how it went."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cxrfl.errors import DataError


def find_server_app(path: str | Path) -> Path:
    """Locate the server app folder of a run.

    Args:
        path: a simulator workspace (``-w``), a downloaded job result, or the app folder itself.
    """
    path = Path(path)
    for candidate in (path, *sorted(path.glob("**/app_server"))):
        if (candidate / "cxrfl" / "rounds.jsonl").is_file():
            return candidate
    raise DataError(f"no cxrfl server output (app_server/cxrfl/rounds.jsonl) under {path}; did the job run?")


def load_run(path: str | Path) -> dict[str, Any]:
    """Read the records of a run.

    Args:
        path: see :func:`find_server_app`.
    """
    app = find_server_app(path)
    rounds = [json.loads(line) for line in (app / "cxrfl" / "rounds.jsonl").read_text().splitlines() if line.strip()]
    evaluation_path = app / "cxrfl" / "evaluation.json"
    evaluation = json.loads(evaluation_path.read_text()) if evaluation_path.is_file() else None
    return {"app": app, "rounds": rounds, "evaluation": evaluation, "evaluation_path": evaluation_path}


def _f(v: Any) -> str:
    return "  n/a" if v is None or v != v else f"{v:.3f}"


def format_report(run: dict[str, Any], external: dict[str, Any] | None = None) -> str:
    """A readable summary: model paths, per-round losses, per-site test AUROC.

    Args:
        run: output of :func:`load_run`.
        external: optional evaluation on an external set (from :func:`cxrfl.nn.evaluation.evaluate_on_site`).
    """
    app = run["app"]
    lines = [
        f"global model:      {app / 'FL_global_model.pt'}",
        f"best global model: {app / 'best_FL_global_model.pt'}",
        f"round records:     {app / 'cxrfl' / 'rounds.jsonl'}",
        f"evaluation:        {run['evaluation_path']}",
        "",
        "round  sites  phase      model  mean val loss  mean val AUROC",
    ]
    for r in run["rounds"]:
        loss = r.get("mean_val_loss", r.get("mean_val_loss_of_previous_global"))  # older runs: the old key
        scored = r.get("evaluated_round", r["round"] - 1 if r.get("phase") == "train" else None)
        lines.append(f"{r['round']:>5}  {len(r.get('sites_aggregated') or []):>5}  {r.get('phase', ''):<9}  "
                     f"{'' if scored is None else scored:>5}  {_f(loss) if scored is not None else '':>13}  "
                     f"{_f(r.get('mean_val_auroc')) if scored is not None else '':>14}")
        if r.get("reason"):
            lines.append(f"       {r['reason']}")
    ev = run["evaluation"]
    if ev:
        lines += ["", f"test AUROC of the selected model (round {ev.get('best_round', '?')}; {len(ev['classes'])} classes, "
                      f"{len(ev['shared_classes'])} shared):"]
        for site, m in sorted(ev["sites"].items()):
            sh, un = m.get("shared", {}), m.get("unique", {})
            lines.append(
                f"  {site:<14} mean {_f(m.get('mean'))} +- {_f(m.get('sd'))}  shared {_f(sh.get('mean'))}  unique {_f(un.get('mean'))}"
            )
        if ev.get("external"):
            e = ev["external"]
            lines.append(f"  external {e['site']:<5} mean {_f(e.get('mean'))} +- {_f(e.get('sd'))}")
    if external:
        lines.append(f"  external {external['site']}: mean {_f(external.get('mean'))} +- {_f(external.get('sd'))} over {external['images']} images")
        for c, v in sorted(external["auroc"].items()):
            lines.append(f"    {c:<28} {_f(v)}")
    return "\n".join(lines)
