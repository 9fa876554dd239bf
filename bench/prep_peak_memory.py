"""Peak memory while preparing a model built on the meta device from a checkpoint, or quantizing one in memory.

    python bench/prep_peak_memory.py [--size full|tiny] [--rows svdq_w4_r32,fp8,tp2,bf16] [--checkpoint DIR]
    python bench/prep_peak_memory.py --from memory [--size full|tiny] [--rows svdq_w4_r32,svdq_w4_r32_mw8,fp8,bf16]

``--from memory`` (:func:`prepare_in_memory_row`): no checkpoint; the bf16 model is made on the device with random
weights (one tensor at a time, no download) and ``compile_dit(model, passes=[...], example_inputs=...)`` quantizes it
in place, the caller's reference dropped; peak and final are counted from before the model existed, and the bound
is ``max(model, final) + one bf16 block`` (each original weight released as its replacement is made).
``svdq_w4_r32_mw8``: ``svdq_w4_r32`` with the modulation linears in weight-only int8 (``modulation="w8a16"``).

The FLUX.1-dev transformer (``dit_passes.models.flux_plain.FluxDiT``: diffusers' parameter names, no diffusers
needed; ``--size tiny``: a small FLUX on the CPU) is built on the meta device, and a random bf16 checkpoint of it is
written to ``--checkpoint`` one shard per block (never more than one block in host memory; skipped when the
directory already holds this configuration's). Then each row, in a fresh process (``run_ranks(..., fresh=True)``),
builds the meta model again and lowers it from the checkpoint onto the device:
``compile_dit(meta_model, passes=[...], weights=<checkpoint>, device=<dev>, example_inputs=<one small call>)``
(no step runs: lowering captures and prepares). Rows:

* ``svdq_w4_r32``: ``SVDQuantW4A4(rank=32, dynamic=True)`` (DQ: a checkpoint-built model cannot calibrate), the
  AdaLN modulation linears in the pass's default form;
* ``fp8``: ``Fp8Linear(exclude=())``, the modulation linears included;
* ``tp2``: ``TensorParallel(2)``, two processes on the same device joined by gloo, each measuring its own peak;
* ``bf16``: no pass: the checkpoint loaded as is (the reference: peak = final).

Measured around ``compile_dit`` only (the inputs exist before): ``peak_bytes`` and ``final_bytes`` (what stays
allocated after lowering), on a GPU ``torch.cuda.max_memory_allocated`` (reset before) and
``torch.cuda.memory_allocated``, minus what was allocated before. On the CPU (``--size tiny``) :class:`LiveTensorBytes`:
the distinct tensor storages created while preparing that are still alive, their bytes summed (a
``TorchDispatchMode`` sees every storage an ATen op creates, and the checkpoint reads are counted as they return;
a storage leaves the sum when freed), i.e. what ``max_memory_allocated`` counts on a GPU: live tensor bytes, not
the allocator's cache. (``tracemalloc`` does not see torch's allocator; the process's max RSS counts Python
objects, page cache and allocator slack, all larger than a tiny model's weights.) Also per row: the compiled
module's ``memory_report().total``, ``block_bytes`` (the largest block's bf16 bytes) and ``within_bound``:
``peak_bytes <= final_bytes + block_bytes`` (the bound: preparing never exceeds the final bytes + one bf16 block).
Writes ``<out>.json`` and ``<out>.md`` (default ``bench/results/prep_peak_memory``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
import weakref
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

TINY_CONFIG = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=32,
                   num_attention_heads=2, joint_attention_dim=64, pooled_projection_dim=32, guidance_embeds=True,
                   axes_dims_rope=(8, 12, 12))  # hidden 64: every block linear's K a multiple of int4's group
ROWS = ("svdq_w4_r32", "fp8", "tp2", "bf16")
MEMORY_ROWS = ("svdq_w4_r32", "svdq_w4_r32_mw8", "fp8", "bf16")  # --from memory: one process, no tensor parallelism
WORLD = {"tp2": 2}
TOKENS = dict(img=64, txt=16)  # the example call lowering captures with (no step runs)
MANIFEST = "prep_peak_checkpoint.json"
GIB = 2 ** 30


def log(*a) -> None:
    print(*a, flush=True)


def config_for(size: str) -> Dict[str, Any]:
    from dit_passes.bench import FLUX_DEV
    return dict(FLUX_DEV) if size == "full" else dict(TINY_CONFIG)


def row_passes(name: str, world: int) -> list:
    from dit_passes.passes import Fp8Linear, SVDQuantW4A4, TensorParallel
    return {"svdq_w4_r32": lambda: [SVDQuantW4A4(rank=32, dynamic=True)],
            "svdq_w4_r32_mw8": lambda: [SVDQuantW4A4(rank=32, dynamic=True, modulation="w8a16")],
            "fp8": lambda: [Fp8Linear(exclude=())],
            "tp2": lambda: [TensorParallel(world)], "bf16": lambda: []}[name]()


def build_meta(config: Dict[str, Any]) -> torch.nn.Module:
    """FluxDiT with ``config`` on the meta device, bf16: no weight allocated."""
    from dit_passes.models.flux_plain import FluxDiT
    with torch.device("meta"):
        return FluxDiT(**config).to(torch.bfloat16).eval().requires_grad_(False)


def block_groups(model: torch.nn.Module) -> Dict[str, List[str]]:
    """State-dict names by shard: one per block (``transformer_blocks.3``), the rest in ``other``."""
    groups: Dict[str, List[str]] = {}
    lists = {n for n, m in model.named_children() if isinstance(m, torch.nn.ModuleList)}
    for name in model.state_dict():
        head, idx = name.split(".")[:2] if "." in name else (name, "")
        groups.setdefault(f"{head}.{idx}" if head in lists else "other", []).append(name)
    return groups


def largest_block_bytes(model: torch.nn.Module) -> Dict[str, Any]:
    """The block holding the most bf16 bytes (what preparing may hold besides the final tensors)."""
    sd = model.state_dict()
    sizes = {g: sum(sd[n].numel() * 2 for n in names) for g, names in block_groups(model).items() if g != "other"}
    block = max(sizes, key=sizes.get)
    return {"block": block, "block_bytes": sizes[block]}


def write_checkpoint(config: Dict[str, Any], directory: str, device: torch.device) -> Dict[str, Any]:
    """A random bf16 checkpoint of ``config``'s FluxDiT under ``directory``: one safetensors file per block (and one
    for the rest), each made on ``device`` (fast random numbers), copied to the host and saved before the next, so
    the host holds one block at a time. Skipped when ``directory`` already holds this config's (its manifest)."""
    from safetensors.torch import save_file

    manifest = os.path.join(directory, MANIFEST)
    if os.path.isfile(manifest):
        with open(manifest) as f:
            old = json.load(f)
        if old.get("config") == json.loads(json.dumps(config)):
            return {**old, "written": False}
    os.makedirs(directory, exist_ok=True)
    model = build_meta(config)
    sd = model.state_dict()
    gen = torch.Generator(device=device).manual_seed(0)
    t0, nbytes, gen_s = time.perf_counter(), 0, 0.0
    for group, names in block_groups(model).items():
        g0 = time.perf_counter()
        shard = {n: (torch.randn(sd[n].shape, generator=gen, device=device, dtype=torch.bfloat16) * 0.02).cpu()
                 for n in names}
        gen_s += time.perf_counter() - g0
        save_file(shard, os.path.join(directory, f"{group}.safetensors"))
        nbytes += sum(t.numel() * t.element_size() for t in shard.values())
        del shard
    seconds = time.perf_counter() - t0
    info = {"config": json.loads(json.dumps(config)), "bytes": nbytes, "files": len(block_groups(model)),
            "seconds": round(seconds, 2), "generate_seconds": round(gen_s, 2),
            "write_gb_per_s": round(nbytes / max(seconds - gen_s, 1e-9) / 1e9, 3)}
    with open(manifest, "w") as f:
        json.dump(info, f, indent=1)
    return {**info, "written": True}


