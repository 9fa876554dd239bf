"""cache-dit's torchao quant types on a GPU: ``int8_weight_only``, ``float8_weight_only``,
``int8_per_tensor``, ``float8_per_block`` (and the earlier ``float8_per_row`` / ``int8_per_row`` for scale).

For each type, a small FLUX transformer (hidden 1024, 2 + 2 blocks, bf16, on CUDA) quantized through
``enable_cache(..., quantize_config=QuantizeConfig(quant_type=...))``: the relative error of its output against the
unquantized bf16 output, the same against the CPU fp32 reference of the same quantized graph (the CUDA paths:
``torch._int_mm`` for int8, the graph forms for fp8 / weight-only), the bytes of the quantized block linears, and
the median time of one forward (eager graph, no torch.compile). Run::

    .venv/bin/python -P bench/quant_types_gpu_check.py

It prints one line per type; no GPU: it says so and exits 0.
"""
from __future__ import annotations

import statistics
import time

import torch


def flux(dtype, device):
    from diffusers import FluxTransformer2DModel
    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2,
                                  attention_head_dim=128, num_attention_heads=8, joint_attention_dim=512,
                                  pooled_projection_dim=256, guidance_embeds=True,
                                  axes_dims_rope=(16, 56, 56)).to(device, dtype).eval()


def inputs(dtype, device):
    g = torch.Generator().manual_seed(1)
    kw = dict(hidden_states=torch.randn(1, 1024, 64, generator=g), encoder_hidden_states=torch.randn(1, 128, 512,
                                                                                                  generator=g),
              pooled_projections=torch.randn(1, 256, generator=g), timestep=torch.tensor([0.5]),
              img_ids=torch.zeros(1024, 3), txt_ids=torch.zeros(128, 3), guidance=torch.tensor([3.5]))
    out = {k: v.to(device, dtype if v.is_floating_point() and k not in ("img_ids", "txt_ids") else v.dtype)
           for k, v in kw.items()}
    return dict(out, return_dict=False)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def main() -> None:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return
    from dit_passes.frontend import QuantizeConfig, enable_cache
    kw, kw_cpu = inputs(torch.bfloat16, "cuda"), inputs(torch.float32, "cpu")
    with torch.no_grad():
        base = flux(torch.bfloat16, "cuda")(**kw)[0]
    for qt in ("float8_per_row", "int8_per_row", "int8_weight_only", "float8_weight_only", "int8_per_tensor",
               "float8_per_block"):
        gpu = enable_cache(flux(torch.bfloat16, "cuda"), quantize_config=QuantizeConfig(quant_type=qt))
        cpu = enable_cache(flux(torch.float32, "cpu"), quantize_config=QuantizeConfig(quant_type=qt))
        with torch.no_grad():
            out, ref = gpu(**kw)[0], cpu(**kw_cpu)[0]
            times = []
            for _ in range(10):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                gpu(**kw)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        tables = sum(b.numel() * b.element_size() for n, b in gpu.graph_module.named_buffers()
                     if n.endswith((".qweight", ".wscale")))
        print(f"{qt:20s} err vs bf16 {rel(out, base):.2e}  vs CPU fp32 reference {rel(out, ref.to(out.device)):.2e}  "
              f"tables {tables / 2**20:.1f} MiB  forward {statistics.median(times) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
