"""CUDA-graph IF nodes for a torch without them (torch 2.11): ctypes on libcudart, NVRTC and the driver API.

Why: torch 2.13 lets a capture put a ``torch.cond`` arm into a conditional (IF) node
(``CUDAGraph.begin_capture_to_if_node`` / ``end_capture_to_conditional_node``), so the GPU, not the host, reads the
cache decision. torch 2.11 (the GPU machine's) has neither call. This module does the same from Python for the graph
that torch is capturing on the current stream; nothing is built ahead of time.

``IfNodeCapturer(pool).begin_capture_to_if_node(pred)`` (``pool``: the capture's memory pool, as passed to
``torch.cuda.graph(g, pool=pool)``; ``pred``: a one-element bool / integer CUDA tensor):

1. ``cudaStreamGetCaptureInfo`` on the capturing stream -> the graph being captured (a body graph when nested);
2. ``cudaGraphConditionalHandleCreate(&h, graph, 0, 0)``;
3. a one-thread kernel ``cudaGraphSetConditional(h, pred != 0)`` launched on the capturing stream (captured as a
   kernel node: on every replay the GPU reads the predicate);
4. ``cudaGraphAddNode`` of a conditional node {handle h, type IF, size 1} on the stream's current dependencies
   (that kernel), then ``cudaStreamUpdateCaptureDependencies(SET)``: the main capture continues after the node;
5. the body (``phGraph_out[0]``) is captured on a side stream (``cudaStreamBeginCaptureToGraph``, thread-local
   mode), made torch's current stream, with the caching allocator routing this thread's allocations into the
   capture's memory pool (torch's own routing filter matches the main capture's id only, so without this the
   body's allocations would come from outside the graph's pool).

``end_capture_to_conditional_node()`` ends the side capture, restores the stream and the pool routing. (The
allocator holds one routing entry per pool and ending removes the first: each switch ends the current entry, begins
one for this thread and releases the pool reference that begin took, so the capture's own count is unchanged.)

The kernel: NVRTC compiles it to a cubin for the device's arch (if the driver refuses that, to PTX for the driver to
JIT). ``cudaGraphSetConditional`` is a ``cudart_builtin`` device function that stays an undefined symbol in every
image, like ``vprintf``, and the driver binds it at module load: declared here without its header chain, the cubin is
byte-identical to the one NVRTC 13.0 makes with the official ``cuda_device_runtime_api.h``, and nvJitLink-linking
relocatable code with libcudadevrt.a leaves it undefined too (checked on a CPU machine), so there is nothing to link.

ABI: the signatures and layouts come from the CUDA 13.0 runtime headers (nvidia-cuda-runtime 13.0.96,
nvidia-cuda-crt 13.0.88): ``cudaStreamGetCaptureInfo`` / ``cudaGraphAddNode`` / ``cudaStreamUpdateCaptureDependencies``
take edge data in 13.0; on CUDA 12 (12.4.127 headers) the same signatures are ``cudaStreamGetCaptureInfo_v3`` /
``cudaGraphAddNode_v2`` / ``cudaStreamUpdateCaptureDependencies_v2``, used when the library exports them.
``cudaGraphNodeParams`` is 256 bytes with its union at offset 16, ``cudaConditionalNodeParams`` 24 bytes
(handle@0, type@8, size@12, phGraph_out@16), ``cudaGraphEdgeData`` 8 bytes, in both (checked with gcc against the
headers; ``_check_layout`` asserts the ctypes mirror; the capture calls were also run, on a CPU, against a stand-in
libcudart / libcuda compiled from the 13.0 headers that checks every argument). Conditional nodes need CUDA >= 12.4
(runtime and driver).

Set ``DIT_PASSES_CUDA_TRACE=1`` to print every CUDA / NVRTC call with its arguments and return code to stderr.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import os
import site
import sys
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_uint, c_ulonglong, c_void_p
from typing import Any, List, Optional, Tuple

import torch

from . import env


class CudaIfNodeError(RuntimeError):
    """A CUDA / NVRTC call failed or a library is missing; the message names the call and its error code."""


KERNEL = "dit_passes_set_conditional"
KERNEL_SRC = r"""
// the device runtime's declaration (cuda_device_runtime_api.h), without its header chain
extern "C" __device__ __attribute__((cudart_builtin)) void cudaGraphSetConditional(unsigned long long handle,
                                                                                unsigned int value);