class LiveTensorBytes(TorchDispatchMode):
    """The bytes of the distinct tensor storages created while active that are still alive, and their peak.

    Every ATen op's output storage is counted once, when first seen, unless it is one of the op's inputs' storages
    (a view or an in-place result: nothing new); a storage leaves the sum when it is freed (a finalizer on the
    storage object, which torch keeps alive as long as any tensor uses the storage). Storages made outside ATen
    (a checkpoint read) are counted by :meth:`track` when they are handed over. Meta and fake tensors hold none."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._alive: Dict[int, int] = {}

    def track(self, t: Any, exclude: frozenset = frozenset()) -> None:
        if not isinstance(t, torch.Tensor) or t.is_meta or _is_fake(t):
            return
        storage = t.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        if nbytes == 0 or key in self._alive or key in exclude:
            return
        self._alive[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        self.live -= self._alive.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat_in = torch.utils._pytree.tree_leaves((args, kwargs))
        inputs = frozenset(t.untyped_storage()._cdata for t in flat_in
                           if isinstance(t, torch.Tensor) and not t.is_meta and not _is_fake(t))
        for t in torch.utils._pytree.tree_leaves(out):
            self.track(t, inputs)
        return out


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor) or type(t) not in (torch.Tensor, torch.nn.Parameter)


def metered_weights(directory: str, meter: Optional[LiveTensorBytes]):
    """The checkpoint as a weight source; with ``meter``, each read tensor is counted as it is handed over."""
    from dit_passes import SafetensorsWeights

    class Metered(SafetensorsWeights):
        def read(self, name, index=None, **to):
            t = super().read(name, index, **to)
            if meter is not None:
                meter.track(t)
            return t
    return Metered(directory)


@contextlib.contextmanager
def measure(device: torch.device, out: Dict[str, Any]):
    """``out["peak_bytes"]`` / ``out["final_bytes"]``: allocated over and after the block, less what was before."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        yield None
        torch.cuda.synchronize()
        out.update(peak_bytes=torch.cuda.max_memory_allocated() - base, final_bytes=torch.cuda.memory_allocated() - base,
                   measure="torch.cuda.max_memory_allocated / memory_allocated, less the allocation before")
    else:
        meter = LiveTensorBytes()
        with meter:
            yield meter
        out.update(peak_bytes=meter.peak, final_bytes=meter.live,
                   measure="LiveTensorBytes: live tensor storages created while preparing (TorchDispatchMode)")


