"""Weight ownership: every weight is held once, by whoever runs it (DESIGN.md §14).

Capture aliases the user's parameters as graph attributes. A pass that *replaces* one (tensor parallelism
keeps a shard, quantization a packed table) does so through the :class:`WeightLedger` of the runtime
(``ctx.runtime.weights``): :meth:`WeightLedger.replace` / :meth:`WeightLedger.drop` set or remove the graph
attribute and record what replaced it. After the passes, the compiled module calls :meth:`release_in` on
the user's model: every module slot that still holds a replaced tensor is re-pointed at its replacement
when shape and dtype match (graph and model then share one tensor), else at a meta tensor of the old
shape and dtype. Nothing keeps the old tensor, and ``model.parameters()`` says what is resident. A pass that
makes one replacement at a time (quantization) releases each as soon as it exists (:meth:`release_now`, while the
compiled module lends the ledger the user's model), so preparing never holds the whole model and the whole result.

Lowering again (another input signature, ``set_passes``) captures the model with *stand-ins* in the
released slots (:meth:`stand_ins`: one element broadcast to the full shape, so capture sees the shape and
dtype at no cost); a pass that meets a stand-in (:meth:`released`) takes the recorded replacement back
(:meth:`reuse`, which refuses another pass or configuration), and :meth:`check_graph` refuses a lowered
graph that still reads a stand-in, naming the weight and what to do (reload the model, or keep the
original with ``keep_original=True``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from .pass_base import PassError

STAND_IN = "_dit_passes_stand_in"   # attribute of a stand-in tensor: the target it stands for
RELEASED = "_dit_passes_released"   # attribute of the meta tensor left in the model: (target, note)
SAMPLE = "_dit_passes_sample"       # and its values' fixed sample (weight_sample), so a checkpoint can still be checked
_SAMPLES = 4096
# A sample holds at most one value in this many of its weight: kept on every released weight, a fixed 4096 values
# would hold as much as the small weights themselves (a (32, 32) linear keeps 2 KiB of its 4 KiB), so a model of
# small weights would keep half of what the passes released. Weights of 1M values or more (every linear of a
# production DiT's blocks) take the full 4096 values.
_SAMPLE_FRACTION = 256


def weight_sample(w: torch.Tensor) -> torch.Tensor:
    """A fixed strided sample of ``w``'s values in bf16 bits (int16, CPU): what checkpoint fingerprints hash.
    Kept on a released weight's meta tensor (at most 8 KiB, and at most 1/256 of the weight's values, so at most
    1/256 of its bytes), so loading a checkpoint into the released model checks it."""
    flat = w.detach().reshape(-1)
    n = max(1, min(_SAMPLES, flat.numel() // _SAMPLE_FRACTION))
    step = max(1, flat.numel() // n)
    # clone: for a bf16 weight on the CPU, to() and cpu() return views, which would keep the whole weight alive
    return flat[::step][:n].to(torch.bfloat16).cpu().clone().view(torch.int16)


@dataclasses.dataclass(eq=False)
class Released:
    """One replacement of a weight: what it was, which pass replaced it how, and what holds its values now."""

    target: str                 # attribute path in the captured graph (= the model's module path)
    shape: Tuple[int, ...]      # of the tensor it replaced
    dtype: torch.dtype
    by: str                     # the pass's name
    config: str                 # the pass's describe(): a later lowering must match it to reuse
    how: str                    # "sharded (rank 0 of 2, dim 0)" / "quantized (fp8_per_row)" / ...
    token: Any                  # what else must match (tensor parallelism: dim, segments, rank, size)
    replacement: Any            # the tensor (or per-linear table) that took its place; None once a later
    result: Optional[Tuple[Tuple[int, ...], torch.dtype]] = None  # pass replaced that too: then its shape

    def note(self) -> str:
        return f"{self.how} by {self.config}"


def _owner(root: torch.nn.Module, target: str) -> Tuple[torch.nn.Module, str]:
    *parents, leaf = target.split(".")
    mod = root
    for p in parents:
        mod = getattr(mod, p)
    return mod, leaf


def _slots(model: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Module, Dict[str, Any], str]]:
    """(module path, module, its _parameters or _buffers dict, name) for every tensor slot of ``model``."""
    for path, mod in model.named_modules(remove_duplicate=False):
        for store in (mod._parameters, mod._buffers):
            for name, t in store.items():
                if t is not None:
                    yield path, mod, store, name


def is_stand_in(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, STAND_IN, None) is not None


def stand_in(shape: Sequence[int], dtype: torch.dtype, device: torch.device, mark: Tuple[str, int],
             parameter: bool = True) -> torch.Tensor:
    """One zero broadcast to ``shape`` (no memory), marked as standing for replacement ``mark`` =
    (target, index in its chain)."""
    t = torch.zeros((), dtype=dtype, device=device).expand(tuple(shape))
    t = torch.nn.Parameter(t, requires_grad=False) if parameter else t
    setattr(t, STAND_IN, mark)
    return t


class WeightLedger:
    """What the passes of one compiled module replaced (``runtime.weights``); see the module docstring.

    ``records[target]`` is a chain: tensor parallelism shards a weight, quantization then replaces the shard.
    Only the last link holds its replacement (the earlier ones keep the shape they produced), so the ledger
    never keeps alive what the graph dropped."""

    def __init__(self) -> None:
        self.records: Dict[str, List[Released]] = {}
        self._replaced: Dict[str, "weakref.ref[torch.Tensor]"] = {}  # target -> model's tensor, until release_in
        # where weights on the meta device are read from (compile_dit(weights=...), infra/weight_source.py): a
        # pass replacing such a weight reads only what it keeps (tensor parallelism: its rank's slice)
        self.source: Any = None
        # the user's model while the passes of a lowering run, when the compiled module releases what they replace
        # (keep_original=False): a pass may then release a weight as soon as its replacement exists
        # (release_now), so preparing never holds the whole model and the whole result at once
        self.model: Optional[torch.nn.Module] = None
        self._slot_index: Optional[Dict[int, List[Tuple[Dict[str, Any], str]]]] = None
        self.released_now = 0  # weights release_now has released (a failing lowering names how many)

    # -- passes ---------------------------------------------------------------------------------
    def replace(self, gm: torch.nn.Module, target: str, new: torch.Tensor, *, by: Any, how: str,
                token: Any = None) -> None:
        """Set ``gm``'s attribute ``target`` to ``new`` (a Parameter where the old one was) and record it."""
        owner, leaf = _owner(gm, target)
        old = getattr(owner, leaf)
        if leaf in owner._parameters:
            new = new if isinstance(new, torch.nn.Parameter) else torch.nn.Parameter(new, requires_grad=False)
            owner._parameters[leaf] = new
        else:
            owner._buffers[leaf] = new
        self._record(target, old, by, how, token, new)

    def drop(self, gm: torch.nn.Module, target: str, *, by: Any, how: str, replacement: Any) -> None:
        """Remove ``gm``'s attribute ``target`` (the graph no longer reads it) and record what replaced it."""
        try:
            owner, leaf = _owner(gm, target)
        except AttributeError:
            return
        old = owner._parameters.pop(leaf, None)
        old = owner._buffers.pop(leaf, None) if old is None else old
        if old is not None:
            self._record(target, old, by, how, None, replacement)

    def _record(self, target: str, old: torch.Tensor, by: Any, how: str, token: Any, replacement: Any) -> None:
        if is_stand_in(old):  # lowering again: the chain was recorded the first time
            return
        rec = Released(target, tuple(old.shape), old.dtype, by.name, by.describe(), how, token, replacement)
        chain = self.records.get(target, [])
        link = next((i for i, r in enumerate(chain) if r.replacement is old), None)
        if link is None:  # the model's own tensor: a new chain
            self.records[target] = [rec]
            self._replaced[target] = weakref.ref(old)
            return
        chain[link].replacement, chain[link].result = None, (tuple(old.shape), old.dtype)
        self.records[target] = chain[:link + 1] + [rec]

    def release_now(self, gm: torch.nn.Module, target: str, replacement: Any, *, by: Any, how: str) -> bool:
        """Replace ``gm``'s weight ``target`` by a stand-in of its shape now, record ``replacement`` as what holds
        its values, and re-point the user's model's slots holding it as :meth:`release_in` does (a meta tensor
        that says what replaced it): nothing of ours keeps the old tensor from here on. For a pass that makes
        one weight's replacement at a time and rewrites the graph only after the last (quantization): the
        graph's node still reads ``target`` (the stand-in: shape and dtype, no values) until then, when the pass
        drops it. Returns False (nothing done) when the compiled module keeps the original (``model`` unset) or
        ``target`` is already a stand-in (lowering again); the weight is then released at the end as before."""
        if self.model is None:
            return False
        owner, leaf = _owner(gm, target)
        old = getattr(owner, leaf)
        if not isinstance(old, torch.Tensor) or is_stand_in(old) or old.is_meta:
            return False
        self._record(target, old, by, how, None, replacement)
        chain = self.records[target]
        index = len(chain) - 1
        store = owner._parameters if leaf in owner._parameters else owner._buffers
        store[leaf] = stand_in(old.shape, old.dtype, old.device, (target, index), leaf in owner._parameters)
        if index == 0:  # the model's own tensor (a later link replaced a pass's tensor, which the model never held)
            if self._slot_index is None:
                self._slot_index = {}
                for _, _, slots, name in _slots(self.model):
                    self._slot_index.setdefault(id(slots[name]), []).append((slots, name))
            for slots, name in self._slot_index.pop(id(old), []):
                if slots[name] is old:
                    slots[name] = _left_in_model(old, chain)
            self._replaced.pop(target, None)
        self.released_now += 1
        return True

    def released(self, gm: torch.nn.Module, target: str) -> Optional[Released]:
        """The replacement recorded for ``target`` when ``gm`` holds a stand-in there (its weight was
        released), else None."""
        try:
            owner, leaf = _owner(gm, target)
        except AttributeError:
            return None
        t = getattr(owner, leaf, None)
        if not is_stand_in(t):
            return None
        name, index = getattr(t, STAND_IN)
        return None if isinstance(index, str) else self.records[name][index]  # str: another module released it

    def reuse(self, rec: Released, *, by: Any, token: Any = None, like: Optional[torch.Tensor] = None) -> Any:
        """What ``rec`` recorded, for pass ``by`` lowering again (PassError unless the same pass with the same
        configuration and ``token`` made it): the replacement, following ``like``'s device and dtype, or a
        stand-in of its shape when a later pass replaced it in turn."""
        if rec.by != by.name or rec.config != by.describe() or rec.token != token:
            now = by.describe() + ("" if token is None else f" (needs {token}, recorded {rec.token})")
            raise PassError(refusal(rec, f"{now} cannot rebuild it from the replacement"))
        if rec.replacement is None:
            index = next(i for i, r in enumerate(self.records[rec.target]) if r is rec)
            shape, dtype = rec.result
            return stand_in(shape, dtype, like.device if like is not None else torch.device("cpu"),
                            (rec.target, index + 1))
        out = rec.replacement
        if like is not None and isinstance(out, torch.Tensor) and (out.device, out.dtype) != (like.device, like.dtype):
            out = rec.replacement = torch.nn.Parameter(out.detach().to(like.device, like.dtype), requires_grad=False)
        return out

    # -- the compiled module ----------------------------------------------------------------------
    def released_weights(self) -> Dict[str, str]:
        """``{target: how}`` for the weights whose values only a replacement of another shape or dtype holds
        (the model keeps a meta tensor for them once released)."""
        out = {}
        for target, chain in self.records.items():
            last, first = chain[-1].replacement, chain[0]
            if isinstance(last, torch.Tensor) and tuple(last.shape) == first.shape and last.dtype == first.dtype:
                continue  # the model is re-pointed at the replacement itself: nothing released
            out[target] = " then ".join(r.note() for r in chain)
        return out

    def release_in(self, model: torch.nn.Module) -> int:
        """Re-point every slot of ``model`` holding a replaced tensor (see the module docstring); returns
        how many slots changed."""
        pending = {}
        for target, ref in self._replaced.items():
            old = ref()
            if old is not None:
                pending[id(old)] = (old, self.records[target])  # the chain: its last link holds the values
        self._replaced.clear()
        self._slot_index = None
        changed = 0
        for _, _, store, name in list(_slots(model)):
            hit = pending.get(id(store[name]))
            if hit is None:
                continue
            old, chain = hit
            store[name] = _left_in_model(old, chain)
            changed += 1
        return changed

    @contextlib.contextmanager
    def stand_ins(self, model: torch.nn.Module, loaded: Iterable[str] = ()) -> Iterator[int]:
        """While lowering again: each released (meta) slot of ``model`` holds a stand-in of its shape and
        dtype on the model's device; the meta tensors are put back afterwards. Yields how many. A slot another
        compiled module released gets one only if it is in ``loaded`` (targets a pass of this lowering replaces
        from stored values without reading the old ones, as LoadQuantized does): any other pass would compute
        from the stand-in's zeros, so that is refused."""
        loaded = set(loaded)
        device = next((t.device for _, _, s, n in _slots(model) for t in (s[n],) if not t.is_meta),
                      torch.device("cpu"))
        swapped: List[Tuple[Dict[str, Any], str, torch.Tensor]] = []
        for path, _, store, name in _slots(model):
            meta = store[name]
            mark = getattr(meta, RELEASED, None) if meta.is_meta else None
            if mark is None:
                continue
            target, note = mark
            if target not in self.records and target not in loaded:
                raise RuntimeError(f"{path + '.' if path else ''}{name} was released ({note}) by another compiled "
                                   f"module. {_GONE}")
            index = 0 if target in self.records else note  # str: released by another module, loaded here
            swapped.append((store, name, meta))
            store[name] = stand_in(meta.shape, meta.dtype, device, (target, index),
                                   isinstance(meta, torch.nn.Parameter))
            setattr(store[name], SAMPLE, getattr(meta, SAMPLE, None))  # a checkpoint check still sees its values
        try:
            yield len(swapped)
        finally:
            for store, name, meta in swapped:
                store[name] = meta

    def check_graph(self, gm: torch.nn.Module, passes: str) -> None:
        """PassError if the lowered ``gm`` (or a subgraph) still reads a stand-in: its passes needed a
        released weight whole."""
        for mod in gm.modules():
            graph = getattr(mod, "graph", None)
            for n in getattr(graph, "nodes", ()):
                if n.op != "get_attr":
                    continue
                owner, leaf = _owner(mod, n.target)
                t = getattr(owner, leaf, None)
                if is_stand_in(t):
                    name, index = getattr(t, STAND_IN)
                    why = f"the passes of this lowering ({passes}) read it whole"
                    if isinstance(index, str):  # released by another compiled module: only its note is known
                        raise PassError(f"{name} was released when it was {index} by another compiled module; "
                                        f"{why}. {_GONE}")
                    raise PassError(refusal(self.records[name][index], why))