extern "C" __global__ void dit_passes_set_conditional(unsigned long long handle, const unsigned char* pred,
                                                      int nbytes) {
  unsigned int v = 0;
  for (int i = 0; i < nbytes; ++i) v |= pred[i];  // any nonzero byte: true (bool and integer predicates)
  cudaGraphSetConditional(handle, v != 0u);
}
"""

# enum values (driver_types.h, CUDA 12.4 and 13.0)
GRAPH_NODE_TYPE_CONDITIONAL = 13
GRAPH_COND_TYPE_IF = 0
CAPTURE_STATUS_ACTIVE = 1
CAPTURE_MODE_THREAD_LOCAL = 1
SET_CAPTURE_DEPENDENCIES = 1


class ConditionalNodeParams(ctypes.Structure):
    _fields_ = [("handle", c_ulonglong), ("type", c_int), ("size", c_uint), ("phGraph_out", POINTER(c_void_p))]


class _NodeParamsUnion(ctypes.Union):
    _fields_ = [("reserved1", ctypes.c_longlong * 29), ("conditional", ConditionalNodeParams)]


class GraphNodeParams(ctypes.Structure):
    _fields_ = [("type", c_int), ("reserved0", c_int * 3), ("u", _NodeParamsUnion), ("reserved2", ctypes.c_longlong)]


def _check_layout() -> None:
    cond = ConditionalNodeParams
    got = (ctypes.sizeof(GraphNodeParams), GraphNodeParams.u.offset, ctypes.sizeof(cond), cond.type.offset,
           cond.size.offset, cond.phGraph_out.offset)
    if got != (256, 16, 24, 8, 12, 16):
        raise CudaIfNodeError(f"ctypes layout of cudaGraphNodeParams is {got}, the CUDA headers say "
                              f"(256, 16, 24, 8, 12, 16): this platform's ABI differs, IF nodes unavailable")


TRACE = env.cuda_trace()


def _trace(msg: str) -> None:
    if TRACE:
        print(f"[cuda_if_node] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ libraries
def _loaded(fragment: str) -> List[str]:
    """Paths of already loaded shared objects whose name contains ``fragment`` (the copy torch itself uses)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if fragment in line and "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(fragment))


def _site_libs(pattern: str) -> List[str]:
    """``nvidia/*/lib/<pattern>`` under every site-packages (the CUDA wheels torch depends on)."""
    roots = [os.path.dirname(os.path.dirname(torch.__file__))]  # torch's own site dir holds its CUDA wheels
    roots += [p for p in sys.path if p.endswith("-packages")] + list(site.getsitepackages())
    try:
        roots.append(site.getusersitepackages())
    except Exception:  # noqa: BLE001 - no user site in some venvs
        pass
    found: List[str] = []
    for root in dict.fromkeys(roots):
        found += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", pattern)))
    return [p for p in found if ".alt." not in p]


def _prefer_major(paths: List[str]) -> List[str]:
    """Libraries of torch's CUDA major version first (cu13 before cu12 for a cu130 torch)."""
    major = (torch.version.cuda or "").split(".")[0]
    return sorted(paths, key=lambda p: 0 if major and (f".so.{major}" in p or f"cu{major}" in p) else 1)


def _open(what: str, candidates: List[str], mode: int = ctypes.DEFAULT_MODE) -> Tuple[ctypes.CDLL, str]:
    errors = []
    for path in dict.fromkeys(candidates):
        try:
            return ctypes.CDLL(path, mode=mode), path
        except OSError as e:
            errors.append(f"{path}: {e}")
    raise CudaIfNodeError(f"cannot load {what} (tried {errors or 'nothing: none found'}); install torch's CUDA "
                          f"wheels (nvidia-cuda-runtime, nvidia-cuda-nvrtc) or use torch >= 2.13")