def prepare_row(rank: int, world: int, name: str, size: str, checkpoint: str, device: str) -> Dict[str, Any]:
    """One row on one rank: lower the meta model from ``checkpoint`` with the row's passes; what memory it took."""
    import gc

    from dit_passes import compile_dit
    from dit_passes.bench import flux_inputs

    dev = torch.device(device)
    config = config_for(size)
    model = build_meta(config)
    res: Dict[str, Any] = {"row": name, "rank": rank, "world": world, **largest_block_bytes(model)}
    kw = flux_inputs(config, TOKENS["img"], TOKENS["txt"], dev, torch.bfloat16)
    gc.collect()
    t0 = time.perf_counter()
    with measure(dev, res) as meter:
        source = metered_weights(checkpoint, meter)
        compiled = compile_dit(model, passes=row_passes(name, world), weights=source, device=dev, example_inputs=kw)
        del source
        gc.collect()
    res["seconds"] = round(time.perf_counter() - t0, 2)
    report = compiled.memory_report()
    res.update(report_bytes=report.total, by_kind=report.by_kind, released_bytes=report.released_bytes,
               released=len(compiled.released), bytes_read=compiled.runtime.weights.source.total_bytes_read)
    res["bound_bytes"] = res["final_bytes"] + res["block_bytes"]
    res["within_bound"] = res["peak_bytes"] <= res["bound_bytes"]
    return res


def build_in_memory(config: Dict[str, Any], device: torch.device) -> torch.nn.Module:
    """FluxDiT with ``config`` in bf16 on ``device``, random weights (``randn * 0.02``, seeded), made one tensor at a
    time: built on the meta device, then each parameter allocated and filled in place (never an fp32 copy)."""
    model = build_meta(config).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.is_floating_point():
                t.normal_(0.0, 0.02, generator=gen)
    return model


