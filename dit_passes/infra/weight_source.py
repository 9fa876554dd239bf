"""Weights read from a checkpoint while lowering, for a model built on the meta device.

A FLUX-size transformer does not fit whole on each rank of a tensor-parallel group, nor twice on one GPU while it
is quantized. So the model may be built without its weights (``with torch.device("meta"): model = cls(**config)``)
and compiled with a checkpoint::

    compiled = compile_dit(model, passes=[passes.TensorParallel(2)], weights="transformer/", device="cuda")

:class:`SafetensorsWeights` reads tensors, or slices of them (``safe_open(...).get_slice(name)[...]``: only the
slice's bytes are read from the file), onto a device, and counts the bytes it read per name (``bytes_read``).

While lowering, :func:`source_stand_ins` puts a *stand-in* in every meta slot of the model (one element broadcast
to the full shape on the target device: capture sees shape, dtype and device at no cost), marked with the name
to read. A pass that replaces a weight reads just what it keeps from the source (tensor parallelism: its rank's
slice, quantization one weight at a time); the implicit :class:`~dit_passes.passes.load_weights.LoadWeights`
pass then reads the rest whole. On
exit the model's slots hold what the graph holds (a loaded weight is shared, not copied) or a meta tensor for
what a pass replaced (see :mod:`dit_passes.infra.ownership`), never a stand-in.
"""
from __future__ import annotations

import contextlib
import glob
import os
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from .ownership import RELEASED, SAMPLE, WeightLedger

FROM_SOURCE = "_dit_passes_from_source"  # attribute of a stand-in: the checkpoint name it stands for


class WeightSourceError(ValueError):
    """A weight the lowering needs is missing from the checkpoint, or has another shape there."""


class SafetensorsWeights:
    """The tensors of one or more ``.safetensors`` files (a directory: every such file in it), read on demand.

    ``bytes_read[name]``: the bytes read from the files for ``name`` so far (a slice counts its own bytes)."""

    def __init__(self, paths: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]):
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        files: List[str] = []
        for p in map(os.fspath, paths):
            found = sorted(glob.glob(os.path.join(p, "*.safetensors"))) if os.path.isdir(p) else [p]
            if not found or not all(os.path.isfile(f) for f in found):
                raise FileNotFoundError(f"weights={p!r}: no safetensors file there (pass a .safetensors file, a "
                                        f"list of them, or a directory holding them)")
            files += found
        from safetensors import safe_open
        self.files = files
        self._index: Dict[str, Tuple[str, Tuple[int, ...]]] = {}  # name -> (file, shape)
        for f in files:
            with safe_open(f, framework="pt") as handle:
                for name in handle.keys():
                    self._index[name] = (f, tuple(handle.get_slice(name).get_shape()))
        self.bytes_read: Dict[str, int] = {}

    def __repr__(self) -> str:
        return f"SafetensorsWeights({len(self._index)} tensors in {len(self.files)} file(s))"

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def names(self) -> List[str]:
        return list(self._index)

    def shape(self, name: str) -> Tuple[int, ...]:
        return self._index[name][1]

    @property
    def total_bytes_read(self) -> int:
        return sum(self.bytes_read.values())

    def read(self, name: str, index: Optional[Tuple[slice, ...]] = None, *, dtype: Optional[torch.dtype] = None,
             device: Union[str, torch.device, None] = None) -> torch.Tensor:
        """``name`` (``index``: the slices to read, one per leading dim) as ``dtype`` on ``device``."""
        from safetensors import safe_open
        with safe_open(self._index[name][0], framework="pt") as handle:
            t = handle.get_tensor(name) if index is None else handle.get_slice(name)[index]
        self.bytes_read[name] = self.bytes_read.get(name, 0) + t.numel() * t.element_size()
        return t.to(device=device, dtype=dtype)

    def read_narrow(self, name: str, dim: int, start: int, length: int, **to: Any) -> torch.Tensor:
        """``name.narrow(dim, start, length)``, reading only those bytes."""
        index = tuple(slice(None) for _ in range(dim)) + (slice(start, start + length),)
        return self.read(name, index, **to)


def as_weight_source(weights: Any) -> Optional[SafetensorsWeights]:
    """``compile_dit(weights=...)``: None, a source, or a path / list of paths of safetensors files."""
    if weights is None or hasattr(weights, "read_narrow"):
        return weights
    if isinstance(weights, (str, os.PathLike)) or (isinstance(weights, (list, tuple))
                                                   and all(isinstance(p, (str, os.PathLike)) for p in weights)):
        return SafetensorsWeights(weights)
    raise TypeError(f"weights= takes a safetensors path, a list of them or a SafetensorsWeights, got "
                    f"{type(weights).__name__}")


def source_name(t: Any) -> Optional[str]:
    """The checkpoint name a stand-in reads from, or None for any other value."""
    return getattr(t, FROM_SOURCE, None) if isinstance(t, torch.Tensor) else None


