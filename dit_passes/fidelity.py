"""Fidelity harness: how far does a transformed DiT drift from the original on real trajectories?

Each *config* maps the original transformer to a drop-in replacement (a CompiledDiT with a residual
cache, a wrapper, ...). :func:`run_fidelity` samples the trained digits Flux model
(:mod:`dit_passes.models.digits`) through FluxPipeline with the baseline (the unmodified transformer)
and with every config, from the same seeds and labels, and reports PSNR / SSIM against the baseline,
wall time, and whatever the replacement reports about itself.

Optional self-report: a replacement module may define ``fidelity_stats() -> dict``. It is called once
after every sampling run (one pipeline call = one seed; :func:`~dit_passes.models.digits.sample` calls
``new_generation()`` before the run when the module has it) and should describe that run. Numeric
scalars are averaged over runs into ``stats_mean``; every dict is kept in ``stats``. Two keys are
plotted when present:

* ``step_diffs``: list (one entry per transformer call of the run) of the residual-change measure the
  cache decided on (``None`` where nothing was measured, e.g. warm-up steps);
* ``step_cached``: list of bools, same length: ``True`` where the middle blocks were skipped.

Outputs in ``out_dir``: ``fidelity_grid.png`` (baseline row, then one row per config),
``fidelity_steps.png`` (only if some config reported ``step_diffs``), ``fidelity_report.json``.
Non-finite floats are written to JSON as the strings ``"inf"`` / ``"-inf"`` / ``"nan"``.
"""
from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F

GRID_NAME = "fidelity_grid.png"
PLOT_NAME = "fidelity_steps.png"
REPORT_NAME = "fidelity_report.json"
GRID_SCALE = 4  # each image pixel is a GRID_SCALE x GRID_SCALE square in the grid (nearest neighbour)
GRID_GAP = 6    # pixels between the grid's rows