def prepare_in_memory_row(rank: int, world: int, name: str, size: str, device: str) -> Dict[str, Any]:
    """One ``--from memory`` row: a bf16 model already on ``device`` (random weights), lowered with the row's passes
    (``compile_dit(model, passes=[...], example_inputs=<one small call>)``), the caller's reference dropped inside the
    measured span. ``peak_bytes`` / ``final_bytes`` count from before the model existed (the model's own bytes
    included); the bound is ``max(model, final) + one bf16 block``: replacing the model block by block."""
    import gc

    from dit_passes import compile_dit
    from dit_passes.bench import flux_inputs

    dev = torch.device(device)
    config = config_for(size)
    kw = flux_inputs(config, TOKENS["img"], TOKENS["txt"], dev, torch.bfloat16)
    res: Dict[str, Any] = {"row": name, "rank": rank, "world": world}
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
    model = build_in_memory(config, dev)
    res.update(largest_block_bytes(model))
    res["model_bytes"] = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    t0 = time.perf_counter()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        compiled = compile_dit(model, passes=row_passes(name, world), example_inputs=kw)
        del model
        gc.collect()
        torch.cuda.synchronize()
        res.update(peak_bytes=torch.cuda.max_memory_allocated() - base,
                   final_bytes=torch.cuda.memory_allocated() - base,
                   measure="torch.cuda.max_memory_allocated / memory_allocated, less the allocation before the model")
    else:
        meter = LiveTensorBytes()
        for t in model.state_dict().values():  # the model's own storages, there before lowering starts
            meter.track(t)
        with meter:
            compiled = compile_dit(model, passes=row_passes(name, world), example_inputs=kw)
            del model
            gc.collect()
        res.update(peak_bytes=meter.peak, final_bytes=meter.live,
                   measure="LiveTensorBytes: the model's storages and those created while preparing, live")
    res["seconds"] = round(time.perf_counter() - t0, 2)
    report = compiled.memory_report()
    res.update(report_bytes=report.total, by_kind=report.by_kind, released_bytes=report.released_bytes,
               released=len(compiled.released), bytes_read=0)
    res["bound_bytes"] = max(res["model_bytes"], res["final_bytes"]) + res["block_bytes"]
    res["within_bound"] = res["peak_bytes"] <= res["bound_bytes"]
    return res


def run_rows(rows: List[str], size: str, checkpoint: str, device: str, budget_s: float,
             log_fn: Callable[..., None] = log, source: str = "checkpoint") -> Dict[str, Any]:
    """Each row in fresh processes (``tp2``: two gloo ranks); a row failing or not started in ``budget_s`` is noted.
    ``source="memory"``: :func:`prepare_in_memory_row` (no checkpoint)."""
    from dit_passes.testing.multiproc import run_ranks

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import prep_peak_memory as mod  # importable by the rank processes (not __main__'s)
    by_module = mod.prepare_in_memory_row if source == "memory" else mod.prepare_row

    t0, out, errors, skipped = time.perf_counter(), {}, {}, []
    for name in rows:
        if time.perf_counter() - t0 > budget_s:
            skipped.append(name)
            continue
        try:
            args = (name, size, device) if source == "memory" else (name, size, checkpoint, device)
            out[name] = run_ranks(by_module, WORLD.get(name, 1), *args, timeout=900, fresh=True)
        except Exception as e:  # noqa: BLE001 - one failing row must not lose the others
            errors[name] = f"{type(e).__name__}: {str(e)[-1500:]}"
        log_fn(name, out.get(name) or errors[name])
    return {"rows": out, "errors": errors, "skipped": skipped}


