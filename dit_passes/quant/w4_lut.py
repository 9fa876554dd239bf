"""SVDQuant W4 on Hopper through lookup tables: the stored int4 weights read by the GEMM itself, the group scales
in per-(row, K-group) tables of e4m3 values, the low-rank branch folded into K as two int4 digit planes: the
4-bit weights become e4m3 in the GEMM's producer with the group scales folded, and no expanded copy is written.

This module is the specification (ATen ops, any device) of ``kernels/w4a8_lut_cutlass.cu``'s GEMM and the load-time
transform that makes its operands from SVDQuant's stored tensors (qweight int4 [N, K/2], wscale [N, K/64],
lora_down [R, K], lora_up [N, R], smooth_inv [K], bias [N])::

    c[r]  = sqrt(K) ||lora_down[r]||_2                      (graph_forms.lrcat_c: |h[m, r]| <= amax|xs[m]| c[r])
    sw[n] = max(8 max_g wscale[n, g], HEADROOM max_r |lora_up[n, r] c[r]|) / 448
    T[g, n, i] = e4m3((i - 8) wscale[n, g] / sw[n]), i < 8  (the int4 groups' tables)
    code(q) = q & 15 (q <= 0) | 8 - q (q >= 1)              (code >= 8 reads T[code - 8], 1..7 reads -T[code], 0 is 0)
    branch: u = lora_up c / sw (|u| <= 448 / HEADROOM = 238); s[n] = 2^ceil(log2(max_r |u[n]| / 119)), >= 2^-13
            v = round(u / s) = 16 uh + ul, uh = floor((v + 8) / 16), ul = v - 16 uh   (both in [-8, 7])
            T_b[n, i] = e4m3((i - 8) 16 s[n])              (exact: a power of two times |i - 8| <= 8, <= 256)
    B = [code(q) | code(uh) | code(ul) | code(uh) | 0]       [N, K + C], C = 3R up to a multiple of 64

    per call:  xs = float(x) smooth_inv;  sx, qx = per-token e4m3 of xs (graph_forms.fp8_quantize)
               h = xd @ lora_down.T, xd = x.dtype(xs);  hs = clamp(h / (sx c), -448, 448)
               hi = e4m3(hs);  lo = e4m3(hs - hi);  hi16 = e4m3(hi / 16)
               A = [qx | hi | hi16 | lo | 0]                  [M, K + C]
               y = x.dtype(sx (sw (A @ B.T)) + bias)         (B's codes read through their tables)

The branch's planes share one table (16 s): ``hi 16 s uh + hi16 16 s ul + lo 16 s uh = s (hi + lo) 16 uh + s hi ul``,
which is ``s (hi + lo) v ~ hs u`` but for the dropped ``s lo ul`` (~2^-8 relative: lo / hi and ul / 16 uh are each
below 2^-4); hi / 16 is exact in e4m3 above its subnormals. So the branch keeps ~8 bits of h (as ``lrcat_split``'s hi /
lo pair) and ~7 of lora_up (an int8 grid per row; lrcat's e4m3 keeps 4 significant bits). The main weights' values are
the expansion design's bytes (``graph_forms.w4_to_e4m3``: e4m3(q * ratio), rounding symmetric in q), with a row scale
that leaves room for the branch. Products of e4m3 values are exact in fp32, so the only other difference is summation
order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from . import lut_dispatch
from .fp8_int8 import FP8_DTYPE, FP8_MAX
from .graph_forms import LinearShape, fp8_quantize, lrcat_c
from .int4 import GROUP_SIZE, int4_values

aten = torch.ops.aten
_F32 = torch.float32
W4_MAX = 8.0
BRANCH_MAX = 119.0                    # |v| <= 119 = 16 * 7 + 7: two int4 digits
HEADROOM = FP8_MAX / (2 * BRANCH_MAX)  # |u| <= 238 keeps s <= 2, so the branch table's 16 s 8 <= 256 <= 448
MIN_STEP_LOG2 = -13                    # s >= 2^-13: 16 s 1 = 2^-9, e4m3's smallest subnormal, stays exact
PLANES = 3                             # the branch's columns in K: [hi | hi16 | lo] against [uh | ul | uh]


def lut_supported(n: int) -> bool:
    """Whether a linear with N outputs takes the LUT form: its layout tiles rows by 16 (K is SVDQuant's multiple of
    64); other linears keep SVDQuant's tables and forms."""
    return n % 16 == 0


