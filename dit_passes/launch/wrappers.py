"""The transformer-level proxy: an ``nn.Module`` whose forward runs on the Ray workers.

``pipe.transformer = engine.as_transformer()`` keeps the text encoders, VAE and scheduler in the main
process; each denoising step's inputs go to every worker, rank 0's output comes back. The proxy owns
no parameters, so ``pipe.to("cuda")`` moves nothing of it onto the driver's GPU: ``.to()`` only
records the device the pipeline thinks the transformer is on (outputs are returned there).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, Optional, Tuple

import torch

from .workers import map_tensors

__all__ = ["RayTransformerProxy", "RayModuleProxy"]


class _Config(dict):
    """The workers' transformer config: dict access plus attribute access, as diffusers' FrozenDict."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"transformer config has no field {name!r}") from None


class _WorkerProxy(torch.nn.Module):
    """What the two proxies share: the device is only recorded (the workers keep theirs; the caller's tensors go to
    the CPU for the engine and the results come back to the device of the first input tensor, else the recorded
    one)."""

    def __init__(self) -> None:
        super().__init__()
        self._device = torch.device("cpu")

    @property
    def device(self) -> torch.device:
        return self._device

    def _dtype_requested(self, dtype: torch.dtype) -> None:
        """``.to(dtype)``: nothing to do unless a proxy says otherwise."""

    def to(self, *args: Any, **kwargs: Any) -> "_WorkerProxy":
        """Record the device (the workers keep theirs)."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None:
            self._device = torch.device(device)
        if dtype is not None:
            self._dtype_requested(dtype)
        return self

    def cuda(self, device: Any = None) -> "_WorkerProxy":
        return self.to("cuda" if device is None else torch.device("cuda", device) if isinstance(device, int)
                       else device)

    def cpu(self) -> "_WorkerProxy":
        return self.to("cpu")

    def _to_cpu(self, args: tuple, kwargs: dict) -> Tuple[torch.device, list, dict]:
        """(the device results go back to, the arguments' tensors detached on the CPU)."""
        target = next((v.device for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), self._device)
        cpu = lambda t: t.detach().to("cpu")  # noqa: E731
        return target, map_tensors(list(args), cpu), {k: map_tensors(v, cpu) for k, v in kwargs.items()}


class RayTransformerProxy(_WorkerProxy):
    """Drop-in for the transformer of a pipeline: keyword forward, ``.config``, ``.dtype``, ``.device``,
    ``cache_context(name)``, ``new_generation()``. Built by ``RayEngine.as_transformer(index)``: it runs the
    ``index``-th transformer the engine launched."""

    def __init__(self, engine: Any, config: Optional[dict], dtype: torch.dtype, index: int = 0):
        super().__init__()
        # Stored outside _modules/_parameters: the engine is not a submodule (nothing to move or save).
        self.__dict__["_engine"] = engine
        self._index = index
        self._config = _Config(config or {})
        self._dtype = dtype
        self._context: Optional[str] = None

    @property
    def config(self) -> _Config:
        return self._config

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def _dtype_requested(self, dtype: torch.dtype) -> None:
        if dtype != self._dtype:
            warnings.warn(f"RayTransformerProxy.to({dtype}) ignored: the workers' transformer stays {self._dtype} "
                          "(launch with a model of the wanted dtype)", stacklevel=3)

    @contextlib.contextmanager
    def cache_context(self, name: str, **where: Any) -> Iterator[None]:
        """The context is sent with each step, so the workers' cache passes see "cond" / "uncond". ``where``
        (diffusers' ``CacheContext`` fields: ``step_index``, ``sigma``, ...) is unused, as by ``CompiledDiT``."""
        prev, self._context = self._context, name
        try:
            yield
        finally:
            self._context = prev

    def new_generation(self) -> None:
        self._engine._new_generation(self._index)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            raise TypeError("RayTransformerProxy takes keyword arguments only (as diffusers pipelines call it); "
                            f"got {len(args)} positional argument(s)")
        target, _, cpu_kwargs = self._to_cpu((), kwargs)
        out = self._engine._forward(cpu_kwargs, self._context, self._index)
        return map_tensors(out, lambda t: t.to(target))

    def extra_repr(self) -> str:
        return f"world_size={self._engine.world_size}, index={self._index}, dtype={self._dtype}, device={self._device}"


class RayModuleProxy(_WorkerProxy):
    """Drop-in for an extra module of a pipeline (a text encoder, a VAE, a ControlNet) that runs on the workers:
    calling it, or any method of the module (``vae.decode(...)``, ``vae.encode(...)``), runs there on every rank
    and returns rank 0's result; plain attributes (``config``, ``dtype``) are read from the main process's copy,
    ``original`` (which this proxy does not own: ``.to()`` only records the device, as the transformer proxy's).
    Built by ``RayEngine.as_module(index, original)``."""

    def __init__(self, engine: Any, index: int, original: torch.nn.Module):
        super().__init__()
        self.__dict__["_engine"] = engine  # not submodules: nothing to move or save
        self.__dict__["_original"] = original
        self._index = index

    def _remote(self, method: str, args: tuple, kwargs: dict) -> Any:
        target, cpu_args, cpu_kwargs = self._to_cpu(args, kwargs)
        out = self._engine._call_extra(self._index, method, cpu_args, cpu_kwargs)
        return map_tensors(out, lambda t: t.to(target))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._remote("forward", args, kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        value = getattr(self.__dict__["_original"], name)
        if callable(value) and not isinstance(value, (torch.nn.Module, torch.Tensor, type)):
            return lambda *args, **kwargs: self._remote(name, args, kwargs)  # a method: it runs on the workers
        return value

    def extra_repr(self) -> str:
        return (f"{type(self.__dict__['_original']).__name__} on {self._engine.world_size} Ray workers, "
                f"index={self._index}, device={self._device}")