def check_shape(source: SafetensorsWeights, name: str, expected: Sequence[int], what: str) -> None:
    """WeightSourceError unless the checkpoint holds ``name`` with shape ``expected`` (``what`` reads it)."""
    if name not in source:
        raise WeightSourceError(f"{what}: the checkpoint ({source}) has no tensor {name!r} (expected shape "
                                f"{list(expected)}); pass weights= the checkpoint of this model (its state_dict "
                                f"names), or load this weight into the model before compiling")
    found = source.shape(name)
    if tuple(found) != tuple(expected):
        raise WeightSourceError(f"{what}: the checkpoint's {name!r} has shape {list(found)}, the model expects "
                                f"{list(expected)}; the checkpoint is of another configuration: build the model with "
                                f"the checkpoint's config (config.json), or pass the matching checkpoint")


def read_whole(source: Optional[SafetensorsWeights], t: Optional[torch.Tensor], what: str) -> Optional[torch.Tensor]:
    """``t``'s values: a stand-in's read whole from the checkpoint (its shape checked first, ``what`` reads it), any
    other value returned as it is."""
    name = source_name(t)
    if name is None:
        return t
    check_shape(source, name, t.shape, what)
    return source.read(name, dtype=t.dtype, device=t.device)


def _meta_slots(model: torch.nn.Module) -> Iterator[Tuple[str, Dict[str, Any], str, torch.Tensor]]:
    seen = set()
    for path, mod in model.named_modules(remove_duplicate=False):
        for store in (mod._parameters, mod._buffers):
            for name, t in store.items():
                if t is not None and t.is_meta and getattr(t, RELEASED, None) is None and (id(store), name) not in seen:
                    seen.add((id(store), name))
                    yield f"{path}.{name}" if path else name, store, name, t


def meta_weights(model: torch.nn.Module) -> List[str]:
    """The model's parameters and buffers on the meta device that no pass released: they need a source."""
    return [target for target, *_ in _meta_slots(model)]


def check_has_source(model: torch.nn.Module, source: Optional[SafetensorsWeights], inputs: Iterable[Any]) -> None:
    """A model with meta weights runs on real inputs only with a source to read them from."""
    if source is not None or not any(isinstance(x, torch.Tensor) and not x.is_meta for x in inputs):
        return  # meta inputs: a shape-only dry run (memory planning) is fine without values
    missing = meta_weights(model)
    if missing:
        raise WeightSourceError(f"{len(missing)} weight(s) of {type(model).__name__} are on the meta device (e.g. "
                                f"{missing[0]}) and there is no checkpoint to read them from: pass weights=<the "
                                f"safetensors file(s) or directory> (and device=) to compile_dit, or load the "
                                f"weights first (model.load_state_dict(..., assign=True) / from_pretrained)")


@contextlib.contextmanager
def source_stand_ins(model: torch.nn.Module, source: Optional[SafetensorsWeights], device: torch.device,
                     loaded: Dict[str, torch.Tensor], ledger: WeightLedger) -> Iterator[int]:
    """While lowering with a source: every meta slot of ``model`` holds a stand-in on ``device`` (see the module
    docstring). On exit a slot gets ``loaded[target]`` (what LoadWeights read: the graph's tensor itself), or, when
    a pass replaced the weight (``ledger``), a meta tensor marked released; otherwise its meta tensor back."""
    swapped = []
    if source is not None:
        for target, store, name, meta in list(_meta_slots(model)):
            t = torch.zeros((), dtype=meta.dtype, device=device).expand(tuple(meta.shape))
            t = torch.nn.Parameter(t, requires_grad=False) if isinstance(meta, torch.nn.Parameter) else t
            setattr(t, FROM_SOURCE, target)
            swapped.append((target, store, name, meta))
            store[name] = t
    try:
        yield len(swapped)
    finally:
        for target, store, name, meta in swapped:
            new, chain = loaded.get(target), ledger.records.get(target)
            if new is not None:
                if isinstance(meta, torch.nn.Parameter) and not isinstance(new, torch.nn.Parameter):
                    new = torch.nn.Parameter(new, requires_grad=False)
                store[name] = new
            elif chain:  # a pass replaced it: as ownership.release_in re-points a slot
                last = chain[-1].replacement
                if isinstance(last, torch.Tensor) and last.shape == meta.shape and last.dtype == meta.dtype:
                    store[name] = torch.nn.Parameter(last, requires_grad=False) if isinstance(
                        meta, torch.nn.Parameter) and not isinstance(last, torch.nn.Parameter) else last
                else:
                    setattr(meta, RELEASED, (target, chain[0].note()))
                    setattr(meta, SAMPLE, getattr(store[name], SAMPLE, None))  # quantization's fingerprint of it
                    store[name] = meta
            else:
                store[name] = meta


__all__ = ["SafetensorsWeights", "WeightSourceError", "as_weight_source", "source_name", "check_shape",
           "meta_weights", "check_has_source", "source_stand_ins", "FROM_SOURCE"]