def branch_cols(r: int, planes: int = PLANES) -> int:
    """C = planes R rounded up to a multiple of 64 (whole K-groups: the GEMM's tile K), the columns the branch adds
    to K: 3 planes stored; a GEMM over 2 reads the stored operand's prefix (:func:`weight_prefix`)."""
    return -(-planes * r // GROUP_SIZE) * GROUP_SIZE


@dataclass
class LutWeight:
    """The GEMM's weight operand: ``codes`` uint8 [N, (K + C) / 2] (two codes a byte, in the kernel's layout:
    :func:`shuffle_codes`), ``tables`` uint8 [(K + C) / 64, N, 8] (e4m3 bytes), ``sw`` fp32 [N], ``c`` fp32 [R]."""
    codes: torch.Tensor
    tables: torch.Tensor
    sw: torch.Tensor
    c: torch.Tensor


def lut_codes(q: torch.Tensor) -> torch.Tensor:
    """int4 values (an integer tensor in [-8, 7]) -> 4-bit codes uint8 (module docstring)."""
    q = q.to(torch.int16)
    return torch.where(q > 0, 8 - q, q & 15).to(torch.uint8)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> bytes [..., K/2], even k in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _e4m3_bytes(v: torch.Tensor) -> torch.Tensor:
    return v.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)