def _check_pair(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{what}: shapes differ, {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.dim() != 4 or a.shape[1] != 1:
        raise ValueError(f"{what}: expected grayscale images [B,1,H,W], got shape {tuple(a.shape)}")


def psnr(a: torch.Tensor, b: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """Per-image PSNR in dB, [B] float64, of [B,1,H,W] images; ``inf`` where an image pair is identical."""
    _check_pair(a, b, "psnr")
    mse = (a.double() - b.double()).pow(2).flatten(1).mean(1)
    return 10.0 * torch.log10(data_range ** 2 / mse)  # mse == 0 -> +inf, as the definition says


def gaussian_window(size: int = 11, sigma: float = 1.5) -> torch.Tensor:
    """Normalised 2-D Gaussian window [1,1,size,size] (float64), the one of Wang et al. (2004)."""
    if size < 1 or size % 2 == 0:
        raise ValueError(f"window size must be a positive odd int, got {size}")
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-x.pow(2) / (2 * sigma ** 2))
    g = g / g.sum()
    return (g[:, None] * g[None, :])[None, None]


def ssim(a: torch.Tensor, b: torch.Tensor, data_range: float = 1.0, window_size: int = 11,
         sigma: float = 1.5) -> torch.Tensor:
    """Per-image SSIM, [B] float64, of [B,1,H,W] images (Gaussian window, K1=0.01, K2=0.03).

    Local statistics use the window without padding ("valid"), i.e. only positions where the whole
    window lies inside the image, and population (not sample) variances: the original definition.
    Identical images give exactly 1. Images smaller than the window are an error.
    """
    _check_pair(a, b, "ssim")
    if min(a.shape[-2:]) < window_size:
        raise ValueError(f"ssim: images {tuple(a.shape[-2:])} are smaller than the {window_size}x{window_size} "
                         "window; pass a smaller window_size")
    w = gaussian_window(window_size, sigma).to(a.device)
    x, y = a.double(), b.double()
    mu_x, mu_y = F.conv2d(x, w), F.conv2d(y, w)
    var_x = F.conv2d(x * x, w) - mu_x ** 2
    var_y = F.conv2d(y * y, w) - mu_y ** 2
    cov = F.conv2d(x * y, w) - mu_x * mu_y
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    num = (2 * mu_x * mu_y + c1) * (2 * cov + c2)
    den = (mu_x ** 2 + mu_y ** 2 + c1) * (var_x + var_y + c2)
    return (num / den).flatten(1).mean(1)


def _jsonable(value):
    """Plain-JSON copy of a stats value: tensors/arrays to lists, non-finite floats to strings."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().tolist()
    elif hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()  # numpy arrays and scalars
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _mean_scalar_stats(runs: Sequence[dict]) -> dict:
    keys = sorted({k for r in runs for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    out = {}
    for k in keys:
        vals = [float(r[k]) for r in runs if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)]
        out[k] = sum(vals) / len(vals)
    return out


# sampler(transformer or None, seed, steps) -> images [B, C, H, W] in [0, 1] on the CPU; None: the pipeline's own
Sampler = Callable[[Optional[torch.nn.Module], int, int], torch.Tensor]


def digits_sampler(pipe, labels: Sequence[int], true_cfg_scale: float = 1.0) -> Sampler:
    """The trained digits DiT's pipeline: one image per label (``models.digits.sample``)."""
    from .models.digits import sample

    return lambda transformer, seed, steps: sample(pipe, labels, seed, steps=steps, transformer=transformer,
                                                   true_cfg_scale=true_cfg_scale)


def pipeline_sampler(pipe, **call_kwargs: Any) -> Sampler:
    """Any diffusers pipeline: ``pipe(**call_kwargs)`` (prompts, sizes, guidance: whatever the pipeline takes),
    with the transformer under test in a fresh pipeline of the same class sharing every other component (``pipe``
    itself is never modified), the seed's CPU generator and ``steps`` steps; images (video frames flattened into
    the batch) as float32 in [0, 1]."""
    from .models.digits import pipeline_with

    def run(transformer, seed: int, steps: int) -> torch.Tensor:
        runner = pipeline_with(pipe, transformer)
        with torch.no_grad():
            out = runner(**call_kwargs, num_inference_steps=steps, output_type="pt", return_dict=False,
                         generator=torch.Generator("cpu").manual_seed(int(seed)))[0]
        out = torch.as_tensor(out).float().cpu()
        return out.reshape(-1, *out.shape[-3:]).clamp(0.0, 1.0)
    return run


def _sample_all(sampler: Sampler, module, seeds, steps):
    """Images of every seed (concatenated), per-run seconds, per-run stats of ``module``."""
    images, seconds, stats = [], [], []
    stats_fn = getattr(module, "fidelity_stats", None) if module is not None else None
    for seed in seeds:
        t0 = time.perf_counter()
        images.append(sampler(module, seed, steps))
        seconds.append(time.perf_counter() - t0)
        if callable(stats_fn):
            s = stats_fn()
            if not isinstance(s, Mapping):
                raise TypeError(f"fidelity_stats() must return a dict, got {type(s).__name__}")
            stats.append(dict(s))
    return torch.cat(images), seconds, stats


def _first_call(sampler: Sampler, module, seed) -> float:
    """Seconds of a one-step sampling run: the transformer's first call at the run's shapes, where lazy
    work happens (CompiledDiT: capture + passes). Timed runs come after it, in steady state."""
    t0 = time.perf_counter()
    sampler(module, seed, 1)
    return time.perf_counter() - t0


def _write_grid(rows: Sequence[tuple[str, torch.Tensor]], path: Path, scale: int = GRID_SCALE, max_columns: int = 40,
                gap: int = GRID_GAP) -> None:
    """One row per config (label on the left), samples side by side, each pixel a ``scale``-wide square
    (nearest-neighbour: no blur), ``gap`` pixels of background between rows."""
    from PIL import Image, ImageDraw, ImageFont

    n = min(rows[0][1].shape[0], max_columns)
    h, w = rows[0][1].shape[-2], rows[0][1].shape[-1] + 1  # +1: a dark-gray column between samples
    font = ImageFont.load_default()
    probe = ImageDraw.Draw(Image.new("L", (1, 1)))
    margin = 14 + max(int(probe.textlength(name, font=font)) for name, _ in rows)  # the longest label, whole
    row_h = h * scale + gap
    canvas = Image.new("L", (margin + n * w * scale, len(rows) * row_h - gap), color=64)  # gray: gaps show
    draw = ImageDraw.Draw(canvas)
    for r, (name, imgs) in enumerate(rows):
        tiles = F.pad(imgs[:n, 0].float().cpu(), (0, 1), value=0.25)
        strip = tiles.permute(1, 0, 2).reshape(h, n * w)  # [h, n*w], samples side by side
        tile = Image.fromarray((strip.clamp(0, 1).numpy() * 255).round().astype("uint8"))
        canvas.paste(tile.resize((n * w * scale, h * scale), Image.Resampling.NEAREST), (margin, r * row_h))
        top, bottom = draw.textbbox((0, 0), name, font=font)[1::2]
        draw.text((4, r * row_h + (h * scale - (bottom - top)) // 2 - top), name, fill=255, font=font)
    canvas.save(path)


def _write_step_plot(per_config_stats: Mapping[str, Sequence[dict]], path: Path) -> bool:
    series = {name: [r for r in runs if r.get("step_diffs") is not None]
              for name, runs in per_config_stats.items()}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return False
    try:
        import matplotlib
    except ImportError:  # an optional dependency (the dev extras): the report and the grid do not need it
        print(f"note: matplotlib is not installed, so {path.name} (per-step diffs) is not drawn; "
              f"`pip install matplotlib` to get it")
        return False

    matplotlib.use("Agg")  # headless; also safe if a backend was already chosen for files only
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(series), 1, figsize=(8, 2.6 * len(series)), squeeze=False)
    for ax, (name, runs) in zip(axes[:, 0], series.items()):
        for i, run in enumerate(runs):
            diffs = [float("nan") if d is None else float(d) for d in _jsonable(run["step_diffs"])]
            xs = list(range(len(diffs)))
            ax.plot(xs, diffs, marker=".", lw=1, alpha=0.8, label=f"run {i}" if len(runs) > 1 else "diff")
            cached = run.get("step_cached")
            if cached is not None:
                cached = [bool(c) for c in _jsonable(cached)]
                cx = [x for x, c in zip(xs, cached) if c]
                cy = [diffs[x] if x < len(diffs) and math.isfinite(diffs[x]) else 0.0 for x in cx]
                ax.scatter(cx, cy, marker="x", color="red", zorder=3, label="cached" if i == 0 else None)
            threshold = run.get("threshold")
            if i == 0 and isinstance(threshold, (int, float)):
                ax.axhline(float(threshold), color="gray", ls="--", lw=1, label="threshold")
        ax.set_title(name)
        ax.set_xlabel("transformer call")
        ax.set_ylabel("residual diff")
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def run_fidelity(configs: Mapping[str, Callable[[torch.nn.Module], torch.nn.Module]], seeds: Sequence[int],
                 labels: Sequence[int], steps: int = 28, out_dir: str | Path = "out/fidelity", *,
                 pipe=None, true_cfg_scale: float = 1.0, device: str | torch.device = "cpu",
                 sampler: Optional[Sampler] = None, timing_rounds: int = 0) -> dict:
    """Compare every config against the unmodified transformer on the digits DiT; write grid/plot/JSON.

    ``configs[name](original) -> module``: built once per config, then sampled for each seed with one
    image per label (so ``len(seeds) * len(labels)`` samples). ``pipe`` defaults to
    ``load_digits_pipeline(device)``'s. Another model: ``pipe=<its diffusers pipeline>`` and ``sampler=
    pipeline_sampler(pipe, prompt=[...], ...)`` (``labels`` then unused). A config that changes the original
    transformer's weights is an error (it would corrupt every later config), detected by comparing against a
    snapshot.

    Returns (and writes as ``fidelity_report.json``)::

        {"steps", "seeds", "labels", "num_samples", "true_cfg_scale",
         "baseline": {"wall_s", "per_run_s"},
         "configs": {name: {"psnr_mean", "psnr_min", "ssim_mean", "ssim_min", "max_abs_diff",
                            "identical_samples", "build_s", "capture_s", "wall_s", "per_run_s", "speedup",
                            "stats": [per-run dicts], "stats_mean": {...}}},
         "grid": path, "plot": path or None, "report": path}

    Every module (the baseline too) first samples one 1-step run at the run's shapes, so that lazy work
    (CompiledDiT's capture and passes) happens there; ``capture_s`` is the config's build time plus that
    first run, minus the baseline's first run. ``wall_s`` (all seeds) is measured after every config's first run,
    in steady state, the runs interleaved (per seed: the baseline, then each config); ``speedup`` is the median
    over those rounds and ``timing_rounds`` more (timed only, seeds reused) of the baseline's time / the config's
    in the same round: one short run on a shared CPU is noise, a median of interleaved ratios is not.
    """
    from .models.digits import load_digits_pipeline

    if not isinstance(configs, Mapping) or not all(isinstance(k, str) and callable(v) for k, v in configs.items()):
        raise TypeError("configs must be a dict {name: callable(original_transformer) -> nn.Module}")
    if "baseline" in configs:
        raise ValueError("'baseline' is reserved for the unmodified transformer; rename that config")
    seeds, labels = [int(s) for s in seeds], [int(x) for x in labels]
    if not seeds or (sampler is None and not labels):
        raise ValueError(f"need at least one seed and one label, got seeds={seeds} labels={labels}")
    if sampler is not None and pipe is None:
        raise ValueError("run_fidelity(sampler=...) needs pipe=: the pipeline whose transformer is the baseline")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if pipe is None:
        pipe, _ = load_digits_pipeline(device=device)
    sampler = sampler or digits_sampler(pipe, labels, true_cfg_scale)
    original = pipe.transformer
    snapshot = {k: v.detach().clone() for k, v in original.state_dict().items()}

    def check_original(name):
        released = [k for k, v in original.state_dict().items() if v.is_meta]
        if released:
            raise RuntimeError(f"config {name!r} released the original transformer's weights ({released[:3]}...: "
                               f"its passes replaced them); the other configs compare with the original: build it "
                               f"with compile_dit(..., keep_original=True)")
        changed = [k for k, v in original.state_dict().items() if not torch.equal(v, snapshot[k])]
        if changed:
            raise RuntimeError(f"config {name!r} modified the original transformer's weights "
                               f"({changed[:3]}...); a config must leave the original intact")

    base_first_s = _first_call(sampler, None, seeds[0])
    modules, build, first = {}, {}, {}
    for name, make in configs.items():  # build and lower every config first: capture stays out of the timed runs
        t0 = time.perf_counter()
        module = make(original)
        build[name] = time.perf_counter() - t0
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"config {name!r} returned {type(module).__name__}, expected an nn.Module")
        first[name] = _first_call(sampler, module, seeds[0])
        check_original(name)
        modules[name] = module
    # The timed runs interleave: per seed the baseline, then every config. A machine whose load changes during the
    # run (a shared CPU) then slows every row alike instead of whichever config ran at the time.
    runs = {name: {"images": [], "seconds": [], "stats": []} for name in ["baseline", *modules]}
    for seed in seeds:
        for name, run in runs.items():
            imgs, secs, stats = _sample_all(sampler, modules.get(name), [seed], steps)
            run["images"].append(imgs)
            run["seconds"] += secs
            run["stats"] += stats
    rounds = {name: list(run["seconds"]) for name, run in runs.items()}
    for r in range(max(0, int(timing_rounds))):
        for name in rounds:
            rounds[name] += _sample_all(sampler, modules.get(name), [seeds[r % len(seeds)]], steps)[1]
    for name in modules:
        check_original(name)
    base_imgs, base_s = torch.cat(runs["baseline"]["images"]), runs["baseline"]["seconds"]
    rows = [("baseline", base_imgs)]
    results, all_stats = {}, {}
    for name in modules:
        imgs, secs, stats = torch.cat(runs[name]["images"]), runs[name]["seconds"], runs[name]["stats"]
        p, s = psnr(imgs, base_imgs), ssim(imgs, base_imgs)
        wall = sum(secs)
        results[name] = {
            "psnr_mean": p.mean().item(), "psnr_min": p.min().item(),
            "ssim_mean": s.mean().item(), "ssim_min": s.min().item(),
            "max_abs_diff": (imgs - base_imgs).abs().max().item(),
            "identical_samples": int(torch.isinf(p).sum().item()),
            "build_s": build[name], "capture_s": max(0.0, build[name] + first[name] - base_first_s),
            "wall_s": wall, "per_run_s": secs,
            "speedup": statistics.median(b / c for b, c in zip(rounds["baseline"], rounds[name])),
            "timing_rounds": len(rounds[name]),
            "stats": stats, "stats_mean": _mean_scalar_stats(stats),
        }
        all_stats[name] = stats
        rows.append((name, imgs))

    grid = out / GRID_NAME
    _write_grid(rows, grid)
    plot = out / PLOT_NAME
    has_plot = _write_step_plot(all_stats, plot)
    report = {
        "steps": steps, "seeds": seeds, "labels": labels, "num_samples": int(base_imgs.shape[0]),
        "true_cfg_scale": true_cfg_scale,
        "baseline": {"wall_s": sum(base_s), "per_run_s": base_s, "first_call_s": base_first_s},
        "configs": results,
        "grid": str(grid), "plot": str(plot) if has_plot else None, "report": str(out / REPORT_NAME),
    }
    (out / REPORT_NAME).write_text(json.dumps(_jsonable(report), indent=1) + "\n")
    return report

