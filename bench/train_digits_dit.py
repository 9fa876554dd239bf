"""Train the embedded digits Flux DiT (``dit_passes.models.digits``) on CPU and write its asset.

Two stages, both deterministic for a given ``--seed`` and thread count:

1. a tiny ``AutoencoderKL`` (16x16x1 <-> 8x8x4) on the upsampled sklearn digits, MSE + small KL;
   its latent mean / std over the data set become ``shift_factor`` / ``1 / scaling_factor``;
2. the ``FluxTransformer2DModel`` with rectified flow: ``x_t = (1 - t) x0 + t * noise``,
   ``t ~ U(0, 1)``, regress the velocity ``noise - x0`` (the quantity FlowMatchEulerDiscreteScheduler
   integrates). The latents are packed exactly as FluxPipeline packs them and the timestep is given as
   ``t`` (FluxPipeline passes ``sigma = timestep / 1000``). Labels are dropped to the null class with
   probability ``--label-dropout`` so true CFG is possible. An EMA of the weights is what gets saved.

Then it samples 20 images per class through FluxPipeline (28 steps) and reports the accuracy of a
logistic-regression digit classifier on them; ``--grid`` writes a PNG of those samples.

    python bench/train_digits_dit.py --out dit_passes/assets --grid /tmp/digits_grid.png
"""
from __future__ import annotations

import argparse
import copy
import math
import time

import torch
import torch.nn.functional as F

from dit_passes.models import digits  # dit_passes installed (`pip install -e .`)


def cosine_lr(step: int, total: int, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))


def train_vae(images: torch.Tensor, steps: int, batch: int, lr: float, kl_weight: float, gen: torch.Generator):
    vae = digits.build_vae()
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    x_all = images * 2.0 - 1.0  # VaeImageProcessor convention: pixels in [-1, 1]
    running = 0.0
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, steps, lr, warmup=50)
        x = x_all[torch.randint(0, x_all.shape[0], (batch,), generator=gen)]
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample(generator=gen)).sample
        mse = F.mse_loss(rec, x)
        loss = mse + kl_weight * post.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        running += mse.item()
        if (step + 1) % 100 == 0:
            print(f"vae step {step + 1:5d}  recon mse {running / 100:.5f}", flush=True)
            running = 0.0
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        mean = vae.encode(x_all).latent_dist.mode()
        shift, std = mean.mean().item(), mean.std().item()
        vae.register_to_config(shift_factor=shift, scaling_factor=1.0 / std)
        rec = vae.decode(mean).sample
        rec_mse = F.mse_loss((rec / 2 + 0.5).clamp(0, 1), images).item()
    print(f"vae done: latent mean {shift:.4f} std {std:.4f}; full-data recon mse (0..1 scale) {rec_mse:.5f}")
    # FluxPipeline decodes latents / scaling_factor + shift_factor, so the DiT sees (mean - shift) * scale.
    return vae, (mean - shift) / std, rec_mse


def train_dit(latents: torch.Tensor, labels: torch.Tensor, cond: digits.ClassConditioner, args,
              gen: torch.Generator):
    from diffusers import FluxPipeline

    model = digits.build_transformer()
    model.train()
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    n, c, h, w = latents.shape
    packed = FluxPipeline._pack_latents(latents, n, c, h, w)                       # [N, h/2*w/2, 4c]
    img_ids = FluxPipeline._prepare_latent_image_ids(args.batch, h // 2, w // 2, "cpu", torch.float32)
    txt_ids = torch.zeros(digits.TEXT_TOKENS, 3)
    curve, running, t0 = [], 0.0, time.time()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, args.steps, args.lr, warmup=100)
        idx = torch.randint(0, n, (args.batch,), generator=gen)
        x0, y = packed[idx], labels[idx].clone()
        y[torch.rand(args.batch, generator=gen) < args.label_dropout] = digits.NULL_LABEL
        t = torch.rand(args.batch, generator=gen)
        noise = torch.randn(x0.shape, generator=gen)
        xt = (1.0 - t[:, None, None]) * x0 + t[:, None, None] * noise
        prompt, pooled = cond(y)
        pred = model(hidden_states=xt, encoder_hidden_states=prompt, pooled_projections=pooled, timestep=t,
                     img_ids=img_ids, txt_ids=txt_ids, return_dict=False)[0]
        loss = F.mse_loss(pred, noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        decay = min(args.ema, (1.0 + step) / (10.0 + step))
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), model.parameters()):
                pe.lerp_(pm, 1.0 - decay)
        running += loss.item()
        if (step + 1) % args.log_every == 0:
            avg = running / args.log_every
            curve.append([step + 1, round(avg, 5)])
            print(f"dit step {step + 1:5d}  loss {avg:.4f}  lr {opt.param_groups[0]['lr']:.2e}  "
                  f"{time.time() - t0:6.1f}s", flush=True)
            running = 0.0
    return ema.eval(), curve