def row_scale(wscale: torch.Tensor, lora_up: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """sw fp32 [N] (module docstring)."""
    wmax = wscale.to(_F32).amax(1) * W4_MAX
    if lora_up.shape[1]:
        wmax = torch.maximum(wmax, (lora_up.to(_F32) * c).abs().amax(1) * HEADROOM)
    return torch.where(wmax == 0, 1.0, wmax / FP8_MAX)  # an all-zero row: tables of zeros, not 0 / 0


def branch_digits(u: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """u fp32 [N, R] (|u| <= 238) -> (uh, ul) int [N, R] in [-8, 7] and s fp32 [N] (powers of two) with
    ``u ~ s (16 uh + ul)``."""
    amax = u.abs().amax(1)
    # at most 2 (u's bound; a last-ulp excess of it is clamped into v below), at least 2^-13
    e = torch.ceil(torch.log2(torch.clamp(amax / BRANCH_MAX, min=2.0 ** MIN_STEP_LOG2, max=2.0)))
    s = torch.exp2(e)
    v = torch.round(u / s[:, None]).clamp(-BRANCH_MAX, BRANCH_MAX).to(torch.int16)
    uh = torch.div(v + 8, 16, rounding_mode="floor")
    return uh, v - 16 * uh, s


def prepare_lut(qweight: torch.Tensor, wscale: torch.Tensor, lora_down: torch.Tensor,
                lora_up: torch.Tensor) -> LutWeight:
    """The load-time transform (module docstring), on the tensors' device."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    r = lora_down.shape[0]
    cols = branch_cols(r)
    c = lrcat_c(lora_down, k) if r else torch.ones(0, dtype=_F32, device=qweight.device)
    sw = row_scale(wscale, lora_up, c)
    ratio = wscale.to(_F32) / sw[:, None]                                               # [N, G]
    levels = torch.arange(8, device=qweight.device, dtype=_F32) - W4_MAX                # i - 8
    tables = _e4m3_bytes(ratio.t()[:, :, None] * levels)                                # [G, N, 8]
    codes = lut_codes(int4_values(qweight, torch.int16))                                # [N, K]
    if r:
        uh, ul, s = branch_digits(lora_up.to(_F32) * c / sw[:, None])
        planes = torch.zeros(n, cols, dtype=torch.uint8, device=qweight.device)           # [uh | ul | uh | 0]
        planes[:, :PLANES * r] = torch.cat([lut_codes(uh), lut_codes(ul), lut_codes(uh)], 1)
        codes = torch.cat([codes, planes], 1)
        branch = _e4m3_bytes((16 * s)[:, None] * levels)                                # [N, 8]
        tables = torch.cat([tables, branch[None].expand(cols // GROUP_SIZE, n, 8)], 0)
    return LutWeight(shuffle_codes(codes), tables.contiguous(), sw.contiguous(), c)


def shuffle_index(n: int, k: int, device=None) -> torch.Tensor:
    """int32 [N * K]: where the kernel's layout puts code (n, k) (row-major index n K + k). One warp's share of a
    register-sourced fp8 wgmma is 16 rows x 32 k; its thread t = 4 (row % 8) + (k % 16) / 4 holds 16 values, rows
    r and r + 8 and k halves +0 and +16 (PTX's wgmma A fragment), stored side by side (offset 16 t + value): a
    thread's codes are one 64-bit shared-memory load. Atoms of 512 codes follow N first, then K (CUTLASS's
    ``tile_to_shape`` of that atom; ``w4a8_lut_cutlass.shuffle_offsets`` is the library's own, tested equal)."""
    r = torch.arange(n, device=device, dtype=torch.int32)[:, None]  # int32: N K < 2^31, half the bytes of int64
    c = torch.arange(k, device=device, dtype=torch.int32)[None, :]
    thread = 4 * (r % 8) + (c % 16) // 4
    value = c % 4 + 4 * ((r % 16) // 8) + 8 * ((c % 32) // 16)
    return (16 * thread + value + 512 * (r // 16 + (n // 16) * (c // 32))).reshape(-1)


def shuffle_codes(codes: torch.Tensor) -> torch.Tensor:
    """Unpacked codes uint8 [N, K] (N % 16 == 0, K % 32 == 0) -> packed bytes [N, K/2] in the kernel's layout."""
    n, k = codes.shape
    out = torch.empty(n * k, dtype=torch.uint8, device=codes.device)
    out[shuffle_index(n, k, codes.device)] = codes.reshape(-1)
    return pack_codes(out.reshape(n, k))


def unshuffle_codes(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`shuffle_codes`: unpacked codes uint8 [N, K] in row-major order."""
    n, k = packed.shape[0], packed.shape[1] * 2
    flat = torch.stack([packed & 15, packed >> 4], -1).reshape(-1)
    return flat[shuffle_index(n, k, packed.device)].reshape(n, k)


def decode(codes: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Codes [N, K/2] (the kernel's layout) and tables [K/64, N, 8] -> the values the GEMM multiplies, fp32 [N, K]."""
    t = tables.view(FP8_DTYPE).to(_F32)                                                 # [G, N, 8]
    full = torch.cat([torch.zeros_like(t[..., :1]), -t[..., 1:], t], -1)               # code -> value, [G, N, 16]
    n, g = codes.shape[0], tables.shape[0]
    c = unshuffle_codes(codes).reshape(n, g, GROUP_SIZE).long()                         # [N, G, 64]
    return torch.gather(full.permute(1, 0, 2), 2, c).reshape(n, g * GROUP_SIZE)


def _branch_parts(h: torch.Tensor, sx: torch.Tensor, c: torch.Tensor, m: int, r: int,
                  planes: int) -> List[torch.Tensor]:
    """The A operand's branch columns from h [M, R] and sx fp32 [M, 1]: [hi, hi16(, lo)(, zeros)], e4m3 each."""
    pad = branch_cols(r, planes) - planes * r
    hs = aten.clamp.default(aten.div.Tensor(aten._to_copy.default(h, dtype=_F32), aten.mul.Tensor(sx, c)),
                            -FP8_MAX, FP8_MAX)
    hi = aten._to_copy.default(hs, dtype=FP8_DTYPE)
    hi_f = aten._to_copy.default(hi, dtype=_F32)
    parts = [hi, aten._to_copy.default(aten.div.Tensor(hi_f, 16.0), dtype=FP8_DTYPE)]
    if planes == 3:
        parts.append(aten._to_copy.default(aten.sub.Tensor(hs, hi_f), dtype=FP8_DTYPE))   # lo
    if pad:
        parts.append(aten._to_copy.default(aten.new_zeros.default(hs, [m, pad]), dtype=FP8_DTYPE))
    return parts


def lut_smoothed_activation(xd: torch.Tensor, h: torch.Tensor, c: torch.Tensor, m: int, r: int,
                            planes: int = PLANES) -> Tuple[torch.Tensor, torch.Tensor]:
    """The A operand e4m3 [M, K + C] and sx fp32 [M] from the smoothed activation xd = x.dtype(x smooth_inv)
    [M, K] and its down projection h = xd @ lora_down.T [M, R] (module docstring; the specification of
    ``dit_passes::lut_quantize_smoothed``), ATen ops; M and R constants (the forms are traced). ``planes=2``: [qx | hi |
    hi16 | 0], against the stored B's prefix of K + :func:`branch_cols` (R, 2) columns (its third plane's codes in
    that prefix meet zeros): h in e4m3 alone, the GEMM 64 to 128 columns shorter."""
    qx, sx = fp8_quantize(aten._to_copy.default(xd, dtype=_F32), per_row=True)
    return aten.cat.default([qx, *_branch_parts(h, sx, c, m, r, planes)], 1), aten.view.default(sx, [m])


def token_amax(xd: torch.Tensor) -> torch.Tensor:
    """max |xd| per token, fp32 [M]: written beside xd, Inductor computes it in xd's producer (one pass)."""
    return aten.amax.default(aten.abs.default(aten._to_copy.default(xd, dtype=_F32)), [1])


def lut_lowrank_activation(xd: torch.Tensor, amax: torch.Tensor, lora_down: torch.Tensor, c: torch.Tensor, m: int,
                           r: int, planes: int = PLANES) -> Tuple[torch.Tensor, torch.Tensor]:
    """The A operand and sx from xd [M, K], its per-token amax fp32 [M] (:func:`token_amax`) and lora_down [R, K]:
    :func:`lut_smoothed_activation` with sx from ``amax`` and h = xd @ lora_down.T of their values in xd's dtype,
    summed in fp32 (not rounded to xd's dtype), the specification of ``dit_passes::lut_quantize_lowrank``; ATen ops."""
    xf = aten._to_copy.default(xd, dtype=_F32)
    qx, sx = fp8_quantize(xf, per_row=True, amax=aten.view.default(amax, [m, 1]))
    ld = aten._to_copy.default(aten._to_copy.default(lora_down, dtype=xd.dtype), dtype=_F32)
    h = aten.mm.default(xf, aten.t.default(ld))
    return aten.cat.default([qx, *_branch_parts(h, sx, c, m, r, planes)], 1), aten.view.default(sx, [m])


def lut_activation(x2d: torch.Tensor, smooth_inv: torch.Tensor, lora_down: torch.Tensor, c: torch.Tensor,
                   dtype: torch.dtype, m: int, r: int, act: str = "graph",
                   planes: int = PLANES) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (A, sx) (module docstring): the smoothed activation xd in x's dtype, its down projection by one
    mm, then :func:`lut_smoothed_activation` as ATen ops (``act="graph"``) or as the op
    ``dit_passes::lut_quantize_smoothed`` (``"kernel"``, the row kernel); ``"lowrank"``: xd's per-token amax (one
    pass of xd's producer under Inductor), then the op ``dit_passes::lut_quantize_lowrank`` (the down projection
    inside, in fp32: :func:`lut_lowrank_activation`). No branch (R = 0): [qx] alone. M, R constants."""
    xd = aten._to_copy.default(aten.mul.Tensor(aten._to_copy.default(x2d, dtype=_F32), smooth_inv), dtype=dtype)
    if not r:
        qx, sx = fp8_quantize(aten._to_copy.default(xd, dtype=_F32), per_row=True)
        return qx, aten.view.default(sx, [m])
    if act == "lowrank":
        out = torch.ops.dit_passes.lut_quantize_lowrank.default(xd, token_amax(xd), lora_down, c, planes)
        return out[0], out[1]
    h = aten.mm.default(xd, aten.t.default(lora_down))
    if act == "kernel":
        out = torch.ops.dit_passes.lut_quantize_smoothed.default(xd, h, c, planes)
        return out[0], out[1]
    return lut_smoothed_activation(xd, h, c, m, r, planes)


def lut_gemm_reference(codes: torch.Tensor, tables: torch.Tensor, a8: torch.Tensor, sw: torch.Tensor,
                       sx: torch.Tensor, bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """``out_dtype(sx * (sw * (A @ decode(B).T)) + bias)`` in fp32, the kernel's arithmetic up to summation order."""
    acc = a8.to(_F32) @ decode(codes, tables).t()
    y = sx[:, None] * (sw[None, :] * acc)
    if bias is not None:
        y = y + bias.to(_F32)
    return y.to(out_dtype)


def lut_linear_reference(x: torch.Tensor, w: LutWeight, lora_down: torch.Tensor, smooth_inv: torch.Tensor,
                         bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The whole linear, x [..., K] -> [..., N], by the reference GEMM."""
    x2d = x.reshape(-1, x.shape[-1])
    a8, sx = lut_activation(x2d, smooth_inv, lora_down, w.c, x.dtype, x2d.shape[0], lora_down.shape[0])
    y = lut_gemm_reference(w.codes, w.tables, a8, w.sw, sx, bias, x.dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def to_lut_table(table: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """An SVDQuant table (``SVDQuantWeight.tensors()``: qweight, wscale, lora_down, lora_up, smooth_inv, bias) ->
    the LUT form's (codes, tables, sw, c, lora_down, smooth_inv, bias): qweight, wscale and lora_up are not kept."""
    w = prepare_lut(table["qweight"], table["wscale"], table["lora_down"], table["lora_up"])
    out = {"codes": w.codes, "tables": w.tables, "sw": w.sw, "c": w.c, "lora_down": table["lora_down"],
           "smooth_inv": table["smooth_inv"]}
    if table.get("bias") is not None:
        out["bias"] = table["bias"]
    return out


def weight_prefix(codes: torch.Tensor, tables: torch.Tensor, n: int, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The stored B operand's first ``k`` columns (k a multiple of 64), codes [N, k/2] and tables [k/64, N, 8]: views.
    The kernel's layout orders its 512-code atoms N first, K-blocks of 32 outermost, so k columns are a prefix of the
    codes' storage, as of the tables'."""
    flat = aten.slice.Tensor(aten.view.default(codes, [-1]), 0, 0, n * k // 2)
    return aten.view.default(flat, [n, k // 2]), aten.slice.Tensor(tables, 0, 0, k // GROUP_SIZE)


def lut_storage(tables: Dict[str, Dict[str, torch.Tensor]], kinds: Dict[str, str], form: str = "auto"
                ) -> Dict[str, str]:
    """The kinds the graph writes for these prepared ``tables`` (module path -> tensors) on their device: where
    ``lut_dispatch.svdq_lut`` (for SVDQuant's ``form``) asks for the LUT form, each W4A4 table of a linear it takes (:func:`lut_supported`) is
    replaced in ``tables`` by :func:`to_lut_table` (in place: the holder of the dict keeps one form) and its kind
    becomes ``svdq_lut``; a table converted before keeps that kind; other kinds are left alone."""
    first = next((t for table in tables.values() for t in table.values() if t is not None), None)
    lut = first is not None and lut_dispatch.svdq_lut(first.device, form)
    out = dict(kinds)
    for p, table in tables.items():
        if lut and out.get(p) == "svdq_w4a4" and "codes" not in table and lut_supported(table["qweight"].shape[0]):
            tables[p] = to_lut_table(table)
        if "codes" in tables[p]:
            out[p] = "svdq_lut"
    return out


def svdq_lut_linear_form(x: torch.Tensor, codes: torch.Tensor, tables: torch.Tensor, sw: torch.Tensor,
                         c: torch.Tensor, lora_down: torch.Tensor, smooth_inv: torch.Tensor,
                         bias: Optional[torch.Tensor], shape: LinearShape, act: str,
                         planes: int = PLANES) -> torch.Tensor:
    """The LUT form of one linear, x [*lead, K] -> [*lead, N] (module docstring): :func:`lut_activation` (its A
    operand by ATen ops, ``act="graph"``, the row kernel's op, ``"kernel"``, or ``dit_passes::lut_quantize_lowrank``,
    ``"lowrank"``), then
    ``dit_passes::w4a8_lut_gemm`` over the branch's ``planes`` (2: the stored operand's prefix). ``shape`` (lead, K,
    N, dtype, rank) holds the constants (the form is traced)."""
    x2d = x if len(shape.lead) == 1 else aten.reshape.default(x, [shape.m, shape.k])
    a8, sx = lut_activation(x2d, smooth_inv, lora_down, c, shape.dtype, shape.m, shape.rank, act, planes)
    if planes != PLANES and shape.rank:
        codes, tables = weight_prefix(codes, tables, shape.n, shape.k + branch_cols(shape.rank, planes))
    y = torch.ops.dit_passes.w4a8_lut_gemm.default(codes, tables, a8, sw, sx, bias, shape.dtype)
    return y if len(shape.lead) == 1 else aten.view.default(y, [*shape.lead, shape.n])