class _Lib:
    """A ctypes library whose calls are checked: a nonzero return raises naming the call and the error code."""

    def __init__(self, dll: ctypes.CDLL, path: str, kind: str):
        self.dll, self.path, self.kind = dll, path, kind

    def has(self, name: str) -> bool:
        return hasattr(self.dll, name)

    def fn(self, name: str, argtypes: list, restype: Any = c_int) -> Any:
        try:
            f = getattr(self.dll, name)
        except AttributeError:
            raise CudaIfNodeError(f"{self.path} has no {name} (too old a {self.kind} for conditional nodes: "
                                  f"CUDA >= 12.4 needed)") from None
        f.argtypes, f.restype = argtypes, restype
        return f

    def error_name(self, rc: int) -> str:
        try:
            if self.kind == "cudart":
                return (self.fn("cudaGetErrorName", [c_int], c_char_p)(rc) or b"?").decode()
            if self.kind == "driver":
                s = c_char_p()
                self.fn("cuGetErrorName", [c_int, POINTER(c_char_p)])(rc, byref(s))
                return (s.value or b"?").decode()
            return (self.fn("nvrtcGetErrorString", [c_int], c_char_p)(rc) or b"?").decode()
        except Exception:  # noqa: BLE001 - naming the error must never hide it
            return "?"

    def call(self, name: str, argtypes: list, *args: Any) -> None:
        rc = self.fn(name, argtypes)(*args)
        if TRACE:
            _trace(f"{name}{tuple(_show(a) for a in args)} -> {rc} ({self.error_name(rc) if rc else 'ok'})")
        if rc != 0:
            raise CudaIfNodeError(f"{name} returned {rc} ({self.error_name(rc)}) [{self.kind} {self.path}]")


def _show(a: Any) -> Any:
    v = getattr(a, "value", a)
    if isinstance(v, int) and v > 4096:
        return hex(v)  # handles and pointers
    return v if isinstance(v, (int, float, type(None))) else type(a).__name__


@functools.lru_cache(maxsize=None)
def _cudart() -> _Lib:
    dll, path = _open("libcudart", _loaded("libcudart.so") + _prefer_major(_site_libs("libcudart.so*")))
    lib = _Lib(dll, path, "cudart")
    version = c_int()
    lib.call("cudaRuntimeGetVersion", [POINTER(c_int)], byref(version))
    if version.value < 12040:
        raise CudaIfNodeError(f"{path} is CUDA runtime {version.value}: conditional nodes need >= 12040 (12.4)")
    lib.version = version.value
    # CUDA 12.3-12.9 export the edge-data signatures under suffixed names, 13.x under the plain ones
    v12 = lib.has("cudaStreamGetCaptureInfo_v3")
    lib.names = {"info": "cudaStreamGetCaptureInfo_v3" if v12 else "cudaStreamGetCaptureInfo",
                 "add": "cudaGraphAddNode_v2" if v12 else "cudaGraphAddNode",
                 "deps": "cudaStreamUpdateCaptureDependencies_v2" if v12 else "cudaStreamUpdateCaptureDependencies"}
    if not v12 and version.value < 13000:
        raise CudaIfNodeError(f"{path} (CUDA {version.value}) lacks cudaStreamGetCaptureInfo_v3: need >= 12.4")
    return lib


@functools.lru_cache(maxsize=None)
def _driver() -> _Lib:
    dll, path = _open("libcuda (the NVIDIA driver)", _loaded("libcuda.so") + ["libcuda.so.1"])
    lib = _Lib(dll, path, "driver")
    lib.call("cuInit", [c_uint], 0)
    return lib


