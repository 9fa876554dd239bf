"""Getting a pipeline or transformer from the driver into Ray workers without pickling its weights.

Three paths (``RayLauncher.launch(..., transfer=...)``):

* ``"object_store"`` (default): :func:`pack_for_object_store` splits the object into a small
  *skeleton* (pickle bytes) and a dict of flat ``uint8`` numpy arrays, one per tensor, which the
  driver ``ray.put``\\ s once. Diffusers models whose config rebuilds them exactly travel as
  ``(class, config, {state-dict name: array key})``: the worker builds them with
  ``type(model).from_config(model.config)`` on the meta device and ``load_state_dict(..., assign=True)``.
  Anything else (pipelines' schedulers and tokenizers, text encoders, custom modules, diffusers models
  that were modified after construction) is pickled as an object with each tensor replaced by its
  array key. :func:`unpack_from_object_store` reverses it; on a CPU worker the tensors are views of the
  read-only numpy arrays Ray maps from its shared-memory store, so N workers on one node hold one copy
  of the weights (the store's), not N.
* ``"snapshot"``: ``save_pretrained`` (safetensors) into a temporary directory, ``from_pretrained`` in
  the workers (the directory must be visible to every worker node).
* ``"factory"``: a zero-argument callable, cloudpickled, that each worker calls to build its own copy.

Contract of the object-store path: the weights a CPU worker holds alias the shared store; they are
read-only (inference). A pass or user code that writes weights in place needs ``copy_weights=True``.
"""
from __future__ import annotations

import dataclasses
import io
import pickle
import tempfile
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

__all__ = ["TransferError", "Packed", "pack_for_object_store", "unpack_from_object_store", "save_snapshot",
           "load_snapshot", "check_factory"]


class TransferError(RuntimeError):
    """The object cannot travel by the requested transfer path (the message says which to use instead)."""


def _cloudpickle():
    from ray import cloudpickle  # the Pickler Ray itself uses: functions / lambdas by value
    return cloudpickle


# ---------------------------------------------------------------------------------------- tensors
def _tensor_to_array(t: torch.Tensor, what: str) -> Tuple[np.ndarray, Tuple[str, Tuple[int, ...]]]:
    """A tensor as a flat uint8 array (any dtype, bf16 included) plus (dtype name, shape) to undo it."""
    if t.is_meta:
        raise TransferError(f"{what} is on the meta device (no data to send): load the weights first, or use "
                            "transfer='factory' to build the model inside the workers")
    if t.layout != torch.strided or t.is_quantized:
        raise TransferError(f"{what} has layout {t.layout} (quantized={t.is_quantized}); the object store path "
                            "sends dense tensors only: use transfer='factory'")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy(), (str(flat.dtype).removeprefix("torch."), tuple(t.shape))


def _array_to_tensor(arr: np.ndarray, dtype_name: str, shape: Tuple[int, ...], copy: bool) -> torch.Tensor:
    with warnings.catch_warnings():
        # Ray hands out read-only views of its shared store; writing would be a bug (see module docstring)
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        flat = torch.from_numpy(arr)
    if copy:
        flat = flat.clone()
    return flat.view(getattr(torch, dtype_name)).reshape(shape)


# ----------------------------------------------------------------------------- diffusers by config
def _hooked(model: torch.nn.Module) -> bool:
    # diffusers creates an empty HookRegistry on the first cache_context(); only registered hooks count
    return any(m._forward_hooks or m._forward_pre_hooks or getattr(getattr(m, "_diffusers_hook", None), "hooks", None)
               for m in model.modules())


def config_rebuild_problem(model: torch.nn.Module) -> Optional[str]:
    """Why ``type(model).from_config(model.config)`` would not rebuild ``model`` exactly (None: it would).

    Builds the skeleton on the meta device (no memory) and compares module types, parameter / buffer
    names and shapes, and attention processors; hooks are not part of a config either.
    """
    try:
        from diffusers import ModelMixin
    except ImportError:
        return "diffusers is not installed"
    if not isinstance(model, ModelMixin) or not hasattr(model, "config"):
        return f"{type(model).__name__} is not a diffusers ModelMixin"
    if _hooked(model):
        return "it has forward hooks, which a config does not record"
    try:
        with torch.device("meta"):
            skeleton = type(model).from_config(dict(model.config))
    except Exception as exc:  # noqa: BLE001 - any failure means: send the object instead
        return f"from_config on the meta device failed: {type(exc).__name__}: {exc}"
    if [(n, type(m)) for n, m in skeleton.named_modules()] != [(n, type(m)) for n, m in model.named_modules()]:
        return "its module tree differs from a fresh from_config build (modified after construction)"
    for kind in ("named_parameters", "named_buffers"):
        a = [(n, tuple(t.shape)) for n, t in getattr(skeleton, kind)()]
        b = [(n, tuple(t.shape)) for n, t in getattr(model, kind)()]
        if a != b:
            return f"its {kind[6:]} differ from a fresh from_config build"
    if hasattr(model, "attn_processors"):
        if {k: type(v) for k, v in skeleton.attn_processors.items()} != \
                {k: type(v) for k, v in model.attn_processors.items()}:
            return "its attention processors differ from the defaults"
    return None


