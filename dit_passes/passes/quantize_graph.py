"""The graph side of the quantize passes (``quantize.py``) and of ``LoadQuantized``: replace the selected linear
nodes by the quantized forms of ``dit_passes.patterns.quant_linear``, hand the replaced weights to the weight ledger
(which releases them in the user's model), and find the tables made on an earlier lowering."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch
import torch.fx as fx

from ..infra.ownership import WeightLedger, refusal
from ..infra.pass_base import Pass, PassError
from ..patterns.quant_linear import replace_linears
from ..quant.forms import QuantForms
from ..quant.signature import tensor_at

__all__ = ["apply_by_kind", "apply_quantized", "releasable_weights", "released_tables"]


def apply_quantized(gm: fx.GraphModule, sites: Sequence[Any], tables: Dict[str, Dict[str, torch.Tensor]],
                    kind: str, ledger: WeightLedger, owner: Pass, forms: QuantForms) -> Dict[str, int]:
    """Replace every site whose module path has a table by the ``kind`` op (the fx patterns of
    ``dit_passes.patterns.quant_linear``) in the forms ``forms`` asks (``owner``'s settings); drop the replaced weights from ``gm``, recorded in ``ledger`` as
    replaced by ``owner`` (the compiled module then releases them in the user's model). Returns counts per
    role and bytes before / after."""
    counts: Dict[str, int] = {}
    bytes_before = bytes_after = 0
    seen = set()
    targets = {}
    how = f"quantized ({kind})"
    for site in sites:
        table = tables.get(site.module_path)
        if table is None:
            continue
        if site.module_path not in seen:
            seen.add(site.module_path)
            for attr in (site.weight, site.bias):
                t = tensor_at(gm, attr) if attr else None
                bytes_before += 0 if t is None else t.numel() * t.element_size()
            bytes_after += sum(t.numel() * t.element_size() for t in table.values())
            if site.bias and "bias" in table:
                # The op's bias buffer takes the original's name (<path>.bias): the same values, so any
                # other reader of that attribute is unaffected; the parameter itself leaves the graph.
                ledger.drop(gm, site.bias, by=owner, how=how, replacement=table["bias"])
        targets[site.node] = (site.module_path, table)
    roles = {site.node: site.role for site in sites}
    for match in replace_linears(gm, kind, targets, forms):
        role = roles[match.nodes_map[match.anchor]]
        counts[f"replaced_{role}"] = counts.get(f"replaced_{role}", 0) + 1
    gm.graph.eliminate_dead_code()
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for site in sites:
        for attr in (site.weight, site.bias):
            if attr and attr not in used and site.module_path in tables:
                table = tables[site.module_path]
                replacement = table if attr == site.weight else table.get("bias")
                ledger.drop(gm, attr, by=owner, how=how, replacement=replacement)
    gm.recompile()
    counts["replaced"] = sum(v for k, v in counts.items() if k.startswith("replaced_"))
    counts["bytes_before"], counts["bytes_after"] = bytes_before, bytes_after
    return counts


def apply_by_kind(gm: fx.GraphModule, sites: Sequence[Any], kinds: Dict[str, str],
                  tables: Dict[str, Dict[str, torch.Tensor]], ledger: WeightLedger, owner: Pass,
                  forms: QuantForms) -> Dict[str, int]:
    """:func:`apply_quantized` once per kind (``kinds``: module path -> kind), the counts summed; ``kind_<kind>``
    counts the linear nodes of each."""
    total: Dict[str, int] = {}
    for kind in dict.fromkeys(kinds[s.module_path] for s in sites):
        counts = apply_quantized(gm, [s for s in sites if kinds[s.module_path] == kind], tables, kind, ledger, owner,
                                 forms)
        for k, v in counts.items():
            total[k] = total.get(k, 0) + v
        total[f"kind_{kind}"] = counts["replaced"]
    return total


def releasable_weights(gm: fx.GraphModule, sites: Sequence[Any]) -> Dict[str, str]:
    """``{module path: weight target}`` of the selected linears whose weight the graph reads only as those linears'
    weight, and no other selected module shares: once its table exists the rewritten graph will not read it, so
    the ledger may release it at once (``WeightLedger.release_now``). The others (a weight also read elsewhere, a
    tied weight) stay until the graph is rewritten."""
    readers: Dict[str, set] = {}
    for site in sites:
        readers.setdefault(site.weight, set()).add(site.node)
    paths_of: Dict[str, set] = {}
    for site in sites:
        paths_of.setdefault(site.weight, set()).add(site.module_path)
    out = {}
    for target, nodes in readers.items():
        if len(paths_of[target]) != 1:
            continue
        gets = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == target]
        if gets and all(user in nodes for n in gets for user in n.users):
            out[next(iter(paths_of[target]))] = target
    return out


def released_tables(ledger: WeightLedger, gm: fx.GraphModule, paths: Sequence[str], owner: Pass
                    ) -> Optional[Dict[str, Dict[str, torch.Tensor]]]:
    """Lowering again after the weights of ``paths`` were released: the tables ``owner`` made then (PassError
    if only some were released, or by another pass / configuration); None when none was released."""
    recs = {p: ledger.released(gm, f"{p}.weight") for p in paths}
    if not any(recs.values()):
        return None
    whole = [p for p, r in recs.items() if r is None]
    if whole:
        some = next(r for r in recs.values() if r is not None)
        raise PassError(refusal(some, f"{owner.name} now also selects {whole[:3]}, whose weights are whole, "
                                      f"and needs the released ones whole again to quantize them alike"))
    return {p: ledger.reuse(r, by=owner) for p, r in recs.items()}