@functools.lru_cache(maxsize=None)
def _nvrtc() -> _Lib:
    paths = _loaded("libnvrtc.so") + _prefer_major(_site_libs("libnvrtc.so*"))
    dll, path = _open("libnvrtc", [p for p in paths if "builtins" not in p])
    # NVRTC dlopens its builtins by soname: load the copy beside it first, so no LD_LIBRARY_PATH is needed
    for b in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*"))):
        if ".alt." not in b:
            try:
                ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
            except OSError as e:
                _trace(f"preloading {b} failed: {e}")
    return _Lib(dll, path, "nvrtc")


# --------------------------------------------------------------------------------------------------- kernel
def compile_kernel(arch: str, *, ptx: bool = False) -> bytes:
    """NVRTC: the set-conditional kernel as a cubin for ``arch`` (``sm_90``) or, with ``ptx``, PTX for
    ``compute_XY``. Needs no GPU."""
    nv = _nvrtc()
    prog = c_void_p()
    nv.call("nvrtcCreateProgram", [POINTER(c_void_p), c_char_p, c_char_p, c_int, c_void_p, c_void_p],
            byref(prog), KERNEL_SRC.encode(), b"dit_passes_if_node.cu", 0, None, None)
    try:
        opts = [f"--gpu-architecture={arch.replace('sm_', 'compute_') if ptx else arch}"]
        arr = (c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = nv.fn("nvrtcCompileProgram", [c_void_p, c_int, POINTER(c_char_p)])(prog, len(opts), arr)
        size = c_size_t()
        nv.call("nvrtcGetProgramLogSize", [c_void_p, POINTER(c_size_t)], prog, byref(size))
        log = ctypes.create_string_buffer(size.value)
        nv.call("nvrtcGetProgramLog", [c_void_p, c_char_p], prog, log)
        _trace(f"nvrtcCompileProgram({opts}) -> {rc}; log: {log.value.decode(errors='replace').strip()}")
        if rc != 0:
            raise CudaIfNodeError(f"nvrtcCompileProgram({opts}) returned {rc} ({nv.error_name(rc)}) [{nv.path}]: "
                                  f"{log.value.decode(errors='replace')}")
        what = "PTX" if ptx else "CUBIN"
        nv.call(f"nvrtcGet{what}Size", [c_void_p, POINTER(c_size_t)], prog, byref(size))
        out = ctypes.create_string_buffer(size.value)
        nv.call(f"nvrtcGet{what}", [c_void_p, c_char_p], prog, out)
        return out.raw
    finally:
        nv.call("nvrtcDestroyProgram", [POINTER(c_void_p)], byref(prog))


@functools.lru_cache(maxsize=None)
def _kernel(device: int) -> int:
    """The loaded kernel (a CUfunction) for ``device``, in its primary context (the one torch uses)."""
    drv = _driver()
    major, minor = torch.cuda.get_device_capability(device)
    arch = f"sm_{major}{minor}"
    dev, ctx = c_int(), c_void_p()
    drv.call("cuDeviceGet", [POINTER(c_int), c_int], byref(dev), device)
    drv.call("cuDevicePrimaryCtxRetain", [POINTER(c_void_p), c_int], byref(ctx), dev)
    drv.call("cuCtxPushCurrent_v2", [c_void_p], ctx)
    errors = []
    try:
        for how in ("cubin", "ptx"):
            try:
                image = compile_kernel(arch, ptx=how == "ptx")
                module, fn = c_void_p(), c_void_p()
                drv.call("cuModuleLoadData", [POINTER(c_void_p), c_char_p], byref(module), image)
                drv.call("cuModuleGetFunction", [POINTER(c_void_p), c_void_p, c_char_p], byref(fn), module,
                         KERNEL.encode())
                _trace(f"kernel loaded for device {device} ({arch}) from {how}")
                return fn.value
            except CudaIfNodeError as e:
                errors.append(f"{how}: {e}")
        raise CudaIfNodeError(f"cannot load the set-conditional kernel for {arch}: " + "; ".join(errors))
    finally:
        drv.call("cuCtxPopCurrent_v2", [POINTER(c_void_p)], byref(c_void_p()))


def prepare(device: Optional[int] = None) -> None:
    """Load the libraries and the kernel for ``device`` now, outside any capture (module loading inside a
    global-mode capture is not allowed). Raises :class:`CudaIfNodeError` saying what is missing."""
    if not torch.cuda.is_available():
        raise CudaIfNodeError("no CUDA device")
    _check_layout()
    _cudart()
    _kernel(torch.cuda.current_device() if device is None else int(device))


def unavailable_reason(device: Optional[int] = None) -> str:
    """"" where :func:`prepare` works, else why not."""
    try:
        prepare(device)
        return ""
    except (CudaIfNodeError, OSError, RuntimeError) as e:
        return " ".join(str(e).split()) or type(e).__name__  # one line (NVRTC logs have newlines)


# -------------------------------------------------------------------------------------------------- capture
def _capture_info(stream: int) -> Tuple[int, c_void_p, Any, c_void_p, int]:
    """(status, graph, dependencies, edge data, count) of ``stream``'s capture."""
    rt = _cudart()
    status, cid, graph = c_int(), c_ulonglong(), c_void_p()
    deps, edges, n = POINTER(c_void_p)(), c_void_p(), c_size_t()
    rt.call(rt.names["info"], [c_void_p, POINTER(c_int), POINTER(c_ulonglong), POINTER(c_void_p),
                               POINTER(POINTER(c_void_p)), POINTER(c_void_p), POINTER(c_size_t)],
            stream, byref(status), byref(cid), byref(graph), byref(deps), byref(edges), byref(n))
    return status.value, graph, deps, edges, n.value


def _capturing(stream: int) -> bool:
    status = c_int()
    _cudart().call("cudaStreamIsCapturing", [c_void_p, POINTER(c_int)], stream, byref(status))
    return status.value != 0


def _pool_calls() -> Tuple[Any, Any, Any]:
    """torch's allocator routing: (begin for this thread, end, release). torch >= 2.8 has the thread filter;
    older ones route every allocation (any thread) while begun."""
    c = torch._C
    begin = getattr(c, "_cuda_beginAllocateCurrentThreadToPool", None) or getattr(c, "_cuda_beginAllocateToPool", None)
    end = getattr(c, "_cuda_endAllocateToPool", None) or getattr(c, "_cuda_endAllocateCurrentStreamToPool", None)
    release = getattr(c, "_cuda_releasePool", None)
    if begin is None or end is None or release is None:
        raise CudaIfNodeError(f"torch {torch.__version__} has no caching-allocator pool routing "
                              f"(torch._C._cuda_beginAllocate*ToPool / _cuda_endAllocateToPool / _cuda_releasePool)")
    return begin, end, release


class IfNodeCapturer:
    """``begin_capture_to_if_node`` / ``end_capture_to_conditional_node`` for one ``torch.cuda.graph`` capture on
    the current device: ``pool`` is that capture's memory pool (``CUDAGraph.pool()``). Pairs nest (a cond inside
    an arm); each open pair keeps its side stream and the stream it replaced."""

    def __init__(self, pool: Any, device: Optional[int] = None):
        self.pool = pool
        self.device = torch.cuda.current_device() if device is None else int(device)
        self.nodes = 0
        self._open: List[Tuple[torch.cuda.Stream, torch.cuda.Stream]] = []
        prepare(self.device)
        self._begin_pool, self._end_pool, self._release_pool = _pool_calls()

    def _reroute_pool(self) -> None:
        # the allocator allows one routing entry per pool and ending removes the first one: end the current one
        # (the capture's own, or ours), begin one for this thread (the side stream's allocations included), and
        # release the reference that begin took, so the pool's count stays the capture's own
        self._end_pool(self.device, self.pool)
        self._begin_pool(self.device, self.pool)
        self._release_pool(self.device, self.pool)

    def _side_stream(self, busy: List[int]) -> torch.cuda.Stream:
        for _ in range(64):  # torch's stream pool hands streams round-robin; skip capturing / in-use ones
            s = torch.cuda.Stream(self.device)
            if s.cuda_stream not in busy and not _capturing(s.cuda_stream):
                return s
        raise CudaIfNodeError("no idle stream in torch's stream pool to capture a conditional body on")

    def begin_capture_to_if_node(self, pred: torch.Tensor) -> None:
        if not (isinstance(pred, torch.Tensor) and pred.is_cuda and pred.numel() == 1
                and not pred.is_floating_point() and not pred.is_complex()):
            got = (pred.dtype, tuple(pred.shape), pred.device) if isinstance(pred, torch.Tensor) else type(pred)
            raise CudaIfNodeError(f"an IF node reads a one-element bool / integer CUDA tensor, got {got}")
        rt, drv = _cudart(), _driver()
        main = torch.cuda.current_stream(self.device)
        status, graph, _, _, _ = _capture_info(main.cuda_stream)
        if status != CAPTURE_STATUS_ACTIVE:
            raise CudaIfNodeError(f"begin_capture_to_if_node: the current stream is not capturing (status {status});"
                                  f" call it inside torch.cuda.graph")
        handle = c_ulonglong()
        rt.call("cudaGraphConditionalHandleCreate", [POINTER(c_ulonglong), c_void_p, c_uint, c_uint],
                byref(handle), graph, 0, 0)
        h, ptr, nbytes = c_ulonglong(handle.value), c_void_p(pred.data_ptr()), c_int(pred.element_size())
        args = (c_void_p * 3)(ctypes.addressof(h), ctypes.addressof(ptr), ctypes.addressof(nbytes))
        drv.call("cuLaunchKernel", [c_void_p] + [c_uint] * 7 + [c_void_p, c_void_p, c_void_p],
                 _kernel(self.device), 1, 1, 1, 1, 1, 1, 0, main.cuda_stream, args, None)
        status, graph, deps, edges, n = _capture_info(main.cuda_stream)  # now: the kernel node
        params = GraphNodeParams()
        params.type = GRAPH_NODE_TYPE_CONDITIONAL
        params.u.conditional.handle = handle.value
        params.u.conditional.type = GRAPH_COND_TYPE_IF
        params.u.conditional.size = 1
        node = c_void_p()
        rt.call(rt.names["add"], [POINTER(c_void_p), c_void_p, POINTER(c_void_p), c_void_p, c_size_t,
                                  POINTER(GraphNodeParams)], byref(node), graph, deps, edges, n, byref(params))
        body = c_void_p(params.u.conditional.phGraph_out[0])
        rt.call(rt.names["deps"], [c_void_p, POINTER(c_void_p), c_void_p, c_size_t, c_uint],
                main.cuda_stream, byref(node), None, 1, SET_CAPTURE_DEPENDENCIES)
        side = self._side_stream([main.cuda_stream] + [s.cuda_stream for s, _ in self._open])
        rt.call("cudaStreamBeginCaptureToGraph", [c_void_p, c_void_p, c_void_p, c_void_p, c_size_t, c_int],
                side.cuda_stream, body, None, None, 0, CAPTURE_MODE_THREAD_LOCAL)
        self._reroute_pool()
        torch.cuda.set_stream(side)
        self._open.append((side, main))
        self.nodes += 1

    def end_capture_to_conditional_node(self) -> None:
        if not self._open:
            raise CudaIfNodeError("end_capture_to_conditional_node without begin_capture_to_if_node")
        side, main = self._open.pop()
        body = c_void_p()
        try:
            _cudart().call("cudaStreamEndCapture", [c_void_p, POINTER(c_void_p)], side.cuda_stream, byref(body))
        finally:  # the stream and the pool routing come back even when the body's capture was invalidated
            torch.cuda.set_stream(main)
            self._reroute_pool()


__all__ = ["CudaIfNodeError", "IfNodeCapturer", "compile_kernel", "prepare", "unavailable_reason"]