def _non_persistent_buffers(model: torch.nn.Module) -> List[str]:
    names = []
    for mod_name, mod in model.named_modules():
        for b in mod._non_persistent_buffers_set:
            if mod._buffers.get(b) is not None:
                names.append(f"{mod_name}.{b}" if mod_name else b)
    return names


# ------------------------------------------------------------------------------------ object store
@dataclasses.dataclass
class Packed:
    """What the driver sends: ``skeleton`` (pickle bytes) and ``arrays`` (put in the object store)."""

    skeleton: bytes
    arrays: Dict[str, np.ndarray]
    strategies: Dict[str, str]  # object path -> "config" / "pickled" (+ reason), for the transfer report

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def _make_pickler(buffer: io.BytesIO, arrays: Dict[str, np.ndarray], strategies: Dict[str, str],
                  by_config: bool):
    cloudpickle = _cloudpickle()

    class SkeletonPickler(cloudpickle.Pickler):
        """Pickles the object graph with every dense tensor (and config-rebuildable diffusers model)
        replaced by a persistent id; the data go to ``arrays``."""

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            # The same object reached twice must come back as one object (tied weights): persistent ids
            # are not memoised by pickle, so keep our own (holding the objects keeps their ids unique);
            # the unpickler memoises by the id's key.
            self.seen: Dict[int, Tuple[Any, Any]] = {}

        def _add(self, t: torch.Tensor, what: str) -> Tuple[str, str, Tuple[int, ...]]:
            key = f"t{len(arrays)}"
            arr, (dtype, shape) = _tensor_to_array(t, what)
            arrays[key] = arr
            return key, dtype, shape

        def persistent_id(self, obj: Any):  # noqa: D401 - pickle protocol hook
            cls = type(obj)
            if cls is torch.nn.Parameter or cls is torch.Tensor or isinstance(obj, torch.nn.Module):
                hit = self.seen.get(id(obj))
                if hit is not None:
                    return hit[1]
                pid = self._persistent_id(obj, cls)
                self.seen[id(obj)] = (obj, pid)
                return pid
            return None

        def _persistent_id(self, obj: Any, cls: type):
            if cls is torch.nn.Parameter or cls is torch.Tensor:
                key, dtype, shape = self._add(obj, f"a tensor of shape {tuple(obj.shape)}")
                return ("tensor", key, dtype, shape, cls is torch.nn.Parameter, obj.requires_grad)
            if by_config and isinstance(obj, torch.nn.Module) and hasattr(obj, "config"):
                name = type(obj).__name__
                problem = config_rebuild_problem(obj)
                if problem is None:
                    state = {n: self._add(t, f"{name}.{n}") for n, t in obj.state_dict(keep_vars=True).items()}
                    buffers = {n: self._add(obj.get_buffer(n), f"{name}.{n}") for n in _non_persistent_buffers(obj)}
                    training = {n: m.training for n, m in obj.named_modules()}
                    strategies[f"{name}@{len(strategies)}"] = "config"
                    return ("config_model", f"m{len(self.seen)}", type(obj), dict(obj.config), state, buffers,
                            training)
                if "not a diffusers ModelMixin" not in problem:
                    strategies[f"{name}@{len(strategies)}"] = f"pickled ({problem})"
            return None

    return SkeletonPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)


def pack_for_object_store(obj: Any, by_config: bool = True) -> Packed:
    """Split ``obj`` (a pipeline, a transformer, any picklable object holding tensors) into skeleton + arrays.

    ``by_config=False`` pickles diffusers models as objects too (no from_config rebuild).
    """
    arrays: Dict[str, np.ndarray] = {}
    strategies: Dict[str, str] = {}
    buffer = io.BytesIO()
    try:
        _make_pickler(buffer, arrays, strategies, by_config).dump(obj)
    except TransferError:
        raise
    except Exception as exc:  # noqa: BLE001 - name the failing object, suggest the other paths
        raise TransferError(f"cannot send {type(obj).__name__} through the object store: {type(exc).__name__}: "
                            f"{exc}. Use transfer='factory' (build it inside each worker) or 'snapshot'") from exc
    return Packed(buffer.getvalue(), arrays, strategies)


