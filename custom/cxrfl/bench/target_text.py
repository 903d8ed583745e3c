"""The targets of a comparison in words: one sentence per target, with its numbers, tests and verdict."""

from __future__ import annotations

from typing import Any

from cxrfl.bench.report_text import ci_text, num_text, p_text
from cxrfl.bench.selection_cost import COST_LIMIT


def targets_section(results: dict[str, Any]) -> list[str]:
    """The report's "Targets" section: one sentence per target (empty when there is none).

    Args:
        results: a comparison's results (``targets``, ``methods``).
    """
    targets = results.get("targets") or []
    if not targets:
        return []
    out = ["## Targets", ""]
    if not targets[0].get("binding"):
        out += [
            "(The issues set these targets for the two-hospitals and real profiles; shown here for information.)",
            "",
        ]
    out += ["- " + target_sentence(t, results["methods"]) for t in targets]
    return out + [""]


def _judged(stats: dict[str, Any]) -> str:
    """The Holm-adjusted p and the detectable difference, where this test was the one judged."""
    if "p_holm" not in stats:
        return ""
    return (
        f" (Holm-adjusted {p_text(stats.get('p_holm'))}), detectable difference (80 % power) "
        f"{num_text(stats.get('detectable'))}"
    )


def _stats_text(t: dict[str, Any]) -> str:
    """A comparison's tests over classes and over seeds, and its move from the old selection rule."""
    c, s = t.get("classes") or {}, t.get("seeds") or {}
    parts = []
    if (c.get("n") or 0) >= 2:
        parts.append(
            f"over {c['n']} classes: 95% CI {ci_text(c.get('ci'))}, d_z {num_text(c.get('d_z'), 2)}, "
            f"t-test p {p_text(c.get('p'))}{_judged(c)}, Wilcoxon p {p_text(c.get('wilcoxon_p'))}"
        )
    if (s.get("n") or 0) >= 2:
        parts.append(
            f"over {s['n']} seeds: {num_text(s.get('difference'))} {ci_text(s.get('ci'))}, "
            f"d_z {num_text(s.get('d_z'), 2)}, p {p_text(s.get('p'))}{_judged(s)}"
        )
    old = t.get("old_rule")
    if old:
        parts.append(
            f"under the old {old['rule']!r} rule ({len(old['seeds'])} seeds) vanilla FL scored "
            f"{num_text(old['vanilla_before'])} here, so the difference moved by {old['difference_change']:+.3f}"
        )
    return "; ".join(parts)


def target_sentence(t: dict[str, Any], methods: dict[str, Any]) -> str:
    """One sentence per target: met or not, by how much, with effect sizes and p-values.

    Args:
        t: a target record from :func:`cxrfl.bench.targets.evaluate_targets`.
        methods: the results' methods (for labels).
    """
    a = methods[t["method"]]["label"]
    part = f" ({t['part']} classes)" if t.get("part") else ""
    where = f"on `{t['view']}`{part}"
    if "statement" in t:
        verdict = "not measurable" if t["met"] is None else f"**{'MET' if t['met'] else 'NOT MET'}**"
        return f"{t['target']}: {verdict} — {t['statement']}."
    if t["against"] is None:
        if t["met"] is None:
            return f"{t['target']}, {a} {where}: not measurable."
        return (
            f"{t['target']}, {a} {where}: **{'MET' if t['met'] else 'NOT MET'}** — {t['value']:.3f} "
            f"(95% CI over seeds {ci_text(t.get('value_ci'))})."
        )
    b = methods[t["against"]]["label"]
    if t.get("selection_cost") and t["difference"] is not None:
        return _not_a_result(t, methods, a, b, where)
    if t["met"] is None:
        return f"{t['target']} {where}: not measurable ({a} {num_text(t['value'])}, {b} {num_text(t['other'])})."
    stats = _stats_text(t)
    return (
        f"{t['target']} {where}: **{'MET' if t['met'] else 'NOT MET'}** — {a} {t['value']:.3f} "
        f"vs {b} {t['other']:.3f}, difference {t['difference']:+.3f} (rule {t['rule']}){'; ' + stats if stats else ''}."
    )


def _not_a_result(t: dict[str, Any], methods: dict[str, Any], a: str, b: str, where: str) -> str:
    """A comparison whose selection gave up more validation AUROC than the targets' smallest meaningful gap."""
    costs = ", ".join(
        f"{methods[e]['label']} {c:.3f}" for e, c in sorted(t["selection_cost"].items(), key=lambda kv: -kv[1])
    )
    stats = _stats_text(t)
    return (
        f"{t['target']} {where}: **NOT A RESULT** — {a} {t['value']:.3f} vs {b} {t['other']:.3f}, difference "
        f"{t['difference']:+.3f} (rule {t['rule']}: the numbers alone would say "
        f"{'met' if t.get('rule_met') else 'not met'}); the selection rule gave up more than "
        f"{COST_LIMIT:g} of mean validation AUROC (best round minus selected round, mean over seeds: {costs}), "
        f"so the difference does not measure the methods{'; ' + stats if stats else ''}."
    )
