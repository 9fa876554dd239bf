"""SVDQuant's packed int4 weights expanded to e4m3 with the group scales folded, in one bandwidth-bound pass.

:func:`w4_to_e4m3` is the CUDA implementation of ``dit_passes::w4_to_e4m3`` (its specification:
``dit_passes.quant.graph_forms.w4_to_e4m3``). One program per ``BLOCK_N`` weight rows and ``BLOCK_K`` columns::

    ws = float(wscale[n, :])                             # the rows' K/64 group scales (the row max needs them all)
    sw = div_rn(8 * max_g ws, 448)                       # the row scale: |int4| <= 8 maps to e4m3's largest
    q  = the int4 values of the chunk's packed bytes, as [BLOCK_N, BLOCK_K/64 groups, 32 bytes] (even k: low nibble)
    w8 = e4m3(clamp(q * div_rn(ws[g], sw), -448, 448))  # round to nearest even
    store w8 (each byte's two values as one int16) and, the first chunk's programs, sw [N]

Why a kernel: Inductor's fusion of the graph form (bench row ``w4_expand``) ran at a fraction of an H100's memory
bandwidth (``bench/results/w4_expand_kernel_h100.json``) for work that reads 1.5 bytes and writes one per weight: it
re-reads the group scales for the row max and broadcasts the ratio through an index computation per element. Here a
program reads its rows' scales once, splits the nibbles in registers (exact values by a bit trick,
``_nibble_planes``) and writes the pair of e4m3 bytes of every packed byte as one int16 (no interleave of the two
planes back into k order: the first design's ``join`` + ``reshape``, with one program looping over all of K per row
block, left most of the bandwidth unused).

:func:`w4_lrcat_to_e4m3` (``dit_passes::w4_lrcat_to_e4m3``, the lrcat design's B operand, ``graph_forms.lrcat_weight``)
is the same program with the low-rank factor in the row scale (``sw = max(8 * max_g ws, max_r |lora_up * c|) / 448``)
and, in the first chunk's programs, the rows' low-rank columns ``e4m3(lora_up * c / sw)`` (split: hi, hi, lo) and
the zero padding written into the same rows.

Numerics: the same operations in the same order as the specification on the CPU (true divisions, fp32 products of
exact int4 values), so the bytes are equal. The expanded weights' e4m3 bytes come from one PTX
``cvt.rn.satfinite.e4m3x2.f32`` per packed byte on the GPU (``_e4m3_pair``) and, under ``TRITON_INTERPRET=1``, from
``w4a8_triton._soft_e4m3``'s value (round to nearest even by integer arithmetic, ``_e4m3_bits``); the low-rank
columns use the hardware cast on the GPU.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .fp8_rowquant_triton import _has_e4m3, _to_e4m3
from .w4a4_autotune import interpreting
from .w4a8_triton import E4M3_MAX, _nibble_planes, _soft_e4m3

GROUP = 64
MAX_BLOCK_K = 1024  # output columns per program (a power of two dividing K)
FORM = "words"  # what a thread converts: an int32 word (eight values) or a packed byte (two); bench/w4_expand_kernel.py
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _configs():
    if interpreting():
        return [triton.Config({"BLOCK_N": 4}, num_warps=4)]
    # a program: [BLOCK_N, BLOCK_K / 2] packed bytes in, twice that out; BLOCK_N 16 at 8 warps is ~32 fp32 values
    # per thread and nibble plane at BLOCK_K 1024
    return [triton.Config({"BLOCK_N": bn}, num_warps=w) for bn, w in ((4, 4), (8, 4), (8, 8), (16, 8), (32, 8))]


@triton.autotune(configs=_configs(), key=["N", "K", "BLOCK_K", "LR", "SPLIT", "R_OUT", "WORDS"])
@triton.jit
def _w4_expand_kernel(qw_ptr, ws_ptr, w16_ptr, w8_ptr, sw_ptr, lu_ptr, c_ptr, N, K, R, s_qn, s_wsn, s_w16n, s_w8n,
                      s_lun, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_K: tl.constexpr, LR: tl.constexpr,
                      SPLIT: tl.constexpr, R_OUT: tl.constexpr, R_BLOCK: tl.constexpr, SOFT: tl.constexpr,
                      GS: tl.constexpr, WORDS: tl.constexpr, BLOCK_N: tl.constexpr):
    # GS: the group size, an argument (compiled Triton reads no plain Python globals; the interpreter does).
    # Grid (K chunks, row blocks): every program streams one [BLOCK_N, BLOCK_K] tile, so FLUX's 3072-row weights give
    # thousands of programs (one program per row block looping over K left most SMs idle).
    pid_k = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    rows = tl.where(row_mask, rows, 0).to(tl.int64)  # rows past N read row 0 (no load masks), store nothing
    offs_g = tl.arange(0, G_PAD)
    # the row scale needs all of the row's group scales: each K chunk re-reads them (from L2; G floats per row)
    ws = tl.load(ws_ptr + rows[:, None] * s_wsn + offs_g[None, :], mask=(offs_g < G)[None, :], other=0.0)
    wmax = tl.max(ws.to(tl.float32), axis=1) * 8.0                    # [BLOCK_N]; the scales are >= 0
    if LR:  # lrcat: the row scale also covers the low-rank columns lora_up * c
        offs_r = tl.arange(0, R_BLOCK)
        lu = tl.load(lu_ptr + rows[:, None] * s_lun + offs_r[None, :], mask=(offs_r < R)[None, :], other=0.0)
        luc = lu.to(tl.float32) * tl.load(c_ptr + offs_r, mask=offs_r < R, other=1.0)[None, :]
        wmax = tl.maximum(wmax, tl.max(tl.abs(luc), axis=1))
    sw = tl.math.div_rn(wmax, E4M3_MAX)
    # the chunk as [BLOCK_N, groups, units of a group]: a group's ratio broadcasts over its units with no reshape
    GK: tl.constexpr = BLOCK_K // GS
    offs_gk = tl.arange(0, GK)
    g = tl.load(ws_ptr + rows[:, None] * s_wsn + (pid_k * GK + offs_gk)[None, :]).to(tl.float32)
    ratio = tl.math.div_rn(g, sw[:, None])[:, :, None]                 # [BLOCK_N, GK, 1]
    if WORDS:  # int32 words of 8 nibbles in, int64 words of their 8 e4m3 bytes out (k order kept: little endian)
        offs_j = tl.arange(0, GS // 8)
        unit = (pid_k * GK + offs_gk)[None, :, None] * (GS // 8) + offs_j[None, None, :]
        word = tl.load(qw_ptr + rows[:, None, None] * s_qn + unit)
        out = _e4m3_word(word, ratio, SOFT)
    else:  # bytes in, each byte's two e4m3 values (even k: low nibble) out as one int16: no interleave in registers
        offs_j = tl.arange(0, GS // 2)
        unit = (pid_k * GK + offs_gk)[None, :, None] * (GS // 2) + offs_j[None, None, :]
        packed = tl.load(qw_ptr + rows[:, None, None] * s_qn + unit)
        lo, hi = _nibble_planes(packed, False)                          # exact fp32 [BLOCK_N, GK, 32]
        lo = tl.minimum(tl.maximum(lo * ratio, -E4M3_MAX), E4M3_MAX)
        hi = tl.minimum(tl.maximum(hi * ratio, -E4M3_MAX), E4M3_MAX)
        if SOFT:  # the interpreter: no inline PTX
            out = (_e4m3_bits(lo) | (_e4m3_bits(hi) << 8)).to(tl.int16)  # little endian: even k at the lower byte
        else:
            out = _e4m3_pair(lo, hi)
    tl.store(w16_ptr + rows[:, None, None] * s_w16n + unit, out, mask=row_mask[:, None, None])
    if pid_k == 0:
        tl.store(sw_ptr + rows, sw, mask=row_mask)
        if LR:  # columns K .. K + R_OUT: e4m3(lora_up * c / sw) (SPLIT: hi, hi, lo), zeros past them
            u = tl.math.div_rn(luc, sw[:, None])
            u = tl.minimum(tl.maximum(u, -E4M3_MAX), E4M3_MAX)
            dst = w8_ptr + rows[:, None] * s_w8n + (K + offs_r)[None, :]
            u_hi = _to_e4m3(u, SOFT)
            if SPLIT:  # the last block also writes the zero columns (u is 0 past R)
                u_lo = _to_e4m3(u - _soft_e4m3(u), SOFT)  # hi's value without an fp8 round trip in registers
                tl.store(dst, u_hi, mask=row_mask[:, None] & (offs_r < R)[None, :])
                tl.store(dst + R, u_hi, mask=row_mask[:, None] & (offs_r < R)[None, :])
                tl.store(dst + 2 * R, u_lo, mask=row_mask[:, None] & (offs_r < R_OUT - 2 * R)[None, :])
            else:
                tl.store(dst, u_hi, mask=row_mask[:, None] & (offs_r < R_OUT)[None, :])


@triton.jit
def _e4m3_pair(lo, hi):
    """Two fp32 planes (|v| <= 448) -> each pair's e4m3 bytes as one int16, lo in the lower byte, by one
    ``cvt.rn.satfinite.e4m3x2.f32`` (sm_89+; round to nearest even, as ``_soft_e4m3``) per pair: the integer
    rounding of :func:`_e4m3_bits` costs some forty ALU operations a value, which bound the kernel (well below the
    memory bandwidth on an H100); inline PTX also keeps Triton's fp8 type out (see :func:`_e4m3_bits`)."""
    return tl.inline_asm_elementwise("cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;", "=h,f,f", [lo, hi], dtype=tl.int16,
                                     is_pure=True, pack=1)


