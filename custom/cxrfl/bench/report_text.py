"""Phrases the benchmarks' reports share: numbers, p-values and intervals, the provenance line, local steps,
a target's verdict."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cxrfl.bench.protocol import code_label, load_text


def provenance_line(results: Mapping[str, Any]) -> str:
    """The report's line on code, machine and command (every run's code: a resumed benchmark may mix them).

    Args:
        results: a benchmark's ``results.json`` (``runs``, ``code``, ``machine``, ``command_line``).
    """
    codes = sorted({code_label(r.get("code") or results.get("code") or {}) for r in results["runs"].values()})
    where = results.get("machine") or {}
    return (
        f"Code {', '.join(codes) or '-'}; {where.get('cpu', '?')} ({where.get('usable_cores', '?')} usable cores, "
        f"{where.get('torch_threads', '?')} torch thread(s), load {load_text(where)})."
        + (f" Command: `{results['command_line']}`." if results.get("command_line") else "")
    )


def local_steps(steps: int | None) -> str:
    """How much a site trains per round.

    Args:
        steps: cap on optimiser steps per local epoch (None: the whole split).
    """
    return "one local epoch per round" if steps is None else f"at most {steps} steps per local epoch"


def verdict(met: bool | None) -> str:
    """A target's verdict cell.

    Args:
        met: whether the target is met (None: not measured).
    """
    return "not measured" if met is None else "MET" if met else "NOT MET"


def num_text(v: float | None, digits: int = 3) -> str:
    """A number for a table cell or a sentence (``-`` where not defined).

    Args:
        v: the number (None: not defined).
        digits: decimals.
    """
    return "-" if v is None else f"{v:.{digits}f}"


def p_text(v: float | None) -> str:
    """A p-value for a table cell or a sentence (``-``: no test)."""
    return "-" if v is None else f"{v:.2g}" if v < 0.001 else f"{v:.3f}"


def ci_text(ci: Any, digits: int = 3) -> str:
    """An interval ``[low, high]`` (``-``: none)."""
    return "-" if not ci else f"[{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table.

    Args:
        header: the column names.
        rows: the cells of each row, as text.
    """
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
