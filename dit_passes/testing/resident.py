"""Count the tensor storages reachable from Python objects (tests and benchmarks of weight ownership).

Independent of :meth:`CompiledDiT.memory_report`: it follows every Python reference (``gc.get_referents``)
from the given roots, not the library's own idea of where tensors live, so a copy hidden in a cache, a pass
object or a closure is found too. Modules and classes are not entered, nor a function's globals unless
``exec`` made it (they reach the whole interpreter); fake and meta tensors hold no memory and are skipped.
"""
from __future__ import annotations

import gc
import types
from typing import Dict, Iterable, Tuple

import torch

_OPAQUE = (types.ModuleType, type, types.BuiltinFunctionType, types.CodeType, types.FrameType)


def reachable_storages(*roots: object) -> Dict[Tuple[str, int], int]:
    """``{(device, data_ptr): nbytes}`` of the distinct real tensor storages reachable from ``roots``."""
    from torch._subclasses.fake_tensor import FakeTensor

    seen, out = set(), {}
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):  # its closure and defaults; globals only of exec'd code
            exec_globals = [obj.__globals__] if "__name__" not in obj.__globals__ else []
            stack.extend([*(obj.__closure__ or ()), *(obj.__defaults__ or ()), *exec_globals])
            continue
        if isinstance(obj, torch.Tensor):
            if isinstance(obj, FakeTensor) or obj.is_meta:
                continue
            st = obj.untyped_storage()
            out[(str(obj.device), st.data_ptr())] = st.nbytes()
            # a Parameter's Python attributes (and a subclass's) can hold more tensors
            stack.extend(getattr(obj, "__dict__", {}).values())
            continue
        stack.extend(gc.get_referents(obj))
    return out


def resident_bytes(*roots: object) -> int:
    """Bytes of the distinct real tensor storages reachable from ``roots`` (each storage counted once)."""
    return sum(reachable_storages(*roots).values())


def tensors_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors``."""
    return sum({(str(t.device), t.untyped_storage().data_ptr()): t.untyped_storage().nbytes()
                for t in tensors if not t.is_meta}.values())


__all__ = ["reachable_storages", "resident_bytes", "tensors_bytes"]
