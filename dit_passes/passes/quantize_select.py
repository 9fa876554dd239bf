"""Which linears the quantize passes take (``passes/quantize.py``): by block (the discovered ones, the modules of named
classes, or every linear), then ``include`` / ``exclude`` (role names or module-path substrings) and ``filter_fn``."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

ROLE_NAMES = ("q", "k", "v", "qkv", "attn_out", "mlp_up", "mlp_down", "proj", "modulation", "router", "other")
# every block linear, the modulation ones too (SVDQuant: weight-only int8), but a mixture of experts' router: its
# rounding flips which experts run (NucleusMoE's gate in e4m3: 0.23 relative error of the output alone, the rest of
# the model in fp8 0.02; bench/results/coverage.md). exclude=() quantizes it too.
DEFAULT_EXCLUDE: Tuple[str, ...] = ("router",)


def _matches(entry: str, path: str, role: str) -> bool:
    return role == entry if entry in ROLE_NAMES else entry in path


def check_patterns(name: str, value: Optional[Sequence[str]]) -> Optional[Tuple[str, ...]]:
    if value is None:
        return None
    if isinstance(value, str):
        value = (value,)
    if not all(isinstance(v, str) and v for v in value):
        raise TypeError(f"{name} must be a list of non-empty strings (roles or module-path substrings), got {value!r}")
    return tuple(value)


def inside_classes(site, classes: Sequence[str]) -> bool:
    """Whether the linear of ``site`` lies inside a module whose class is named in ``classes`` (its ``nn_module_stack``,
    the class names compared without their module)."""
    for entry in (site.node.meta.get("nn_module_stack") or {}).values():
        cls = entry[1] if isinstance(entry, tuple) else entry
        name = getattr(cls, "__name__", None) or str(cls).rsplit(".", 1)[-1].rstrip("'>")
        if name in classes:
            return True
    return False


# why select_linears left a linear: the reason's key (a pass's ``skipped_<key>`` count) and its words in a report
SKIP_REASONS = {"quantized_already": "quantized by an earlier pass", "outside_blocks": "outside the repeated blocks",
                "outside_block_classes": "outside the named block classes", "not_included": "not in include=",
                "excluded": "excluded (exclude= / exclude_layers)", "filter_fn": "refused by filter_fn"}


def select_linears(structure, include=None, exclude=DEFAULT_EXCLUDE, filter_fn=None, regional=True,
                   block_classes=None, skipped: Optional[Dict[str, int]] = None,
                   why: Optional[Dict[str, str]] = None) -> List[Any]:
    """The LinearSites that ``include`` / ``exclude`` / ``filter_fn`` accept, graph order: those of the discovered blocks
    (``regional``), of the modules whose class ``block_classes`` names, or every linear (``regional=False``).
    ``skipped``: a dict that receives, per :data:`SKIP_REASONS` key, how many linears were left for that reason
    (the first reason that applies, in the order above); ``why``: one that receives each left linear's path -> key."""
    out = []

    def skip(reason: str) -> None:
        if skipped is not None:
            skipped[reason] = skipped.get(reason, 0) + 1
        if why is not None:
            why[site.module_path] = reason
    for site in structure.linears:
        if site.node.meta.get("dit_quant"):  # quantized already
            skip("quantized_already")
            continue
        if block_classes is not None:
            if not inside_classes(site, block_classes):
                skip("outside_block_classes")
                continue
        elif regional and site.block is None:  # outside the blocks
            skip("outside_blocks")
            continue
        path, role = site.module_path, site.role
        if include is not None and not any(_matches(e, path, role) for e in include):
            skip("not_included")
            continue
        if any(_matches(e, path, role) for e in exclude):
            skip("excluded")
            continue
        if filter_fn is not None and not filter_fn(path, role):
            skip("filter_fn")
            continue
        out.append(site)
    return out