def markdown(r: Dict[str, Any]) -> str:
    unit, uname = (GIB, "GiB") if r["size"] == "full" else (2 ** 20, "MiB")
    ck = r["checkpoint"]
    if ck is None:  # --from memory
        lines = [f"# Peak memory while quantizing FLUX in memory ({r['size']}, {r['device']})", "",
                 f"Command: `{r['command']}`", "",
                 f"Model: {r['model']}; random bf16 weights made on the device, then `compile_dit(model, passes=[...], "
                 f"example_inputs=...)`, the caller's reference dropped. Peak and final count from before the model "
                 f"existed (the model's {r['model_bytes'] / unit:.3f} {uname} included). Measure: {r['measure']}.", "",
                 f"Bound: peak <= max(model, final) + one bf16 block (the largest, `{r['block']}`: "
                 f"{r['block_bytes'] / unit:.3f} {uname}). `memory_report`: `compiled.memory_report().total`.", ""]
    else:
        how = "written" if ck["written"] else "already there, written earlier"
        lines = [f"# Peak memory while preparing FLUX from a checkpoint ({r['size']}, {r['device']})", "",
                 f"Command: `{r['command']}`", "",
                 f"Model: {r['model']}. Checkpoint: {ck['bytes'] / unit:.3f} {uname} bf16 in {ck['files']} "
                 f"safetensors files, {how} in {ck['seconds']} s ({ck['generate_seconds']} s making the random "
                 f"values; {ck['write_gb_per_s']} GB/s writing). Measure: {r['measure']}.", "",
                 f"Bound: peak <= final + one bf16 block (the largest, `{r['block']}`: "
                 f"{r['block_bytes'] / unit:.3f} {uname}). `memory_report`: `compiled.memory_report().total`.", ""]
    lines += [
             f"| row | rank | peak {uname} | final {uname} | memory_report {uname} | peak - final {uname} | "
             f"bound {uname} | within | read {uname} | lowering s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, ranks in r["rows"].items():
        for x in ranks:
            lines.append(f"| {name} | {x['rank']}/{x['world']} | {x['peak_bytes'] / unit:.3f} | "
                         f"{x['final_bytes'] / unit:.3f} | {x['report_bytes'] / unit:.3f} | "
                         f"{(x['peak_bytes'] - x['final_bytes']) / unit:.3f} | {x['bound_bytes'] / unit:.3f} | "
                         f"{'yes' if x['within_bound'] else 'NO'} | {x['bytes_read'] / unit:.3f} | {x['seconds']} |")
    for name, err in r["errors"].items():
        lines.append(f"| {name} | failed: {err[-300:]} | | | | | | | | |")
    if r["skipped"]:
        lines += ["", f"Skipped (time budget): {', '.join(r['skipped'])}"]
    lines += ["", f"Host: torch {r['torch']}, Python {r['python']}. Total {r['total_s']:.0f} s.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=("full", "tiny"), default="full")
    ap.add_argument("--from", dest="source", choices=("checkpoint", "memory"), default="checkpoint",
                    help="checkpoint: a meta model lowered from a random checkpoint; memory: a bf16 model with random "
                         "weights already on the device, quantized in place (rows of %s)" % (MEMORY_ROWS,))
    ap.add_argument("--rows", default=None, help=f"of {ROWS} (--from memory: of {MEMORY_ROWS}); default: all")
    ap.add_argument("--checkpoint", default=None, help="directory of the random checkpoint (default: under /tmp)")
    ap.add_argument("--device", default=None, help="default: cuda for full, cpu for tiny")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no row after this many seconds (default: 150 for full, none for tiny)")
    ap.add_argument("--out", default=None, help="path without .json / .md (default bench/results/prep_peak_memory, "
                                                "--from memory: bench/results/prep_peak_memory_in_memory)")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "prep_peak_memory"
                                + ("_in_memory" if args.source == "memory" else ""))
    known = MEMORY_ROWS if args.source == "memory" else ROWS
    rows = [x for x in (args.rows or ",".join(known)).split(",") if x]
    if set(rows) - set(known):
        ap.error(f"unknown rows {sorted(set(rows) - set(known))} for --from {args.source}; known: {known}")
    device = args.device or ("cuda" if args.size == "full" else "cpu")
    checkpoint = args.checkpoint or f"/tmp/dit_passes_prep_peak_{args.size}"
    t0 = time.perf_counter()
    config = config_for(args.size)
    ckpt = None
    if args.source == "checkpoint":
        ckpt = write_checkpoint(config, checkpoint, torch.device(device))
        log("checkpoint", ckpt)
    model = build_meta(config)
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    r: Dict[str, Any] = {
        "command": " ".join(["python", "bench/prep_peak_memory.py"] + (argv if argv is not None else sys.argv[1:])),
        "size": args.size, "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "python": platform.python_version(), "config": config,
        "model": f"FluxDiT ({config['num_layers']} + {config['num_single_layers']} blocks, hidden "
                 f"{config['attention_head_dim'] * config['num_attention_heads']}), bf16, "
                 + ("built on the meta device" if ckpt else "in memory"),
        "checkpoint": ckpt, "source": args.source, "model_bytes": model_bytes, **largest_block_bytes(model),
        "measure": ("torch.cuda.max_memory_allocated (reset before) / memory_allocated after, less the allocation "
                    "before" if device.startswith("cuda") else "LiveTensorBytes (module docstring)")}
    budget = args.budget_s if args.budget_s is not None else (150.0 if args.size == "full" else float("inf"))
    r.update(run_rows(rows, args.size, checkpoint, device, budget, source=args.source))
    r["total_s"] = time.perf_counter() - t0
    r["all_within_bound"] = all(x["within_bound"] for ranks in r["rows"].values() for x in ranks)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(r, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(r))
    log(markdown(r))
    return 0 if not r["errors"] and r["all_within_bound"] else 1


if __name__ == "__main__":
    sys.exit(main())