def evaluate(pipe, cond, per_class: int, seed: int, grid: str | None, cfg_scale: float):
    """Classifier accuracy of 28-step samples, without and with true CFG; optional PNG (rows = classes)."""
    clf = digits.fit_digit_classifier()
    labels = [c for c in range(digits.NUM_CLASSES) for _ in range(per_class)]
    images = digits.sample(pipe, labels, seed=seed, steps=28, cond=cond)
    acc = float((digits.classify(clf, images) == torch.tensor(labels).numpy()).mean())
    cfg_images = digits.sample(pipe, labels, seed=seed, steps=28, cond=cond, true_cfg_scale=cfg_scale)
    cfg_acc = float((digits.classify(clf, cfg_images) == torch.tensor(labels).numpy()).mean())
    real, real_y = digits.load_digit_images()
    real_acc = float((digits.classify(clf, real) == real_y.numpy()).mean())
    if grid:
        from PIL import Image

        # rows = classes, columns = samples, a 2-pixel gap between tiles, 4x nearest upscaling
        padded = F.pad(images, (1, 1, 1, 1))
        hp, wp = padded.shape[-2:]
        arr = padded.reshape(digits.NUM_CLASSES, per_class, hp, wp).permute(0, 2, 1, 3)
        arr = arr.reshape(digits.NUM_CLASSES * hp, per_class * wp)
        img = Image.fromarray((arr.numpy() * 255).round().astype("uint8"))
        img.resize((img.width * 4, img.height * 4), Image.NEAREST).save(grid)
        print(f"wrote {grid}")
    return acc, cfg_acc, real_acc


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2400, help="DiT training steps")
    p.add_argument("--vae-steps", type=int, default=500)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--vae-lr", type=float, default=2e-3)
    p.add_argument("--kl-weight", type=float, default=1e-5)
    p.add_argument("--label-dropout", type=float, default=0.1)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads (<= 2 on the shared machine)")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--eval-per-class", type=int, default=20)
    p.add_argument("--eval-cfg", type=float, default=2.0, help="true_cfg_scale of the second evaluation")
    p.add_argument("--out", default=str(digits.ASSET_DIR), help="asset directory to write")
    p.add_argument("--grid", default=None, help="optional PNG of the evaluation samples")
    args = p.parse_args(argv)
    for name in ("steps", "vae_steps", "batch", "threads", "log_every", "eval_per_class"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    t_start = time.time()
    images, labels = digits.load_digit_images()
    vae, latents, vae_mse = train_vae(images, args.vae_steps, args.batch, args.vae_lr, args.kl_weight, gen)
    t_vae = time.time() - t_start
    cond = digits.ClassConditioner(*digits.make_class_table())
    transformer, curve = train_dit(latents, labels, cond, args, gen)
    t_train = time.time() - t_start

    pipe = digits.build_pipeline(transformer, vae)
    acc, cfg_acc, real_acc = evaluate(pipe, cond, args.eval_per_class, seed=args.seed + 1, grid=args.grid,
                                      cfg_scale=args.eval_cfg)
    n_params = sum(p.numel() for p in transformer.parameters())
    print(f"classifier accuracy on samples {acc:.3f}, with true CFG {args.eval_cfg} {cfg_acc:.3f} "
          f"(on real digits {real_acc:.3f}); "
          f"transformer params {n_params}; train time {t_train:.0f}s (vae {t_vae:.0f}s)")
    meta = {
        "training": {
            "seed": args.seed, "dit_steps": args.steps, "vae_steps": args.vae_steps, "batch": args.batch,
            "lr": args.lr, "label_dropout": args.label_dropout, "ema": args.ema, "threads": args.threads,
            "objective": "rectified flow, v = noise - x0, t ~ U(0,1), x_t = (1-t) x0 + t noise",
            "train_seconds": round(t_train, 1), "vae_recon_mse": round(vae_mse, 6),
            "final_loss": curve[-1][1] if curve else None, "loss_curve": curve,
        },
        "eval": {"classifier_accuracy": acc, "classifier_accuracy_true_cfg": cfg_acc,
                 "true_cfg_scale": args.eval_cfg, "classifier_accuracy_real_digits": real_acc,
                 "samples_per_class": args.eval_per_class, "steps": 28, "seed": args.seed + 1},
        "transformer_params": n_params,
    }
    weights, cfg = digits.save_asset(args.out, transformer, vae, cond, meta)
    print(f"wrote {weights} ({weights.stat().st_size / 2**20:.2f} MiB) and {cfg}")


if __name__ == "__main__":
    main()
