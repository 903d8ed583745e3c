"""The package's layering, read from the source (docs/architecture.md, "Layers").

Every ``.py`` under ``custom/cxrfl`` is parsed; every import counts, those inside functions and
under ``TYPE_CHECKING`` too, relative ones resolved, and ``importlib.import_module("...")`` /
``__import__("...")`` calls with a literal name. Nothing is imported, so a lazy import cannot hide.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "custom" / "cxrfl"

LAYERS: dict[str, int] = {
    "cxrfl": 0,
    "cxrfl.errors": 0,  # the package root holds only __version__
    "cxrfl.common": 1,
    "cxrfl.data": 2,
    "cxrfl.nn": 3,
    "cxrfl.clinical": 3,
    "cxrfl.synth": 3,
    "cxrfl.core": 4,  # the shared federated core: update checks, streaming sum, head-agnostic FedAvg
    "cxrfl.surgical": 5,
    "cxrfl.cwt": 6,
    "cxrfl.fedfew": 6,
    "cxrfl.fedeval": 6,
    "cxrfl.bundle": 7,
    "cxrfl.predict": 7,
    "cxrfl.report": 7,
    "cxrfl.fl": 8,
    "cxrfl.job_folders": 9,
    "cxrfl.jobs": 10,
    "cxrfl.deploy": 11,
    "cxrfl.bench": 12,
    "cxrfl.cli": 13,
}
"""Unit (a package, or a module of the package root) -> layer. A unit imports its own modules and
units of lower layers only: never one of its own layer or above."""

NVFLARE: dict[str, str] = {
    "cxrfl.fl": "the NVFlare layer: controllers, executors, filters, recipes, tracking",
    "cxrfl.deploy": "deployment with NVFlare's own tools: the FLARE API session, the default class allow list",
    "cxrfl.bench.speed_aggregation": "times NVFlare's own FedAvg aggregator against cxrfl's",
}
"""The only modules (or packages) that may import ``nvflare``, with the reason."""

SYNTH_USERS: dict[str, str] = {
    "cxrfl.fl.site_config": "the NVFlare simulator's fallback to the embedded demo data",
    "cxrfl.cli": "`cxrfl data synth` and `cxrfl report --external demo`: demo data asked for by name",
}
"""The only product modules (outside ``cxrfl.bench``) that may import ``cxrfl.synth``."""

CORE_ONLY = ("cxrfl.cwt", "cxrfl.fedfew")
"""Methods that take the federated mechanisms from :mod:`cxrfl.core` only, never from :mod:`cxrfl.surgical`."""

BENCH_USERS = frozenset({"cxrfl.cli"})
"""The only module outside ``cxrfl.bench`` that may import it (it dispatches ``cxrfl bench ...``)."""


def module_name(path: Path) -> str:
    """The dotted name of a module file under :data:`PACKAGE`."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> list[tuple[str, int]]:
    """Every module a parsed module imports, with the line: ``from a import b`` names ``a.b`` where
    that is a module of :data:`PACKAGE` (``known``), else ``a``.

    Args:
        tree: the parsed module.
        module: its dotted name.
        is_package: whether it is an ``__init__.py``.
        known: the dotted names of the package's modules.
    """
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: None if is_package else -1]
                parent = parent[: len(parent) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            found += [(name, node.lineno) for name in subs or [base]]
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
        ):
            found.append((node.args[0].value, node.lineno))
    return found


def scan() -> dict[str, list[tuple[str, int]]]:
    """Module -> what it imports, for every module of :data:`PACKAGE`."""
    files = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    known = set(files)
    return {
        m: imports_of(ast.parse(p.read_text(), str(p)), m, p.name == "__init__.py", known) for m, p in files.items()
    }


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def unit_of(module: str) -> str | None:
    """The :data:`LAYERS` unit a module belongs to (the longest matching entry)."""
    units = [u for u in LAYERS if u != "cxrfl" and within(module, u)]
    return max(units, key=len) if units else ("cxrfl" if module == "cxrfl" else None)


@pytest.fixture(scope="module")
def graph() -> dict[str, list[tuple[str, int]]]:
    return scan()


def test_scanner_sees_function_relative_and_string_imports():
    code = (
        "def f():\n    from .models import HEAD_PREFIX\n    import nvflare.apis\n"
        "from cxrfl import cli\nimport importlib\nimportlib.import_module('cxrfl.bench.cli')\n"
    )
    found = imports_of(ast.parse(code), "cxrfl.nn.training", False, {"cxrfl.nn.models", "cxrfl.cli"})
    assert sorted(found, key=lambda f: f[1]) == [
        ("cxrfl.nn.models", 2),
        ("nvflare.apis", 3),
        ("cxrfl.cli", 4),
        ("importlib", 5),
        ("cxrfl.bench.cli", 6),
    ]


def test_every_module_has_a_layer(graph):
    assert len(graph) > 100  # the walk found the package
    assert [m for m in graph if unit_of(m) is None] == [], "add the new package to LAYERS (and docs/architecture.md)"


def test_no_import_upward_or_sideways(graph):
    bad = []
    for module, found in graph.items():
        unit = unit_of(module)
        for name, line in found:
            target = unit_of(name) if within(name, "cxrfl") else None
            if target is not None and target != unit and LAYERS[target] >= LAYERS[unit]:
                bad.append(f"{module}:{line} imports {name} (layer {LAYERS[unit]} -> {LAYERS[target]})")
    assert bad == [], "\n".join(bad)


def test_only_declared_modules_import_nvflare(graph):
    bad = [
        f"{m}:{line} imports {name}"
        for m, found in graph.items()
        for name, line in found
        if within(name, "nvflare") and not any(within(m, allowed) for allowed in NVFLARE)
    ]
    assert bad == [], "\n".join(bad)


def test_product_never_imports_bench_and_synth_only_for_the_demo(graph):
    bad = []
    for module, found in graph.items():
        if within(module, "cxrfl.bench"):
            continue
        for name, line in found:
            if within(name, "cxrfl.bench") and module not in BENCH_USERS:
                bad.append(f"{module}:{line} imports {name}")
            if within(name, "cxrfl.synth") and not within(module, "cxrfl.synth") and module not in SYNTH_USERS:
                bad.append(f"{module}:{line} imports {name}")
    assert bad == [], "\n".join(bad)


def test_no_cycle_between_the_cli_and_the_bench_cli(graph):
    reached, todo = set(), ["cxrfl.bench.cli"]
    while todo:
        module = todo.pop()
        for name, _ in graph.get(module, []):
            if name in graph and name not in reached:
                reached.add(name)
                todo.append(name)
    assert "cxrfl.cli" not in reached
    assert "cxrfl.bench.cli" in {name for name, _ in graph["cxrfl.cli"]}


def test_cwt_and_fedfew_take_the_shared_mechanisms_from_the_core_not_from_surgical(graph):
    # issue 43 point 1: one kernel; the methods share cxrfl.core, none borrows surgical aggregation's modules
    bad = [
        f"{m}:{line} imports {name}"
        for m, found in graph.items()
        if any(within(m, unit) for unit in CORE_ONLY)
        for name, line in found
        if within(name, "cxrfl.surgical")
    ]
    assert bad == [], "\n".join(bad)
    for unit in CORE_ONLY:  # the scan sees their core imports: the check above is not vacuous
        imported = {name for m, found in graph.items() if within(m, unit) for name, _ in found}
        assert any(within(name, "cxrfl.core") for name in imported), unit
