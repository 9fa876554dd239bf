"""The layer rule, checked on the source: lower layers import nothing from the upper ones.

Lower: infra, analysis, capture (and its capture_values / capture_opaque / capture_caches / capture_tensor_data), cache,
parallel, quant,
and the top-level kernels/ and patterns/ folders (installed as dit_passes.kernels / dit_passes.patterns). A lower
layer imports only lower layers: not
passes, compiled, frontend, launch, cli, backend, demo, fidelity, bench, nor the package root
(``from dit_passes import compile_dit``). Every import counts, also one inside a function.
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# capture: capture.py with its parts capture_values.py (value specialisation), capture_opaque.py (opaque modules) and
# capture_caches.py (the state a trace leaves in the model), capture_tensor_data.py (``Tensor.data`` while traced)
LOWER = {"infra", "analysis", "capture", "capture_values", "capture_opaque", "capture_caches", "capture_tensor_data",
         "cache", "parallel", "quant", "kernels", "patterns"}


def _unit_of(path: pathlib.Path) -> tuple:
    """(layer, package parts) of a source file: dit_passes/<layer>/..., kernels/..., patterns/..."""
    rel = path.relative_to(ROOT).with_suffix("").parts
    if rel[0] in ("kernels", "patterns"):
        return rel[0], ("dit_passes",) + rel[:-1]
    return rel[1], rel[:-1]


def _imported_layers(path: pathlib.Path):
    layer, package = _unit_of(path)
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1])
                full = base + (node.module.split(".") if node.module else [])
            else:
                full = (node.module or "").split(".")
            if full[:1] == ["dit_passes"]:
                names = [full + [a.name if a.name in LOWER else "<package root>"] if len(full) == 1 else full
                         for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names if a.name.startswith("dit_passes.")]
        for parts in names:
            if len(parts) > 1:
                yield node.lineno, parts[1]


def _sources():
    for folder in ("dit_passes", "kernels", "patterns"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_lower_layers_import_no_upper_layer():
    bad = set()
    for path in _sources():
        layer, _ = _unit_of(path)
        if layer not in LOWER:
            continue
        for line, target in _imported_layers(path):
            if target not in LOWER:
                bad.add(f"{path.relative_to(ROOT)}:{line} imports dit_passes.{target}")
    assert not bad, "lower layers import upper ones:\n" + "\n".join(sorted(bad))


def test_the_check_sees_imports():
    # the walker must find relative, absolute and function-level imports, or the test above proves nothing
    found = {(p.relative_to(ROOT).as_posix(), t) for p in _sources() for _, t in _imported_layers(p)}
    assert ("dit_passes/compiled.py", "passes") in found
    assert ("dit_passes/passes/dbcache.py", "infra") in found
    assert any(src.startswith("dit_passes/passes/") and t == "analysis" for src, t in found)