class _SkeletonUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, arrays: Dict[str, np.ndarray], copy: bool):
        super().__init__(io.BytesIO(data))
        self._arrays = arrays
        self._copy = copy
        self._loaded: Dict[str, Any] = {}  # pid key -> object: one object per id, however often it appears

    def _tensor(self, key: str, dtype: str, shape: Tuple[int, ...]) -> torch.Tensor:
        return _array_to_tensor(self._arrays[key], dtype, shape, self._copy)

    def persistent_load(self, pid: Any) -> Any:
        key = pid[1]
        if key not in self._loaded:
            self._loaded[key] = self._load(pid)
        return self._loaded[key]

    def _load(self, pid: Any) -> Any:
        kind = pid[0]
        if kind == "tensor":
            _, key, dtype, shape, is_param, requires_grad = pid
            t = self._tensor(key, dtype, shape)
            return torch.nn.Parameter(t, requires_grad=requires_grad) if is_param else t.requires_grad_(requires_grad)
        if kind == "config_model":
            _, _, cls, config, state, buffers, training = pid
            with torch.device("meta"):
                model = cls.from_config(config)
            model.load_state_dict({n: self._tensor(*spec) for n, spec in state.items()}, strict=True, assign=True)
            for name, spec in buffers.items():
                owner, _, leaf = name.rpartition(".")
                model.get_submodule(owner)._buffers[leaf] = self._tensor(*spec)
            left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
            if left:
                raise TransferError(f"{cls.__name__} rebuilt from its config kept meta tensors {left[:5]}: "
                                    "use transfer='snapshot' or 'factory'")
            for name, mod in model.named_modules():
                mod.training = training.get(name, mod.training)
            return model
        raise pickle.UnpicklingError(f"unknown persistent id kind {kind!r}")


def unpack_from_object_store(skeleton: bytes, arrays: Dict[str, np.ndarray], copy_weights: bool = False) -> Any:
    """Rebuild what :func:`pack_for_object_store` split; tensors alias ``arrays`` unless ``copy_weights``."""
    return _SkeletonUnpickler(skeleton, arrays, copy_weights).load()


# ---------------------------------------------------------------------------------------- snapshot
def _module_dtypes(obj: Any) -> Any:
    if isinstance(obj, torch.nn.Module):
        p = next(obj.parameters(), None)
        return p.dtype if p is not None else None
    components = getattr(obj, "components", None) or {}
    dtypes = {}
    for name, comp in components.items():
        if isinstance(comp, torch.nn.Module):
            p = next(comp.parameters(), None)
            if p is not None:
                dtypes[name] = p.dtype
    return dtypes or None


def save_snapshot(obj: Any) -> Tuple[tempfile.TemporaryDirectory, Tuple[type, str, Any]]:
    """``save_pretrained`` (safetensors) to a fresh temporary directory; returns it and the load spec."""
    if not hasattr(obj, "save_pretrained") or not hasattr(type(obj), "from_pretrained"):
        raise TransferError(f"transfer='snapshot' needs save_pretrained/from_pretrained, which "
                            f"{type(obj).__name__} lacks: use transfer='object_store' or 'factory'")
    tmp = tempfile.TemporaryDirectory(prefix="dit_passes_snapshot_")
    obj.save_pretrained(tmp.name, safe_serialization=True)
    # A pipeline's absent components (text_encoder=None) are not saved; from_pretrained needs them named
    absent = [n for n, c in (getattr(obj, "components", None) or {}).items() if c is None]
    return tmp, (type(obj), tmp.name, _module_dtypes(obj), absent)


def load_snapshot(cls: type, path: str, dtypes: Any, absent: List[str]) -> Any:
    kwargs: Dict[str, Any] = {name: None for name in absent}
    if dtypes is not None:
        # diffusers renamed torch_dtype to dtype (the old name warns); older releases know only torch_dtype
        import diffusers.utils.deprecation_utils as deprecation_utils
        kwargs["dtype" if hasattr(deprecation_utils, "_resolve_dtype") else "torch_dtype"] = dtypes
    return cls.from_pretrained(path, **kwargs)


# ----------------------------------------------------------------------------------------- factory
def check_factory(fn: Callable[[], Any], warn_bytes: int = 64 << 20) -> bytes:
    """Cloudpickle a zero-argument factory now (a clear error here, not in every worker)."""
    import inspect
    try:
        required = [p for p in inspect.signature(fn).parameters.values()
                    if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        required = []
    if required:
        raise TransferError(f"the factory must take no arguments; {getattr(fn, '__name__', fn)!r} needs "
                            f"{[p.name for p in required]}")
    try:
        data = _cloudpickle().dumps(fn)
    except Exception as exc:  # noqa: BLE001
        raise TransferError(f"the factory {fn!r} cannot be cloudpickled ({type(exc).__name__}: {exc}); define it "
                            "at module level and capture only paths / small values") from exc
    if len(data) > warn_bytes:
        warnings.warn(f"the factory pickles to {len(data) >> 20} MiB: it captures large objects (a model?) in its "
                      "closure; capture a path and load inside the factory instead", stacklevel=3)
    return data