@triton.jit
def _nibble(word, i: tl.constexpr, ratio):
    """Nibble ``i`` of int32 words (two's complement, k = 8j + i) times its group's ratio, clamped to e4m3's range:
    the exact value by :func:`_nibble_planes`' bit trick."""
    v = (((word >> (4 * i)) & 15) ^ 0x4B000008).to(tl.float32, bitcast=True) - 8388616.0
    return tl.minimum(tl.maximum(v * ratio, -E4M3_MAX), E4M3_MAX)


@triton.jit
def _e4m3_word(word, ratio, SOFT: tl.constexpr):
    """int32 words of eight int4 values -> int64 words of their eight e4m3 bytes in the same order, by four
    ``cvt.rn.satfinite.e4m3x2.f32`` (``_soft_e4m3`` bits under the interpreter): 4 bytes read and 8 written per
    thread-element, where the byte form moves one and two."""
    v0, v1, v2, v3 = _nibble(word, 0, ratio), _nibble(word, 1, ratio), _nibble(word, 2, ratio), _nibble(word, 3, ratio)
    v4, v5, v6, v7 = _nibble(word, 4, ratio), _nibble(word, 5, ratio), _nibble(word, 6, ratio), _nibble(word, 7, ratio)
    if SOFT:
        lo = (_e4m3_bits(v0) | (_e4m3_bits(v1) << 8) | (_e4m3_bits(v2) << 16) | (_e4m3_bits(v3) << 24))
        hi = (_e4m3_bits(v4) | (_e4m3_bits(v5) << 8) | (_e4m3_bits(v6) << 16) | (_e4m3_bits(v7) << 24))
        return (lo.to(tl.int64) & 0xFFFFFFFF) | (hi.to(tl.int64) << 32)
    return tl.inline_asm_elementwise(
        "{ .reg .b16 a, b, c, d; .reg .b32 l, h;\n"
        "cvt.rn.satfinite.e4m3x2.f32 a, $2, $1; cvt.rn.satfinite.e4m3x2.f32 b, $4, $3;\n"
        "cvt.rn.satfinite.e4m3x2.f32 c, $6, $5; cvt.rn.satfinite.e4m3x2.f32 d, $8, $7;\n"
        "mov.b32 l, {a, b}; mov.b32 h, {c, d}; mov.b64 $0, {l, h}; }",
        "=l,f,f,f,f,f,f,f,f", [v0, v1, v2, v3, v4, v5, v6, v7], dtype=tl.int64, is_pure=True, pack=1)


