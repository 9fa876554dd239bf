"""CudaGraphStep: one lowered graph's call replayed as a CUDA graph, the cache decision a conditional node.

Why: a residual-cache step decides on the device (``torch.cond(use_cache, cached, compute, ...)``), but run
eagerly ``torch.cond`` reads its predicate on the host: one device sync per step, and every launch of the top
graph and of the compiled block regions is paid in Python. Captured with ``torch.cuda.graph`` under torch's
``CUDAGraphCaptureControlFlowOpDispatchMode`` (or our :class:`IfNodeCapture`, on a torch with CUDAGraph's IF-node
calls but not that mode, or on torch 2.11 through :mod:`dit_passes.infra.cuda_if_node`, which makes the IF nodes with
ctypes), each ``cond`` becomes a pair of CUDA conditional (IF) nodes
whose predicate the GPU reads: a replay is one launch, no host read, whichever arm runs.

The life of one signature's step (``LoweredGraph`` owns one CudaGraphStep)::

    call 1 ........ warm-up: run eagerly, BOTH arms of every cond (BothArms), so that every compiled
                    region is compiled, every kernel loaded and cuBLAS initialised before any capture;
                    the arm the predicate picks gives the result (one host read, this call only)
    call 2 ........ capture: static input buffers <- the call's tensors; the whole step captured once
                    (both arms as conditional bodies); then replayed for this call's result
    call 3, 4, ... replay: copy the call's tensors into the static inputs (skipped for a tensor that is
                    the static buffer itself), ``graph.replay()``, return clones of the static outputs

Every input is copied in and every output cloned out, so nothing outside aliases the graph's buffers: the
cache state of one context ("cond" / "uncond"), a second pipeline, ``new_generation()`` (fresh state
tensors) and a generation stopped half way all just feed other tensors into the same graph. A new shape is
a new signature, hence a new LoweredGraph and a new capture; a stale graph never replays.

What cannot be captured (a host read inside the graph, CPU tensors, a torch without conditional nodes) is
refused with an error that says to drop ``mode="reduce-overhead"``, before or while capturing, never later.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from . import cuda_if_node

_COND = torch.ops.higher_order.cond
FIX = "compile without mode='reduce-overhead' (torch_compile={'regional': True}) to run the step eagerly"


class CudaGraphUnavailable(RuntimeError):
    """The step cannot be replayed as a CUDA graph here (the message says why and what to use instead)."""


def conditional_capture_mode() -> type:
    """A dispatch mode that turns ``torch.cond`` into CUDA conditional nodes while capturing: torch's own
    (``torch._higher_order_ops.cudagraph_conditional_nodes``, in torch 2.13; not in 2.11) or :class:`IfNodeCapture`,
    on a torch whose CUDAGraph has the IF-node capture calls but not that module, else (torch 2.11) on our ctypes
    IF nodes (:mod:`~dit_passes.infra.cuda_if_node`; its kernel is compiled and loaded here, outside any capture).
    Raises :class:`CudaGraphUnavailable` where none works or CUDA is older than 12.4."""
    if not torch.cuda.is_available():
        raise CudaGraphUnavailable(f"mode='reduce-overhead' replays the step as a CUDA graph: no CUDA device "
                                   f"here; {FIX}")
    cuda = tuple(int(x) for x in (torch.version.cuda or "0.0").split(".")[:2])
    if cuda < (12, 4):
        raise CudaGraphUnavailable(f"CUDA-graph conditional nodes need CUDA >= 12.4, torch is built with "
                                   f"{torch.version.cuda}; {FIX}")
    try:
        from torch._higher_order_ops.cudagraph_conditional_nodes import CUDAGraphCaptureControlFlowOpDispatchMode
        return CUDAGraphCaptureControlFlowOpDispatchMode
    except ImportError:
        pass
    if torch_has_if_nodes():
        return IfNodeCapture
    why = cuda_if_node.unavailable_reason()
    if not why:
        return IfNodeCapture
    raise CudaGraphUnavailable(f"torch {torch.__version__} has no CUDA-graph conditional nodes for torch.cond "
                               f"(CUDAGraph lacks {', '.join(IF_NODE_CALLS)}) and our ctypes IF nodes cannot work "
                               f"here ({why}); {FIX}")


IF_NODE_CALLS = ("get_currently_capturing_graph", "begin_capture_to_if_node", "end_capture_to_conditional_node")


def torch_has_if_nodes() -> bool:
    """Whether torch's CUDAGraph has the IF-node capture calls (torch 2.13: yes; 2.11: no, ours stand in)."""
    return all(hasattr(torch.cuda.CUDAGraph, m) for m in IF_NODE_CALLS)


