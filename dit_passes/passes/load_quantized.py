"""LoadQuantized: substitute a saved quantization's tensors into the graph (no calibration).

The rewrite of the quantization passes (``passes/quantize.py``) with the tensors read from their
``serialize_to`` directory instead of prepared now; ``dit_passes.load(model, path)`` builds it with
:meth:`LoadQuantized.from_checkpoint`, which verifies the files against the model before anything is
captured (``dit_passes.quant.loading``).

Requires: ``structure``. Invalidates: ``structure``. Runs before ``dbcache``. Counts: as the quantization
passes (``replaced``, ``replaced_<role>``, ``bytes_before``, ``bytes_after``).

Before / after: see ``passes/quantize.py`` (the same graph change), e.g. for a W4A4 checkpoint::

    q = torch.ops.aten.linear.default(norm_x, w, b)
    ->  q = torch.ops.dit_passes.svdq_w4a4_linear.default(norm_x, qw, ws, ld, lu, si, b)

Each stored linear gets the kind ``config["kind_of"][path]`` when the checkpoint names one (an SVDQuant checkpoint:
its modulation linears ``"w8a16"``, ``"w4a16"`` or ``"w4a16_lr"``), else ``config["kind"]``.

A checkpoint quantized after ``FuseSiblingLinears`` (its signature lists the fused linears' members, its
``config["rank_of"]`` their low-rank branches' ranks) loads with that pass too (``dit_passes.load(model, path,
passes=[FuseSiblingLinears()])``: it runs first, by phase); reads ``fused_linears`` to check the graph fused the same
groups, and refuses a mismatch either way, naming the pass.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.fx as fx

from ..analysis.blocks import get_structure
from ..infra.pass_base import Pass, PassContext, PassError, PassResult
from ..infra.phases import Phase
from ..quant.loading import read_checkpoint
from ..quant.serialize import QuantizedCheckpointError
from ..quant.signature import graph_block_lists, place_tables, quant_signature, tensor_at
from ..quant.forms import DEFAULT_FORMS, QuantForms
from ..quant.w4_lut import lut_storage
from .quantize import QUANT_KINDS
from .quantize_fused import fused_members
from .quantize_graph import apply_by_kind, released_tables


class LoadQuantized(Pass):
    """Substitute stored quantized tensors into the graph (the rewrite of the quantization passes).

    ``tensors``: ``{"<linear path>.<field>": tensor}``; ``config``: the saved config (``kind`` picks the op,
    ``kind_of`` overrides it per linear). Every stored linear must be found as an ``aten.linear`` in the graph.
    """

    name = "load_quantized"
    phase = Phase.QUANTIZE
    reads = ("structure", "fused_linears")
    invalidates = ("structure",)

    def __init__(self, tensors: Dict[str, torch.Tensor], config: Dict[str, Any], source: str = "",
                 forms: QuantForms = DEFAULT_FORMS):
        if not isinstance(forms, QuantForms):
            raise TypeError(f"forms must be a dit_passes.quant.forms.QuantForms, got {type(forms).__name__}")
        self.forms = forms  # how the loaded linears are written (the quantize passes' form settings)
        kind, kind_of = config.get("kind"), config.get("kind_of") or {}
        self.kind, self.config, self.source = kind, dict(config), source
        self.tables: Dict[str, Dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            path, field = name.rsplit(".", 1)
            self.tables.setdefault(path, {})[field] = t
        stray = sorted(set(kind_of) - set(self.tables)) if isinstance(kind_of, dict) else [repr(kind_of)]
        if stray:
            raise QuantizedCheckpointError(f"{source}: config['kind_of'] must map stored linears to kinds; it names "
                                           f"{stray[:5]}; re-quantize")
        self.kinds = {path: kind_of.get(path, kind) for path in self.tables}
        for path, tab in self.tables.items():
            if self.kinds[path] not in QUANT_KINDS:
                raise QuantizedCheckpointError(f"{source}: unknown quantized kind {self.kinds[path]!r} for {path}; "
                                               f"this library writes {sorted(QUANT_KINDS)}")
            missing = [a for a in QUANT_KINDS[self.kinds[path]].tensor_args if a != "bias" and a not in tab]
            if missing:
                raise QuantizedCheckpointError(f"{source}: linear {path} lacks tensors {missing}; re-quantize")
        rank_of = config.get("rank_of") or {}
        if not isinstance(rank_of, dict):
            raise QuantizedCheckpointError(f"{source}: config['rank_of'] must map linears to ranks, got {rank_of!r}")
        for path, rank in rank_of.items():
            got = self.tables.get(path, {}).get("lora_down")
            if got is None or int(got.shape[0]) != rank:
                raise QuantizedCheckpointError(f"{source}: config['rank_of'] gives {path} rank {rank}, its stored "
                                               f"lora_down is {None if got is None else list(got.shape)}; re-quantize")
        self._placed: Dict[Any, Dict[str, Dict[str, torch.Tensor]]] = {}
        self.loads_weights = tuple(f"{p}.weight" for p in self.tables)

    @classmethod
    def from_checkpoint(cls, model: torch.nn.Module, path, quant_type: Optional[str] = None,
                        forms: QuantForms = DEFAULT_FORMS) -> "LoadQuantized":
        """The pass for the checkpoint in directory ``path``, verified against ``model`` (see
        ``dit_passes.quant.loading.read_checkpoint`` for what is checked and raised)."""
        tensors, config, source = read_checkpoint(model, path, quant_type)
        return cls(tensors, config, source=source, forms=forms)

    def config_items(self) -> Dict[str, Any]:
        return {"quant_type": self.config.get("quant_type"), "source": self.source, **self.forms.items()}

    def _on(self, weight: torch.Tensor) -> Dict[str, Dict[str, torch.Tensor]]:
        # One copy per (device, dtype), shared by every signature's graph.
        key = (weight.device, weight.dtype)
        if key not in self._placed:
            self._placed[key] = place_tables(self.tables, weight)
        return self._placed[key]

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        if ctx.frontend != "export":
            raise PassError("loading quantized weights needs compile_dit / dit_passes.load (the export front end)")
        structure = get_structure(gm)
        fused = fused_members(gm, list(self.tables))
        saved = self.config.get("_fused")
        if saved is not None and saved != fused:
            raise PassError(f"{self.source}: the checkpoint was quantized with {len(saved)} fused linear(s) "
                            f"{sorted(saved)[:3]}, this graph fuses {len(fused)} {sorted(fused)[:3]}: load it with "
                            f"the same FuseSiblingLinears as it was quantized with (dit_passes.load(model, path, "
                            f"passes=[FuseSiblingLinears()]) for a fused checkpoint, without it otherwise)")
        # any linear of the graph: a checkpoint of regional=False holds the ones outside the blocks too
        sites = [s for s in structure.linears if s.module_path in self.tables and not s.node.meta.get("dit_quant")]
        found = {s.module_path for s in sites}
        absent = [p for p in self.tables if p not in found]
        if absent:
            raise PassError(f"{self.source}: stored linears not found among the graph's linears: {absent[:5]}")
        ledger = ctx.runtime.weights
        if released_tables(ledger, gm, list(self.tables), self) is None:  # else: released by this pass before
            sig = quant_signature(gm, list(self.tables), graph_block_lists(structure), fused)
            if sig["weights_sha256"] != self.config.get("_weights_sha256", sig["weights_sha256"]):
                raise PassError(f"{self.source}: the model's weights changed since dit_passes.load checked them")
        weight = tensor_at(gm, sites[0].weight)  # device and dtype the stored tensors follow
        placed = self._on(weight)
        # SVDQuant's tables in the LUT form where the device runs it (or form="lut" asks)
        kinds = lut_storage(placed, self.kinds, self.forms.form)
        counts = apply_by_kind(gm, sites, kinds, placed, ledger, self, self.forms)
        ratio = counts["bytes_after"] / max(counts["bytes_before"], 1)
        return PassResult(True, counts, f"{self.config.get('quant_type')} loaded from {self.source}: "
                                        f"{counts['replaced']} linear node(s); {counts['bytes_before']} -> "
                                        f"{counts['bytes_after']} bytes ({ratio:.2f}x)")