@triton.jit
def _e4m3_bits(v):
    """fp32 (|v| <= 448) -> its e4m3 byte (round to nearest even) as int32 in [0, 255], by integer arithmetic on the
    rounded value's fp32 bits: no fp8 register values (on sm_90, Triton 3.6 mis-lowered the hardware cast's result
    bitcast to uint8 in this kernel's 3-D layout: bytes of zeros in the GPU test)."""
    r = _soft_e4m3(v)                                                 # the nearest e4m3 value, as fp32
    a = tl.abs(r)
    abits = a.to(tl.int32, bitcast=True)
    normal = ((abits >> 23) - 120) * 8 + ((abits >> 20) & 7)          # exponent rebias 127 -> 7, 3 mantissa bits
    sub = (a * 512.0).to(tl.int32)                                    # subnormals: multiples of 2**-9
    sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80                # from v: a flushed zero keeps its sign
    return tl.where(a >= 0.015625, normal, sub) | sign


def block_k(k: int) -> int:
    """The chunk: the largest power of two <= MAX_BLOCK_K dividing K (K % 64 == 0, so at least 64)."""
    b = MAX_BLOCK_K
    while k % b:
        b //= 2
    return b


def is_supported(qweight: torch.Tensor, wscale: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: packed uint8 [N, K/2] with float scales [N, K/64] on an sm_89+ GPU
    (the e4m3 cast), or any device under the interpreter."""
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or wscale.dim() != 2 or wscale.dtype not in _SCALE_DTYPES:
        return False
    if interpreting():
        return True
    return qweight.device.type == "cuda" and _has_e4m3(qweight.device.index if qweight.device.index is not None
                                                       else torch.cuda.current_device())


def _check(name: str, qweight: torch.Tensor, wscale: torch.Tensor) -> None:
    n, half = qweight.shape if qweight.dim() == 2 else (-1, -1)
    k = 2 * half
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or k % GROUP or k <= 0:
        raise ValueError(f"{name}: qweight must be uint8 [N, K/2] with K a positive multiple of {GROUP}, got "
                         f"{qweight.dtype} {tuple(qweight.shape)}")
    if wscale.dtype not in _SCALE_DTYPES or tuple(wscale.shape) != (n, k // GROUP):
        raise ValueError(f"{name}: wscale must be a float [{n}, {k // GROUP}] tensor, got {wscale.dtype} "
                         f"{tuple(wscale.shape)}")
    if qweight.device.type != "cuda" and not interpreting():
        raise ValueError(f"{name}: the Triton kernel needs CUDA tensors (got {qweight.device}); on CPU use the op's "
                         "reference (dit_passes.quant.graph_forms) or set TRITON_INTERPRET=1 (tests)")


def _expand(qweight: torch.Tensor, wscale: torch.Tensor, lora_up: Optional[torch.Tensor], c: Optional[torch.Tensor],
            r_out: int, split: bool, form: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The launch both ops share: the [N, K + r_out] e4m3 operand and the row scale; ``lora_up`` None: no low-rank
    columns (r_out 0); ``form`` "bytes" / "words" (default :data:`FORM`), the units a thread converts."""
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    qw = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    ws = wscale if wscale.stride(-1) == 1 else wscale.contiguous()
    out = torch.empty((n, k + r_out), dtype=torch.float8_e4m3fn, device=qw.device)
    sw = torch.empty((n,), dtype=torch.float32, device=qw.device)
    if n == 0:
        return out, sw
    bk, groups = block_k(k), k // GROUP
    if lora_up is None:
        lu, cc, r, r_block = sw, sw, 0, 1  # unread (LR=False): any pointer
    else:
        lu, cc, r = (lora_up if lora_up.stride(-1) == 1 else lora_up.contiguous()), c.contiguous(), lora_up.shape[-1]
        r_block = max(16, triton.next_power_of_2(max(r, r_out - 2 * r) if split else r_out))

    def grid(meta):
        return (k // bk, triton.cdiv(n, meta["BLOCK_N"]))

    words = (form or FORM) == "words" and qw.stride(0) % 4 == 0 and qw.data_ptr() % 4 == 0
    if words:  # the same bytes: int32 words of 8 int4 values in, int64 words of 8 e4m3 out (K + r_out % 16 == 0)
        src, dst = qw.view(torch.int32), out.view(torch.int64)
    else:  # bytes in, two e4m3 per int16 out (K + r_out is even)
        src, dst = qw, out.view(torch.int16)
    _w4_expand_kernel[grid](src, ws, dst, out, sw, lu, cc, n, k, r, src.stride(0), ws.stride(0), dst.stride(0),
                            out.stride(0), lu.stride(0) if lora_up is not None else 0, G=groups,
                            G_PAD=triton.next_power_of_2(groups), BLOCK_K=bk, LR=lora_up is not None, SPLIT=split,
                            R_OUT=r_out, R_BLOCK=r_block, SOFT=interpreting(), GS=GROUP, WORDS=words)
    return out, sw


def w4_to_e4m3(qweight: torch.Tensor, wscale: torch.Tensor, form: Optional[str] = None
               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """qweight uint8 [N, K/2] (even k in the low nibble), wscale [N, K/64] (fp32 / bf16 / fp16, >= 0) ->
    ``(w8 float8_e4m3fn [N, K], sw fp32 [N])`` (module docstring)."""
    _check("w4_to_e4m3", qweight, wscale)
    return _expand(qweight, wscale, None, None, 0, False, form)


def w4_lrcat_to_e4m3(qweight: torch.Tensor, wscale: torch.Tensor, lora_up: torch.Tensor, c: torch.Tensor,
                     split: bool = False, form: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The lrcat B operand and row scale (``graph_forms.lrcat_weight``): qweight uint8 [N, K/2], wscale [N, K/64],
    lora_up [N, R], c fp32 [R] -> (e4m3 [N, K + cols] = [e4m3(q * wscale / sw) | e4m3(u) | 0], sw fp32 [N]) with
    sw = max(8 * max_g wscale, max_r |lora_up * c|) / 448, u = lora_up * c / sw (``split``: [.. | hi(u) | hi(u) |
    lo(u) | 0]; cols: R or 3R up to a multiple of 16), in one pass."""
    name = "w4_lrcat_to_e4m3"
    _check(name, qweight, wscale)
    n, r = qweight.shape[0], lora_up.shape[-1]
    if lora_up.dim() != 2 or lora_up.shape[0] != n or tuple(c.shape) != (r,) or c.dtype != torch.float32:
        raise ValueError(f"{name}: lora_up must be [{n}, R] and c fp32 [R], got {tuple(lora_up.shape)} and {c.dtype} "
                         f"{tuple(c.shape)}")
    r_out = -(-r * (3 if split else 1) // 16) * 16  # graph_forms.lrcat_cols
    return _expand(qweight, wscale, lora_up, c, r_out, split, form)
