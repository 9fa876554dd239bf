"""NVFP4 SVDQuant on a GPU (run on the device): the tiny zoo Flux in bf16, DQ rank 8, the exact fp8 split GEMM
(``form="auto"`` on sm_89+) against the op (``form="op"``: the reference), and both against the bf16 model.

    python3 bench/nvfp4_gpu_check.py
"""
# model-level check on the GPU: the tiny Flux in bf16, NVFP4 DQ, the fp8 form (auto on sm_90) vs the op (reference)
import functools, torch, dit_passes
from dit_passes.models.zoo import build
from dit_passes.passes.quantize import SVDQuantW4A4
zm = build("flux", attention_head_dim=32, num_attention_heads=2, axes_dims_rope=(8, 12, 12))
m = zm.model.to("cuda", torch.bfloat16)
kw = {k: (v.to("cuda", torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else (v.to("cuda") if torch.is_tensor(v) else v)) for k, v in zm.make_inputs().items()}
with torch.no_grad():
    ref = m(**kw)[0].float()
def rel(a, b): return float((a.double() - b.double()).norm() / b.double().norm())
outs = {}
for setting in ("auto", "op"):
    c = dit_passes.compile_dit(m, passes=[SVDQuantW4A4(rank=8, dynamic=True, precision="nvfp4", form=setting)],
                               keep_original=True)
    with torch.no_grad():
        outs[setting] = c(**kw)[0].float()
    code = c.graph_module.code
    print(setting, "scaled_mm" in code, "svdq_nvfp4_linear" in code, "rel vs bf16 model", rel(outs[setting], ref))
print("fp8 form vs op", rel(outs["auto"], outs["op"]))
