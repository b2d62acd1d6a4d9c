"""Imports point down: the package's floors, no cycle between its parts, and quant/'s module order.

Read from the source (``ast``), every import of ``deepspeed_ppq`` and ``megatron_patches``, module level and
inside functions alike: an import placed in a function still depends on what it imports. A failure names
the file, the line and the import.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("deepspeed_ppq", "megatron_patches")

# Floors, bottom first. A module may import its own part, any part on a lower floor, and another part of
# its own floor as long as the parts' import graph has no cycle (test_no_cycle_between_parts).
FLOORS: list[tuple[str, ...]] = [
    ("deepspeed_ppq.formats", "deepspeed_ppq.memory_categories"),  # tables and names: no torch, no package
    ("deepspeed_ppq.config",),
    ("deepspeed_ppq.ops",),
    ("deepspeed_ppq.quant", "deepspeed_ppq.compress", "deepspeed_ppq.schedule", "deepspeed_ppq.models"),
    ("deepspeed_ppq.autotune",),
    ("deepspeed_ppq.integrations", "megatron_patches", "deepspeed_ppq.env_report", "deepspeed_ppq.cli"),
]
# The root package ``deepspeed_ppq`` is loaded by every import of a submodule and imports nothing when it
# loads (its public names are lazy and reach the top floor): it is checked neither as importer nor target.
ROOT_PACKAGE = "deepspeed_ppq"

# Upward imports by design: (importer, imported) -> why.
UPWARD = {
    ("deepspeed_ppq.autotune", "deepspeed_ppq.integrations.autotune"):
        "deepspeed_ppq.autotune(...) called tunes with the DeepSpeed runner; imported only when called",
}

# quant/, bottom to top: a module imports only those before it (the package __init__ imports any).
QUANT_ORDER = ["ops", "sr_ops", "adam8bit", "formats", "policy", "linear", "optim", "master_free", "ledger"]
# Parts whose imports of the package all sit at module level (no import inside a function to dodge a cycle).
MODULE_LEVEL_ONLY = ("deepspeed_ppq.formats", "deepspeed_ppq.memory_categories", "deepspeed_ppq.config",
                     "deepspeed_ppq.quant")


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module
    target: str  # dotted module it imports
    path: str  # file, relative to the repository
    line: int
    text: str  # the import statement
    inner: bool  # inside a function or class body

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: `{self.text}`" + (" (inside a function)" if self.inner else "")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _import_nodes(tree: ast.AST):
    """(import node, inside a function?) of every import in a module."""
    def walk(node, inner):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, inner
            yield from walk(child, inner or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))
    yield from walk(tree, False)


@functools.cache
def _imports() -> list[Import]:
    modules = _modules()
    out = []
    for name, path in modules.items():
        text = path.read_text()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node, inner in _import_nodes(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in dict.fromkeys(targets):
                if t.split(".")[0] in PACKAGES:
                    out.append(Import(name, t, str(path.relative_to(ROOT)), node.lineno,
                                      ast.get_source_segment(text, node) or "", inner))
    return out


def _part(module: str) -> str | None:
    """The floor entry a module belongs to (the longest that is it or a package above it)."""
    found = [p for floor in FLOORS for p in floor if module == p or module.startswith(p + ".")]
    return max(found, key=len) if found else None


def _floor(part: str) -> int:
    return next(i for i, floor in enumerate(FLOORS) if part in floor)


def test_every_module_has_a_floor():
    missing = [m for m in _modules() if m != ROOT_PACKAGE and _part(m) is None]
    assert not missing, f"modules on no floor (add them to FLOORS in {Path(__file__).name}): {missing}"


def test_imports_point_down():
    bad = []
    for imp in _imports():
        if ROOT_PACKAGE in (imp.importer, imp.target) or (imp.importer, imp.target) in UPWARD:
            continue
        src, dst = _part(imp.importer), _part(imp.target)
        if _floor(dst) > _floor(src):
            bad.append(f"{imp}: {src} (floor {_floor(src)}) imports {dst} (floor {_floor(dst)}), above it")
    assert not bad, "imports that point up:\n" + "\n".join(bad)


def test_upward_exceptions_still_exist():
    found = {(imp.importer, imp.target) for imp in _imports()}
    stale = [k for k in UPWARD if k not in found]
    assert not stale, f"UPWARD lists imports that are gone (remove them): {stale}"


def test_no_cycle_between_parts():
    edges: dict[str, dict[str, Import]] = {}
    for imp in _imports():
        if ROOT_PACKAGE in (imp.importer, imp.target) or (imp.importer, imp.target) in UPWARD:
            continue
        src, dst = _part(imp.importer), _part(imp.target)
        if src != dst:
            edges.setdefault(src, {}).setdefault(dst, imp)

    def cycle_from(start: str, node: str, path: list[str]) -> list[str] | None:
        for nxt in edges.get(node, {}):
            if nxt == start:
                return path + [nxt]
            if nxt not in path:
                found = cycle_from(start, nxt, path + [nxt])
                if found:
                    return found
        return None

    for start in edges:
        cycle = cycle_from(start, start, [start])
        if cycle:
            steps = [f"  {a} -> {b}: {edges[a][b]}" for a, b in zip(cycle, cycle[1:])]
            raise AssertionError("parts import each other in a cycle:\n" + "\n".join(steps))


def test_quant_modules_import_only_those_below_them():
    quant = [m for m in _modules() if m.startswith("deepspeed_ppq.quant.")]
    unplaced = [m for m in quant if m.rpartition(".")[2] not in QUANT_ORDER]
    assert not unplaced, f"quant modules not in QUANT_ORDER (place them in {Path(__file__).name}): {unplaced}"
    bad = []
    pkg = "deepspeed_ppq.quant"
    for imp in _imports():
        if not (imp.importer.startswith(pkg + ".") and imp.target.startswith(pkg)):
            continue
        me = QUANT_ORDER.index(imp.importer.rpartition(".")[2])
        if imp.target == "deepspeed_ppq.quant":
            bad.append(f"{imp}: a quant module imports the package (its __init__ imports every module)")
            continue
        it = QUANT_ORDER.index(imp.target.split(".")[2])
        if it >= me:
            below = ", ".join(QUANT_ORDER[:me]) or "none"
            bad.append(f"{imp}: quant.{QUANT_ORDER[me]} may import only {below}")
    assert not bad, "quant/ imports against its order:\n" + "\n".join(bad)


def test_lower_parts_import_at_module_level():
    bad = [str(imp) for imp in _imports()
           if imp.inner and _part(imp.importer) in MODULE_LEVEL_ONLY and imp.target != ROOT_PACKAGE]
    assert not bad, "imports inside functions (move them to the top of the module):\n" + "\n".join(bad)