def _left_in_model(old: torch.Tensor, chain: List[Released]) -> torch.Tensor:
    """What a model slot that held ``old`` holds once ``chain`` replaced it: the replacement itself when it has
    ``old``'s shape and dtype (graph and model share it), else a meta tensor marked with what replaced it and
    a sample of ``old``'s values (a checkpoint loaded into the model is still checked)."""
    rec, new = chain[0], chain[-1].replacement
    if not (isinstance(new, torch.Tensor) and new.shape == old.shape and new.dtype == old.dtype):
        new = torch.empty(old.shape, dtype=old.dtype, device="meta")
        if isinstance(old, torch.nn.Parameter):
            new = torch.nn.Parameter(new, requires_grad=False)
        setattr(new, RELEASED, (rec.target, rec.note()))
        if not old.is_meta:  # a shape-only (meta) lowering has no values to sample
            setattr(new, SAMPLE, weight_sample(old))
    elif isinstance(old, torch.nn.Parameter) and not isinstance(new, torch.nn.Parameter):
        new = torch.nn.Parameter(new, requires_grad=False)
    return new


# what to do about a weight whose values a pass released (another module's: only its note is known)
_GONE = ("Its full values are gone from this process: reload the model and compile it again, or compile with "
         "keep_original=True to keep a full copy")


def refusal(rec: Released, why: str) -> str:
    """The message for a released weight that is needed whole (or rebuilt differently) again."""
    return (f"{rec.target} {list(rec.shape)} {str(rec.dtype).replace('torch.', '')} was released when it was "
            f"{rec.note()}; {why}. Its full values are gone from this process: reload the model "
            f"(from_pretrained / load_state_dict) and compile it again, or pass keep_original=True to compile_dit / "
            f"enable_cache to keep a full copy (memory: the whole model besides what the passes made)")


__all__ = ["WeightLedger", "Released", "is_stand_in", "stand_in", "refusal", "STAND_IN", "RELEASED", "SAMPLE",
           "weight_sample"]