class IfNodeCapture(TorchDispatchMode):
    """While a CUDA graph captures: each ``torch.cond`` becomes two IF nodes (``pred``, then ``not pred``) whose
    bodies capture the two arms; the false arm's outputs are copied into the true arm's, so the rest of the graph
    reads one set of buffers whichever arm ran. (CUDA's IF/ELSE node needs 12.8; two IF nodes work from 12.4.)

    ``pool``: the memory pool the capture allocates from (``torch.cuda.graph(g, pool=pool)``). Needed where torch
    has no IF-node calls (torch 2.11): our ctypes IF nodes route the arms' allocations into it (``CUDAGraph.pool()``
    cannot say it before the capture ends)."""

    supports_higher_order_operators = True

    def __init__(self, pool: Any = None) -> None:
        super().__init__()
        self.pool = pool
        self._ours: Optional[cuda_if_node.IfNodeCapturer] = None

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def _capturing(self, pred: torch.Tensor) -> Any:
        """torch's capturing CUDAGraph (it has the IF-node calls) or our ctypes stand-in with the same two calls."""
        if torch_has_if_nodes():
            return torch.cuda.CUDAGraph.get_currently_capturing_graph()
        if self._ours is None:
            if self.pool is None:
                raise CudaGraphUnavailable(f"torch {torch.__version__} has no IF-node capture calls: IfNodeCapture "
                                           f"needs the capture's memory pool: p = torch.cuda.graph_pool_handle(); "
                                           f"with torch.cuda.graph(g, pool=p), IfNodeCapture(pool=p): ...")
            self._ours = cuda_if_node.IfNodeCapturer(self.pool, device=pred.device.index)
        return self._ours

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is not _COND:
            return func(*args, **(kwargs or {}))
        pred, true_fn, false_fn, operands = args
        if isinstance(pred, bool):  # a constant decision: nothing for the device to read
            with self:
                return true_fn(*operands) if pred else false_fn(*operands)
        graph = self._capturing(pred)
        with self:  # nested conds inside an arm become nested conditional nodes
            graph.begin_capture_to_if_node(pred)
            try:
                out = true_fn(*operands)
            finally:
                graph.end_capture_to_conditional_node()
            graph.begin_capture_to_if_node(torch.logical_not(pred))
            try:
                for mine, other in zip(pytree.tree_leaves(out), pytree.tree_leaves(false_fn(*operands))):
                    mine.copy_(other)
            finally:
                graph.end_capture_to_conditional_node()
        return out


class BothArms(TorchDispatchMode):
    """Runs both arms of every ``torch.cond`` (really, on the call's data) and returns the one its predicate
    picks. The arms are functional (torch.cond forbids mutation), so running the other one changes nothing
    but warms it: its regions compile and its kernels load now, not inside a later stream capture."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # compiled regions run as compiled code; only the eager cond calls are seen here

    def __init__(self) -> None:
        super().__init__()
        self.conds = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _COND:
            pred, true_fn, false_fn, operands = args
            self.conds += 1
            with self:  # nested conds warm both of their arms too
                on_true, on_false = true_fn(*operands), false_fn(*operands)
            return on_true if bool(pred) else on_false
        return func(*args, **(kwargs or {}))


def _static_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised buffer with ``t``'s size, strides, dtype and device (the graph reads these strides)."""
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)


