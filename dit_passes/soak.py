"""Soak: one served pipeline under a seeded stream of mixed requests, each output checked against the same request
run alone in a fresh process (``dit-passes soak``, ``bench/soak.py``).

Why it exists: the tests check one generation at a time. A server keeps one pipeline with ``enable_cache`` for
hours and sends it whatever comes: several resolutions, step counts, true CFG on and off, batch 1 and 2, a cache
config changed between requests (``refresh_context``), a generation abandoned half way (an exception from the step
callback), a resolution never seen before, a LoRA loaded and unloaded. Any state that leaks from one request into
the next (the residual cache's buffers, a graph kept for the wrong module, a cache context left entered) shows up
as an output that differs from the same request run alone; a leak shows up as resident memory that keeps growing;
an unbounded graph table as a graph count above the module's limit (``CompiledDiT.max_graphs``).

What it does:

1. :func:`make_stream` draws the requests (seeded): base specs from a pool covering every resolution, step count,
   CFG and batch; the cache config switches between phases of the stream; a few requests are interrupted at half
   their steps; a window of requests runs with a LoRA (loaded before the window, unloaded after it); one request
   late in the stream asks for a resolution no earlier request had.
2. :func:`reference` first runs each distinct request alone, in a separate process (``--reference-worker``, with
   trace reuse on: capture time only): a fresh pipeline (CPU: loaded again from the asset; CUDA: the same seeded
   transformer built once, a fresh pipeline and a fresh ``enable_cache`` each; its LoRA loaded before
   ``enable_cache``), so no state of the stream can reach it. Its outputs are in memory before the stream starts.
3. :func:`serve` runs them on one pipeline (``enable_cache`` once; ``refresh_context(pipe, cache_config=...)`` when
   a request's cache config differs from the last one's; ``pipe.load_lora_weights`` / ``unload_lora_weights`` at
   the window's ends) and records per request its output, latency, resident memory (RSS; on CUDA also
   ``torch.cuda.memory_allocated``) and the transformer's graph counts (``graph_stats``: kept, lowered, evicted).
   Each output is compared as it comes (bitwise on the CPU; relative max error within ``tolerance`` on the GPU)
   and dropped.
4. :func:`judge` writes the summary: ``requests``, ``mismatches``, ``memory_growth`` (RSS after the last request over RSS after the first
   20% of requests, minus 1), ``graphs_max``, ``graph_limit``, ``latency_ratio_max`` (max over warm requests of
   latency / the median latency of its shape's warm requests; warm: nothing was lowered during it, it was not
   interrupted), ``device``.

Commands: ``python -P bench/soak.py --threads 1`` (CPU, the digits DiT, 520 requests), ``--quick`` (24 requests),
``--model flux-tiny`` (the FLUX code path of the GPU run at a CPU size); on one H100 / H200:
``DIT_PASSES_REUSE_TRACES=1 python -P bench/soak.py --device cuda --model flux-dev-size`` (100 requests at
256-512 px, 3-8 steps; each lowering of the 12 B model captures for ~10 s, trace reuse cuts it; ``--requests 60`` if
the device call's time is short). A LoRA unloaded through ``pipe.unload_lora_weights()`` is checked: diffusers'
pipeline-level LoRA methods skip a component that is not a ``ModelMixin`` (the wrapper ``enable_cache`` puts in the
pipeline), so the LoRA stays; the event says so and the soak unloads it with ``pipe.transformer.unload_lora()``.

An interrupted request has no image: its latents at the interrupted step are compared instead (the reference is
interrupted at the same step). A LoRA request is also run alone without its LoRA (``lora_changes_output`` says the
LoRA changed the image, so a dropped LoRA cannot pass as a match).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .infra import env as process_env

# the cache configs a stream switches between (name -> (DBCacheConfig fields, TaylorSeer order or None));
# each caches some steps of the digits DiT at 4-12 steps, so a stale cache state would change the output
CACHE_CONFIGS: Dict[str, Tuple[Dict[str, Any], Optional[int]]] = {
    "f1b0": (dict(Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=2, residual_diff_threshold=0.12), None),
    "f2b1": (dict(Fn_compute_blocks=2, Bn_compute_blocks=1, max_warmup_steps=1, residual_diff_threshold=0.2,
                  max_continuous_cached_steps=2), None),
    "f1b0_taylorseer": (dict(Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=2,
                             residual_diff_threshold=0.15), 1),
}


@dataclasses.dataclass(frozen=True)
class Profile:
    """What a stream draws from, per model."""

    sizes: Tuple[int, ...]       # square resolutions, px
    unseen_size: int             # asked once, late in the stream
    steps: Tuple[int, ...]
    batches: Tuple[int, ...]
    cfg_scale: float             # true CFG's scale (the null class as the negative prompt)
    caches: Tuple[str, ...]      # CACHE_CONFIGS names, one per phase of the stream
    pool: int                    # distinct base specs (each one reference run per cache config it meets)
    requests: int
    interrupts: int
    lora: bool = True            # a LoRA window in the stream
    lora_rank: int = 4
    lora_std: float = 0.3        # LoRA A/B entries' scale: enough to change the image visibly


PROFILES = {
    "digits": Profile(sizes=(16, 24, 32), unseen_size=20, steps=(4, 6, 8, 12), batches=(1, 2), cfg_scale=3.0,
                      caches=("f1b0", "f2b1", "f1b0_taylorseer", "f1b0"), pool=16, requests=520, interrupts=3),
    "flux-dev-size": Profile(sizes=(256, 384, 512), unseen_size=320, steps=(3, 4, 6, 8), batches=(1, 2),
                             cfg_scale=2.0, caches=("f1b0", "f2b1"), pool=4, requests=100, interrupts=2,
                             lora_std=0.02),
    # the flux-dev-size code path at a size the CPU runs (dit_passes.bench's tiny FLUX): a smoke run of it
    "flux-tiny": Profile(sizes=(64, 96, 128), unseen_size=80, steps=(2, 3, 4, 5), batches=(1, 2), cfg_scale=2.0,
                         caches=("f1b0", "f2b1"), pool=4, requests=40, interrupts=2, lora_std=0.1),
}


@dataclasses.dataclass(frozen=True)
class Request:
    """One request. Everything but ``index`` is its spec: two requests with the same spec must give the same
    output, whatever ran before them."""

    index: int
    size: int
    steps: int
    cfg: bool
    batch: int
    labels: Tuple[int, ...]
    seed: int
    cache: str
    lora: Optional[int] = None           # the LoRA's seed, None: no LoRA
    interrupt_at: Optional[int] = None   # the step whose end callback raises

    def spec(self) -> Dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("index")
        out["labels"] = list(self.labels)
        return out

    def key(self) -> str:
        return json.dumps(self.spec(), sort_keys=True)

    def shape(self) -> str:
        """Requests of one shape cost the same: the latency baseline."""
        return f"{self.size}px/{self.steps}st/{'cfg' if self.cfg else 'nocfg'}/b{self.batch}" + \
            ("/lora" if self.lora is not None else "")

    @staticmethod
    def from_spec(spec: Dict[str, Any], index: int = -1) -> "Request":
        return Request(index=index, **{**spec, "labels": tuple(spec["labels"])})


def make_stream(profile: Profile, requests: int, seed: int) -> List[Request]:
    """The seeded stream: base specs from a pool that covers every size, step count, CFG and batch; the cache
    config by phase (``profile.caches``, equal parts); interrupts spread over the stream; a LoRA window over 8% of the stream starting at 60%; one request at ``unseen_size`` at 85%."""
    if requests < 4:
        raise ValueError(f"a soak stream needs at least 4 requests, got {requests}")
    rng = random.Random(seed)
    combos = [(s, n, c, b) for s in profile.sizes for n in profile.steps for c in (False, True)
              for b in profile.batches]
    rng.shuffle(combos)
    pool: List[Tuple[Any, ...]] = []
    for combo in combos:  # first every value of every axis at least once, then the rest in the shuffled order
        if any(v not in {p[k] for p in pool} for k, v in enumerate(combo)):
            pool.append(combo)
    pool = (pool + [c for c in combos if c not in pool])[:max(profile.pool, len(pool))]
    base = []
    for size, steps, cfg, batch in pool:
        base.append(dict(size=size, steps=steps, cfg=cfg, batch=batch,
                         labels=tuple(rng.randrange(10) for _ in range(batch)), seed=rng.randrange(2 ** 31)))
    phases = len(profile.caches)
    lora_lo, lora_hi = int(0.60 * requests), max(int(0.60 * requests) + 1, int(0.68 * requests))
    unseen = min(requests - 1, int(0.85 * requests))
    interrupts = {int(requests * (k + 0.5) / max(1, profile.interrupts)) for k in range(profile.interrupts)}
    stream = []
    for i in range(requests):
        spec = dict(rng.choice(base))
        phase = min(phases - 1, i * phases // requests)
        spec["cache"] = profile.caches[phase]
        if i == unseen:
            spec.update(size=profile.unseen_size, batch=1, labels=spec["labels"][:1])
        if profile.lora and lora_lo <= i < lora_hi and i != unseen:
            spec["lora"] = 1
        if i in interrupts and i != unseen:
            spec["interrupt_at"] = spec["steps"] // 2
        stream.append(Request(index=i, **spec))
    return stream


# ------------------------------------------------------------------------------------------ the models
def _build_digits(device: str):
    from .models.digits import load_digits_pipeline
    pipe, cond = load_digits_pipeline(device=device)
    return pipe, cond


def _flux_parts(size: str, device: str):
    """The FLUX transformer of ``dit_passes.bench``'s ``size`` ("full": the FLUX.1-dev config; "tiny": its small
    stand-in, for a CPU run of this code path) with random weights (seeded: the same in every process; bf16, fp32
    for the tiny one on the CPU) and the tables of the stand-in text conditioning."""
    from .bench import build_model
    from .models.digits import ClassConditioner
    dtype = torch.float32 if size == "tiny" and device == "cpu" else torch.bfloat16
    transformer = build_model(size, torch.device(device), dtype)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randn(11, 64, transformer.config.joint_attention_dim, generator=g)
    pooled = torch.randn(11, transformer.config.pooled_projection_dim, generator=g)
    return transformer, ClassConditioner(prompt, pooled).to(device=device, dtype=dtype)


def _flux_pipeline(transformer, device: str):
    """A FluxPipeline around ``transformer`` with a tiny random VAE (8x downsampling as FLUX's, the transformer's
    latent channels, seeded) and no text encoders (``prompt_embeds`` are passed in)."""
    from diffusers import AutoencoderKL
    from .models.digits import SCHEDULER_CONFIG, build_pipeline
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=transformer.config.in_channels // 4,
                            block_out_channels=(8, 8, 8, 8),
                            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                            layers_per_block=1, norm_num_groups=4, scaling_factor=0.3611, shift_factor=0.1159)
    vae = vae.to(device=device, dtype=transformer.dtype).eval().requires_grad_(False)
    return build_pipeline(transformer, vae, SCHEDULER_CONFIG)


class Model:
    """Builds fresh pipelines of one model (``name``: a PROFILES key) on one device. ``fresh()`` gives a new
    pipeline; the digits one is loaded again from the asset each time, the FLUX.1-dev-size one shares its
    transformer (built once: 12 B random parameters) with a new pipeline, VAE and ``enable_cache`` each time."""

    def __init__(self, name: str, device: str):
        if name not in PROFILES:
            raise ValueError(f"--model {name!r}: one of {sorted(PROFILES)}")
        if name == "flux-dev-size" and not device.startswith("cuda"):
            raise ValueError("--model flux-dev-size needs --device cuda (12 B parameters in bf16)")
        self.name, self.device = name, device
        self._transformer = self._cond = None

    def fresh(self):
        if self.name == "digits":
            return _build_digits(self.device)
        if self._transformer is None:
            self._transformer, self._cond = _flux_parts("full" if self.name == "flux-dev-size" else "tiny",
                                                        self.device)
        return _flux_pipeline(self._transformer, self.device), self._cond


def lora_state_dict(transformer, seed: int, rank: int, std: float) -> Dict[str, torch.Tensor]:
    """A random LoRA (diffusers' key format) on every attention's q / k / v / out projection of ``transformer``,
    seeded: the same in every process."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in ("to_q", "to_k", "to_v") or \
                isinstance(module, torch.nn.Linear) and name.endswith("attn.to_out.0"):
            a = torch.randn(rank, module.in_features, generator=g) * std
            b = torch.randn(module.out_features, rank, generator=g) * std
            dtype, device = module.weight.dtype, module.weight.device
            out[f"transformer.{name}.lora_A.weight"] = a.to(device=device, dtype=dtype)
            out[f"transformer.{name}.lora_B.weight"] = b.to(device=device, dtype=dtype)
    if not out:
        raise ValueError(f"{type(transformer).__name__} has no attention projections (to_q / to_k / to_v) for a LoRA")
    return out


def lora_layers(module: torch.nn.Module) -> int:
    """How many PEFT adapter layers ``module`` holds."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    return sum(isinstance(m, BaseTunerLayer) for m in module.modules())


def cache_kwargs(name: str) -> Dict[str, Any]:
    """``enable_cache`` / ``refresh_context`` keyword arguments of cache config ``name``."""
    from .frontend.api import DBCacheConfig, TaylorSeerCalibratorConfig
    fields, order = CACHE_CONFIGS[name]
    out: Dict[str, Any] = {"cache_config": DBCacheConfig(**fields)}
    if order is not None:
        out["calibrator_config"] = TaylorSeerCalibratorConfig(taylorseer_order=order)
    return out


class Interrupted(Exception):
    """Raised by the step callback of an interrupted request (as a server cancelling a generation would)."""


def run_request(pipe, cond, req: Request, cfg_scale: float) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(images, None)``, or ``(None, latents at the interrupted step)`` for a request interrupted half way."""
    prompt, pooled = cond(list(req.labels))
    kwargs = dict(prompt_embeds=prompt, pooled_prompt_embeds=pooled, height=req.size, width=req.size,
                  num_inference_steps=req.steps, guidance_scale=3.5,
                  generator=torch.Generator("cpu").manual_seed(req.seed), output_type="pt", return_dict=False)
    if req.cfg:
        neg, neg_pooled = cond.null(req.batch)
        kwargs.update(true_cfg_scale=cfg_scale, negative_prompt_embeds=neg, negative_pooled_prompt_embeds=neg_pooled)
    seen: Dict[str, torch.Tensor] = {}
    if req.interrupt_at is not None:
        def stop(_pipe, step, _t, tensors):
            if step == req.interrupt_at:
                seen["latents"] = tensors["latents"].detach().float().cpu().clone()
                raise Interrupted(f"request {req.index} cancelled at step {step} of {req.steps}")
            return tensors
        kwargs["callback_on_step_end"] = stop
    with torch.no_grad():
        try:
            images = pipe(**kwargs)[0]
        except Interrupted:
            return None, seen["latents"]
    if req.interrupt_at is not None:
        raise RuntimeError(f"request {req.index}: the step callback never reached step {req.interrupt_at}")
    return images.detach().float().cpu(), None


def _rss() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------ the served pipeline
def serve(model: Model, stream: Sequence[Request], profile: Profile, refs: Dict[str, Dict[str, Any]],
          tolerance: float, log: Optional[Callable[[str], None]] = None) -> Tuple[List[Dict[str, Any]],
                                                                                  Dict[str, Any]]:
    """Run ``stream`` on one pipeline, each output compared with its spec's in ``refs`` as it comes (the outputs
    are not kept: what the loop keeps per request is a small record, so the resident memory measured is the
    pipeline's); returns (per-request records, events)."""
    from .frontend.api import enable_cache, refresh_context
    pipe, cond = model.fresh()
    current = stream[0].cache
    enable_cache(pipe, **cache_kwargs(current))
    compiled = pipe.transformer
    events: Dict[str, Any] = {"refreshes": [], "lora": []}
    lora_loaded: Optional[int] = None
    records = []
    for req in stream:
        note = []
        if req.cache != current:
            kwargs = cache_kwargs(req.cache)
            if "calibrator_config" not in kwargs and "calibrator_config" in cache_kwargs(current):
                # refresh_context without a calibrator keeps the current one (cache-dit's rule): turn it off
                from .frontend.api import TaylorSeerCalibratorConfig
                kwargs["calibrator_config"] = TaylorSeerCalibratorConfig(enable_calibrator=False,
                                                                         enable_encoder_calibrator=False)
            refresh_context(pipe, **kwargs)
            events["refreshes"].append({"before": req.index, "from": current, "to": req.cache})
            current = req.cache
            note.append(f"refresh_context -> {req.cache}")
        if req.lora != lora_loaded:
            event: Dict[str, Any] = {"before": req.index}
            try:
                if lora_loaded is not None:
                    event["action"] = "unload"
                    pipe.unload_lora_weights()
                    event["status"] = "ok"
                    if lora_layers(compiled.original):
                        # diffusers' pipeline-level LoRA methods act on components that are ModelMixin subclasses;
                        # the wrapper enable_cache put in the pipeline is not one, so this call skipped it
                        compiled.unload_lora()
                        event["status"] = ("ignored: pipe.unload_lora_weights() left the LoRA layers in the wrapped "
                                           "transformer; unloaded with pipe.transformer.unload_lora()")
                if req.lora is not None:
                    event["action"] = "load"
                    sd = lora_state_dict(compiled.original, req.lora, profile.lora_rank, profile.lora_std)
                    pipe.load_lora_weights(sd, adapter_name=f"soak{req.lora}")
                    event["status"] = "ok" if lora_layers(compiled.original) else "ignored: no LoRA layer injected"
            except Exception as e:  # noqa: BLE001 - a refusal is a result: recorded and reported
                event.update(status="refused", error=f"{type(e).__name__}: {e}")
            events["lora"].append(event)
            lora_loaded = req.lora
            note.append(f"lora {event['action']}: {event['status']}")
        stats = compiled.graph_stats
        lowered_before = stats.lowered
        _sync(model.device)
        t0, c0 = time.perf_counter(), time.process_time()
        error = None
        try:
            images, latents = run_request(pipe, cond, req, profile.cfg_scale)
        except Exception as e:  # noqa: BLE001 - a failed request is a result (and a mismatch)
            images = latents = None
            error = f"{type(e).__name__}: {e}"
        _sync(model.device)
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
        ref = refs.get(req.key(), {})
        diff = difference(images if images is not None else latents, ref.get("output"))
        rec = dict(cpu_seconds=cpu_seconds, difference=diff, match=diff is not None and (diff == 0.0 if tolerance == 0.0 else diff <= tolerance),
                   reference_error=ref.get("error"), index=req.index, shape=req.shape(), spec=req.spec(), seconds=seconds,
                   status="error" if error else ("interrupted" if req.interrupt_at is not None else "ok"),
                   error=error, rss=_rss(), graphs=stats.graphs, lowered=stats.lowered, evicted=stats.evicted,
                   cold=stats.lowered != lowered_before, note="; ".join(note))
        if model.device.startswith("cuda"):
            rec["cuda_allocated"] = torch.cuda.memory_allocated()
        records.append(rec)
        if log is not None and (req.index % 50 == 0 or note or error or rec["cold"]):
            log(f"[{req.index}] {req.shape()} {seconds * 1e3:.0f} ms graphs={stats.graphs} lowered={stats.lowered} "
                f"rss={rec['rss'] / 2 ** 20:.0f} MiB {rec['status']} {rec['note']}{' ' + error if error else ''}")
    events["graph_limit"] = compiled.graph_stats.limit
    events["graph_stats"] = compiled.graph_stats.summary()
    return records, events


# ------------------------------------------------------------------------------------------ requests run alone
def run_alone(model: Model, specs: Sequence[Dict[str, Any]], profile: Profile,
              log: Optional[Callable[[str], None]] = None) -> Dict[str, Dict[str, Any]]:
    """Each spec alone: a fresh pipeline, its LoRA loaded, a fresh ``enable_cache``, the request; by spec key."""
    from .frontend.api import disable_cache, enable_cache
    out: Dict[str, Dict[str, Any]] = {}
    for spec in specs:
        req = Request.from_spec(spec)
        t0 = time.perf_counter()
        entry: Dict[str, Any] = {"output": None, "error": None}
        pipe = None
        try:
            pipe, cond = model.fresh()
            if req.lora is not None:
                sd = lora_state_dict(pipe.transformer, req.lora, profile.lora_rank, profile.lora_std)
                pipe.load_lora_weights(sd, adapter_name=f"soak{req.lora}")
            enable_cache(pipe, **cache_kwargs(req.cache))
            images, latents = run_request(pipe, cond, req, profile.cfg_scale)
            entry["output"] = images if images is not None else latents
        except Exception as e:  # noqa: BLE001 - recorded: the request is then a mismatch, with this reason
            entry["error"] = f"{type(e).__name__}: {e}"
        finally:
            if pipe is not None and model.name != "digits":  # the shared transformer back to its plain self
                disable_cache(pipe)
                if req.lora is not None:
                    pipe.unload_lora_weights()
            del pipe
            gc.collect()
        entry["seconds"] = time.perf_counter() - t0
        out[req.key()] = entry
        if log is not None:
            log(f"alone {req.shape()} cache={req.cache} {entry['seconds']:.1f} s {entry['error'] or ''}")
    return out


def reference_specs(stream: Sequence[Request]) -> List[Dict[str, Any]]:
    """The distinct specs of the stream, plus each LoRA spec without its LoRA (does the LoRA change the image?)."""
    seen: Dict[str, Dict[str, Any]] = {}
    for req in stream:
        seen.setdefault(req.key(), req.spec())
        if req.lora is not None:
            twin = dataclasses.replace(req, lora=None)
            seen.setdefault(twin.key(), twin.spec())
    return list(seen.values())


def reference(model_name: str, device: str, specs: Sequence[Dict[str, Any]], threads: Optional[int],
              log: Optional[Callable[[str], None]] = None) -> Dict[str, Dict[str, Any]]:
    """:func:`run_alone` in a new process (this module's ``--reference-worker``), same threads and environment."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "specs.json", Path(tmp) / "out.pt"
        spec_path.write_text(json.dumps(list(specs)))
        cmd = [sys.executable, "-P", "-m", "dit_passes.soak", "--reference-worker", str(spec_path), str(out_path),
               "--model", model_name, "--device", device]
        if threads is not None:
            cmd += ["--threads", str(threads)]
        # the reference captures each distinct request's graphs afresh: reusing traces across its pipelines
        # (dit_passes.infra.trace_templates) only saves capture time, the graphs are the same
        environment = {**process_env.snapshot(), process_env.REUSE_TRACES: "1"}
        proc = subprocess.run(cmd, stdout=None if log else subprocess.DEVNULL, env=environment)
        if proc.returncode != 0 or not out_path.is_file():
            raise RuntimeError(f"the reference process failed (exit status {proc.returncode}): {' '.join(cmd)}")
        return torch.load(out_path, weights_only=True)


# ------------------------------------------------------------------------------------------ judging
def difference(out: Optional[torch.Tensor], ref: Optional[torch.Tensor]) -> Optional[float]:
    """Max |out - ref| / max |ref| (0.0: bitwise equal); None where either is missing or the shapes differ."""
    if out is None or ref is None or out.shape != ref.shape:
        return None
    if torch.equal(out, ref):
        return 0.0
    scale = ref.abs().max().item() or 1.0
    return (out - ref).abs().max().item() / scale


def judge(records: List[Dict[str, Any]], refs: Dict[str, Dict[str, Any]], tolerance: float, device: str,
          graph_limit: Optional[int]) -> Dict[str, Any]:
    """The summary (the module docstring's fields and more) of the records :func:`serve` returned."""
    n = len(records)
    at = max(0, int(0.2 * n) - 1)
    growth = records[-1]["rss"] / records[at]["rss"] - 1.0
    warm = [r for r in records if r["status"] == "ok" and not r["cold"]]
    ratios = _ratios(warm, "seconds", "latency_ratio")
    # the same on the process's CPU time: what the request cost this process, without the time it waited for a core
    # (another process's load); a library stall (a lowering, a collection) shows in both
    cpu_ratios = _ratios(warm, "cpu_seconds", "cpu_ratio")
    summary: Dict[str, Any] = dict(
        requests=n, mismatches=sum(not r["match"] for r in records), memory_growth=round(growth, 5),
        graphs_max=max(r["graphs"] for r in records), graph_limit=graph_limit,
        latency_ratio_max=round(max(ratios), 3) if ratios else None, device=device)
    if device.startswith("cuda"):
        summary["cuda_allocated_growth"] = round(records[-1]["cuda_allocated"] / records[at]["cuda_allocated"] - 1, 5)
    lora_pairs = []
    for r in records:
        if r["spec"]["lora"] is not None:
            twin = json.dumps({**r["spec"], "lora": None}, sort_keys=True)
            lora_pairs.append(difference(refs.get(json.dumps(r["spec"], sort_keys=True), {}).get("output"),
                                         refs.get(twin, {}).get("output")))
    summary.update(
        cpu_time_ratio_max=round(max(cpu_ratios), 3) if cpu_ratios else None,
        lowered=records[-1]["lowered"], evicted=records[-1]["evicted"],
        cold_requests=sum(r["cold"] for r in records), warm_requests_timed=len(ratios),
        interrupted=sum(r["status"] == "interrupted" for r in records),
        errors=sum(r["status"] == "error" for r in records),
        lora_requests=len(lora_pairs),
        lora_changes_output=bool(lora_pairs) and all(d is not None and d > 0 for d in lora_pairs),
        rss_mib_at_20pct=round(records[at]["rss"] / 2 ** 20, 1), rss_mib_end=round(records[-1]["rss"] / 2 ** 20, 1),
        tolerance=tolerance)
    return summary


def _ratios(records: List[Dict[str, Any]], field: str, name: str) -> List[float]:
    """Each record's ``field`` over the median of its shape's (shapes with 3 or more records), stored as ``name``."""
    by_shape: Dict[str, List[float]] = {}
    for r in records:
        by_shape.setdefault(r["shape"], []).append(r[field])
    medians = {s: statistics.median(v) for s, v in by_shape.items() if len(v) >= 3}
    out = []
    for r in records:
        if r["shape"] in medians and medians[r["shape"]] > 0:
            r[name] = r[field] / medians[r["shape"]]
            out.append(r[name])
    return out


TARGETS = dict(mismatches=0, memory_growth=0.02, latency_ratio_max=3.0)


def verdicts(summary: Dict[str, Any]) -> Dict[str, bool]:
    out = dict(mismatches=summary["mismatches"] == 0, memory_growth=summary["memory_growth"] <= TARGETS["memory_growth"],
               graphs=summary["graph_limit"] is None or summary["graphs_max"] <= summary["graph_limit"],
               latency_ratio=summary["latency_ratio_max"] is not None and
               summary["latency_ratio_max"] <= TARGETS["latency_ratio_max"])
    if "cuda_allocated_growth" in summary:
        out["cuda_allocated_growth"] = summary["cuda_allocated_growth"] <= TARGETS["memory_growth"]
    return out


def markdown(result: Dict[str, Any]) -> str:
    s, env = result["summary"], result["environment"]
    ok = result["verdicts"]
    lines = [f"# Soak: one served pipeline, {s['requests']} mixed requests ({result['model']}, {s['device']})", "",
             f"Command: `{result['command']}`", "",
             f"Environment: torch {env['torch']}, {env['cpus']} CPUs, torch threads {env['threads']}, load average "
             f"before {env['load_before']}, after {env['load_after']}; {env.get('device_name', '')}; "
             f"served in {result['serve_seconds']:.0f} s, reference (each distinct request alone in a fresh process: "
             f"{result['reference_specs']} specs) in {result['reference_seconds']:.0f} s.", "",
             "| target | measured | met |", "|---|---|---|",
             f"| outputs differing from the request run alone ({'bitwise' if s['tolerance'] == 0 else 'rel. ' + str(s['tolerance'])}) = 0 "
             f"| {s['mismatches']} of {s['requests']} | {'yes' if ok['mismatches'] else '**no**'} |",
             f"| RSS growth after the first 20% <= 2% | {100 * s['memory_growth']:.2f}% ({s['rss_mib_at_20pct']} -> "
             f"{s['rss_mib_end']} MiB) | {'yes' if ok['memory_growth'] else '**no**'} |"]
    if "cuda_allocated_growth" in s:
        lines.append(f"| CUDA allocated growth <= 2% | {100 * s['cuda_allocated_growth']:.2f}% | "
                     f"{'yes' if ok['cuda_allocated_growth'] else '**no**'} |")
    lines += [f"| lowered graphs kept <= limit | max {s['graphs_max']} (limit {s['graph_limit']}; {s['lowered']} "
              f"lowerings, {s['evicted']} evicted) | {'yes' if ok['graphs'] else '**no**'} |",
              f"| latency / its shape's warm median <= 3 | max {s['latency_ratio_max']} ({s['warm_requests_timed']} "
              f"warm requests timed; on the process's CPU time: max {s['cpu_time_ratio_max']}) | "
              f"{'yes' if ok['latency_ratio'] else '**no**'} |", "",
              f"Stream: {s['interrupted']} interrupted half way, {s['lora_requests']} with a LoRA (LoRA changes the "
              f"image when run alone: {s['lora_changes_output']}), {s['cold_requests']} cold (a graph lowered during "
              f"them), {s['errors']} failed; cache configs by phase: {', '.join(result['profile']['caches'])}.", "",
              "Events:", ""]
    for e in result["events"]["refreshes"]:
        lines.append(f"- before request {e['before']}: `refresh_context` {e['from']} -> {e['to']}")
    for e in result["events"]["lora"]:
        lines.append(f"- before request {e['before']}: LoRA {e['action']}: {e['status']}"
                     + (f" ({e['error']})" if e.get("error") else ""))
    bad = [r for r in result["records"] if not r["match"]]
    if bad:
        lines += ["", f"Mismatches ({len(bad)}; first 20):", "", "| request | shape | cache | lora | status | "
                  "difference | note |", "|---|---|---|---|---|---|---|"]
        for r in bad[:20]:
            lines.append(f"| {r['index']} | {r['shape']} | {r['spec']['cache']} | {r['spec']['lora']} | {r['status']} "
                         f"| {r['difference']} | {r['error'] or r['reference_error'] or r['note']} |")
    shapes: Dict[str, List[float]] = {}
    for r in result["records"]:
        if "latency_ratio" in r:
            shapes.setdefault(r["shape"], []).append(r["seconds"])
    lines += ["", "Warm latency by shape (ms): median, max, requests", "", "| shape | median | max | n |",
              "|---|---|---|---|"]
    for shape in sorted(shapes):
        v = shapes[shape]
        lines.append(f"| {shape} | {1e3 * statistics.median(v):.1f} | {1e3 * max(v):.1f} | {len(v)} |")
    return "\n".join(lines) + "\n"


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def soak(model_name: str = "digits", device: str = "cpu", requests: Optional[int] = None, seed: int = 0,
         threads: Optional[int] = None, tolerance: Optional[float] = None, profile: Optional[Profile] = None,
         log: Optional[Callable[[str], None]] = None, command: str = "") -> Dict[str, Any]:
    """Serve a stream, run its requests alone in a fresh process, judge; the whole result (JSON-able)."""
    if threads is not None:
        torch.set_num_threads(threads)
    profile = profile or PROFILES[model_name]
    n = requests or profile.requests
    stream = make_stream(profile, n, seed)
    model = Model(model_name, device)
    if tolerance is None:
        tolerance = 1e-5 if device.startswith("cuda") else 0.0
    load_before = _load()
    specs = reference_specs(stream)
    t0 = time.perf_counter()
    # first, so that the outputs it holds are in memory before the soak's first RSS reading
    refs = reference(model_name, device, specs, threads, log)
    reference_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    records, events = serve(model, stream, profile, refs, tolerance, log)
    serve_seconds = time.perf_counter() - t0
    summary = judge(records, refs, tolerance, device, events["graph_limit"])
    env = dict(torch=torch.__version__, cpus=os.cpu_count(), threads=torch.get_num_threads(), load_before=load_before,
               load_after=_load(), python=platform.python_version())
    if device.startswith("cuda"):
        env["device_name"] = torch.cuda.get_device_name()
    return dict(summary=summary, verdicts=verdicts(summary), model=model_name, seed=seed, command=command,
                profile=dataclasses.asdict(profile), environment=env, serve_seconds=serve_seconds,
                reference_seconds=reference_seconds, reference_specs=len(specs), events=events, records=records)


def write(result: Dict[str, Any], out_dir: str, name: str) -> Tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / f"{name}.json", out / f"{name}.md"
    js.write_text(json.dumps(result, indent=1) + "\n")
    md.write_text(markdown(result))
    return js, md


def _worker_main(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    specs = json.loads(Path(args.reference_worker[0]).read_text())
    model = Model(args.model, args.device)
    refs = run_alone(model, specs, PROFILES[args.model], log=lambda m: print(m, flush=True))
    torch.save(refs, args.reference_worker[1])
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="dit-passes soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, choices=sorted(PROFILES),
                   help="digits (CPU default) or flux-dev-size (CUDA default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=None, help="stream length (default: the model's profile)")
    p.add_argument("--quick", action="store_true", help="a short smoke run of the same code path (24 requests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads, in both processes")
    p.add_argument("--tolerance", type=float, default=None,
                   help="max relative difference counted as a match (default: 0 = bitwise on CPU, 1e-5 on CUDA)")
    p.add_argument("--out", default="bench/results", help="folder for soak_{cpu,gpu}.{json,md}")
    p.add_argument("--name", default=None, help="file name stem (default soak_cpu / soak_gpu)")
    p.add_argument("--reference-worker", nargs=2, metavar=("SPECS", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.model = args.model or ("flux-dev-size" if args.device.startswith("cuda") else "digits")
    if args.reference_worker:
        return _worker_main(args)
    requests = args.requests or (24 if args.quick else None)
    command = "dit-passes soak " + " ".join(argv if argv is not None else sys.argv[1:])
    result = soak(args.model, args.device, requests, args.seed, args.threads, args.tolerance,
                  log=lambda m: print(m, flush=True), command=command.strip())
    name = args.name or ("soak_gpu" if args.device.startswith("cuda") else "soak_cpu")
    js, md = write(result, args.out, name)
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {js} and {md}")
    return 0 if all(result["verdicts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