class CudaGraphStep:
    """``step(*tensors) -> outputs``, replaying ``fn`` (a lowered graph's runner) as one CUDA graph.

    ``pool``: a ``torch.cuda.graph_pool_handle()`` shared by the steps of one CompiledDiT (their captures
    never run at the same time). ``warmup_calls``: eager calls with both arms warmed before the capture.
    """

    def __init__(self, fn: Callable[..., Any], *, pool: Any = None, warmup_calls: int = 1,
                 capture_mode: Optional[type] = None):
        self.fn = fn
        self.pool = pool
        self.warmup_calls = int(warmup_calls)
        self.calls = 0
        self.replays = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self._inputs: List[torch.Tensor] = []
        self._outputs: List[Any] = []
        self._out_spec: Any = None
        # the caller's checked mode, or checked here: refused at construction where it cannot work
        self._capture_mode = capture_mode or conditional_capture_mode()

    def _check(self, args: Sequence[Any]) -> None:
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                raise CudaGraphUnavailable(f"argument {i} of the step is a {type(a).__name__}, not a tensor: a CUDA "
                                           f"graph replays tensors only; {FIX}")
            if not a.is_cuda:
                raise CudaGraphUnavailable(f"argument {i} of the step is on {a.device}: a CUDA graph reads CUDA "
                                           f"tensors only (move the model and its inputs to the GPU, or {FIX})")
        if self.graph is not None:
            for i, (a, s) in enumerate(zip(args, self._inputs)):
                if a.shape != s.shape or a.dtype != s.dtype or a.device != s.device:
                    raise CudaGraphUnavailable(
                        f"argument {i} is {tuple(a.shape)} {a.dtype} on {a.device}, the captured step read "
                        f"{tuple(s.shape)} {s.dtype} on {s.device}: a graph is captured per signature, so this is "
                        f"a bug in the caller's keying (report it); {FIX}")

    def __call__(self, *args: torch.Tensor) -> Any:
        self._check(args)
        self.calls += 1
        if self.graph is None and self.calls <= self.warmup_calls:
            with BothArms():
                return self.fn(*args)
        if self.graph is None:
            self._capture(args)
        else:
            for static, a in zip(self._inputs, args):
                if a is not static:
                    static.copy_(a)
        self.graph.replay()
        self.replays += 1
        # clones: the next replay overwrites the static outputs, and the caller keeps these (a CFG pair's
        # first half, the cache state of another context)
        outs = [o.clone() if isinstance(o, torch.Tensor) else o for o in self._outputs]
        return pytree.tree_unflatten(outs, self._out_spec)

    def _capture(self, args: Sequence[torch.Tensor]) -> None:
        self._inputs = [_static_like(a) for a in args]
        for static, a in zip(self._inputs, args):
            static.copy_(a)
        if issubclass(self._capture_mode, IfNodeCapture) and not torch_has_if_nodes() and args:
            try:  # our IF-node kernel loaded for this device before, not inside, the capture
                cuda_if_node.prepare(args[0].device.index)
            except cuda_if_node.CudaIfNodeError as e:
                raise CudaGraphUnavailable(f"our ctypes CUDA-graph IF nodes cannot work on {args[0].device}: {e}; "
                                           f"{FIX}") from e
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        pool = self.pool if self.pool is not None else torch.cuda.graph_pool_handle()  # a private pool, named
        try:
            mode = self._capture_mode(pool) if issubclass(self._capture_mode, IfNodeCapture) else self._capture_mode()
            with torch.cuda.graph(graph, pool=pool), mode:
                out = self.fn(*self._inputs)
        except Exception as e:  # noqa: BLE001 - any failure inside the capture is the same refusal
            raise CudaGraphUnavailable(f"capturing the step as a CUDA graph failed ({type(e).__name__}: "
                                       f"{str(e)[:300]}); the graph must not read device values on the host nor "
                                       f"touch CPU tensors; {FIX}") from e
        self._outputs, self._out_spec = pytree.tree_flatten(out)
        self.graph = graph


__all__ = ["BothArms", "CudaGraphStep", "CudaGraphUnavailable", "IfNodeCapture", "conditional_capture_mode",
           "torch_has_if_nodes"]
