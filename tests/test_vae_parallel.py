"""VAE-P: AutoencoderKL decode / encode split along height over gloo CPU ranks, exact (fp32).

One spawned run of 4 ranks covers both sizes: the world group (4 ranks) and two pair subgroups
(ranks 0-1 and 2-3, passed as ``group=``). The latent has 9 rows (uneven: 5/4 and 3/2/2/2), the
encoded image 12 rows (blocks of 2: 6/6 and 4/4/2/2). Collectives are counted three ways: in the
single-process graph (convs taller than one row, group norms, attentions), as inserted nodes, and as
ops actually dispatched during the call. The pair 0-1 also runs a tiny AutoencoderKLWan (video:
causal 3-D convs, RMS norms, per-frame attention) decode and encode.
"""
from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dit_passes.testing import run_ranks

TOL = 1e-5
LATENT = (1, 4, 9, 8)
IMAGE = (1, 3, 12, 16)
# The tiny config's single-process graphs: convs with kernel > 1 along height, group norms, attentions.
DECODE_OPS = {"halo_exchange": 15, "all_reduce": 14, "attention": 1}
ENCODE_OPS = {"halo_exchange": 11, "all_reduce": 10, "attention": 1}


WAN_LATENT = (1, 4, 2, 5, 8)
WAN_VIDEO = (1, 3, 5, 12, 16)


def _tiny_wan():
    import diffusers
    torch.manual_seed(0)
    return diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1,
                                      temperal_downsample=[True]).eval()


def _wan_case(group, kind):
    from dit_passes.passes.vae_parallel import parallel_vae
    vae = _tiny_wan()
    x = torch.randn(WAN_LATENT if kind == "decode" else WAN_VIDEO, generator=torch.Generator().manual_seed(3))
    run = (lambda m: m.decode(x).sample) if kind == "decode" else (lambda m: m.encode(x).latent_dist.parameters)
    with torch.no_grad():
        ref = run(vae)
    pv = parallel_vae(vae, group.size(), group=group)
    out = run(pv)
    return {"kind": kind, "err": _rel(out, ref), "shape": tuple(out.shape),
            "report": pv.report()[f"{kind}{list(x.shape)}"]}


def _tiny_vae():
    import diffusers
    torch.manual_seed(0)
    return diffusers.AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                                   up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16),
                                   layers_per_block=1, latent_channels=4, norm_num_groups=4,
                                   mid_block_add_attention=True).eval()


class _Dispatched(TorchDispatchMode):
    """Counts the collective ops dispatched while active (outermost ops only)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if "vae_halo_exchange" in name or "_c10d_functional" in name:
            self.counts[name.split(".")[-1]] += 1
        return func(*args, **(kwargs or {}))


def _graph_counts(gm):
    return collections.Counter(str(n.target).split(".")[-2] for n in gm.graph.nodes
                               if n.op == "call_function" and ("dit_passes" in str(n.target)
                                                               or "_c10d_functional" in str(n.target)))


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _case(vae, group, z, x=None):
    """Decode ``z`` (and encode ``x`` if given) on ``group``; errors, output types, collective counts."""
    from dit_passes.passes.vae_parallel import parallel_vae
    pv = parallel_vae(vae, group.size(), group=group)
    out = {"forwarded": (pv.config is vae.config, pv.dtype, str(pv.device), pv.vae is vae,
                         pv.use_tiling is vae.use_tiling), "pv": pv,
           "err": {}, "dispatched": {}, "nodes": {}, "meta": {}}
    for kind, inp in (("decode", z), ("encode", x)):
        if inp is None:
            continue
        gm = pv.graph(kind, inp)  # capture + rewrite first: they run the ops on fake tensors
        mode = _Dispatched()
        with torch.no_grad():
            if kind == "decode":
                ref = vae.decode(z).sample
                with mode:
                    res = pv.decode(z)
                out["err"]["decode"] = _rel(res.sample, ref)
                tup = pv.decode(z, return_dict=False)
                out["types"] = (type(res).__name__, type(tup).__name__, len(tup), torch.equal(tup[0], res.sample))
                out["shape"] = tuple(res.sample.shape)
            else:
                ref = vae.encode(x).latent_dist
                with mode:
                    res = pv.encode(x).latent_dist
                out["err"]["encode_mean"], out["err"]["encode_std"] = _rel(res.mean, ref.mean), _rel(res.std, ref.std)
        out["dispatched"][kind], out["nodes"][kind] = dict(mode.counts), _graph_counts(gm)
        out["meta"][kind] = gm.meta["vae_parallel"]
    return out


def _ranks(rank, world):
    import torch.distributed as dist
    from dit_passes.passes.vae_parallel import parallel_vae

    vae = _tiny_vae()
    z = torch.randn(LATENT, generator=torch.Generator().manual_seed(1))
    x = torch.randn(IMAGE, generator=torch.Generator().manual_seed(2))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    from dit_passes.infra.trace_templates import default_templates
    templates = default_templates()  # the suite sets DIT_PASSES_REUSE_TRACES=1: VAE-P captures through them
    hits = templates.hits if templates is not None else 0
    out = {"world": _case(vae, dist.group.WORLD, z, x), "pair": _case(vae, pairs[rank // 2], z)}
    out["template_hits"] = None if templates is None else templates.hits - hits
    out["report"] = out["world"].pop("pv").report()
    out["pair"].pop("pv")
    # the video VAE on the pairs: 0-1 decode, 2-3 encode
    out["wan"] = _wan_case(pairs[rank // 2], "decode" if rank < 2 else "encode")
    try:
        parallel_vae(vae, 3)
    except ValueError as e:
        out["size_error"] = str(e)
    out["same"] = parallel_vae(vae, 1) is vae
    return out


@pytest.mark.multiproc
def test_vae_decode_encode_exact_on_two_and_four_ranks():
    results = run_ranks(_ranks, 4, timeout=400)
    for rank, res in enumerate(results):
        for case, size in (("world", 4), ("pair", 2)):
            r = res[case]
            where = f"rank {rank} {case} ({size} ranks)"
            for what, err in r["err"].items():
                assert err <= TOL, f"{where}: {what} max relative error {err:.2e}"
            assert r["shape"] == (1, 3, 18, 16)
            assert r["types"] == ("DecoderOutput", "tuple", 1, True), where
            assert r["forwarded"] == (True, torch.float32, "cpu", True, True), where
            rows = {"decode": {4: [3, 2, 2, 2], 2: [5, 4]}[size], "encode": [4, 4, 2, 2]}
            for kind, ops in (("decode", DECODE_OPS), ("encode", ENCODE_OPS)):
                if kind not in r["meta"]:
                    continue
                meta, nodes, ran = r["meta"][kind], r["nodes"][kind], r["dispatched"][kind]
                assert meta["rows"] == rows[kind], f"{where} {kind}: {meta}"
                # one halo exchange per conv taller than one row, one all-reduce per group norm, one
                # all-gather per attention (keys and values together) plus one for the output
                expect = {"vae_halo_exchange": ops["halo_exchange"], "all_reduce": ops["all_reduce"],
                          "all_gather_into_tensor": ops["attention"] + 1}
                assert meta["halo_exchange"] == ops["halo_exchange"] and meta["all_reduce"] == ops["all_reduce"]
                assert meta["all_gather"] == ops["attention"] + 1 and meta["attention_gathered"] == ops["attention"]
                for name, n in expect.items():
                    assert nodes[name] == n, f"{where} {kind}: graph has {dict(nodes)}"
                    assert ran.get(name, 0) == n, f"{where} {kind}: dispatched {ran}"
                assert nodes["vae_group_stats"] == nodes["vae_group_norm_apply"] == ops["all_reduce"]
                assert ran.get("wait_tensor", 0) == ops["all_reduce"] + ops["attention"] + 1, f"{where}: {ran}"
        assert set(res["world"]["err"]) == {"decode", "encode_mean", "encode_std"}
        for kind, shape, ops in (("decode", LATENT, DECODE_OPS), ("encode", IMAGE, ENCODE_OPS)):
            rep = res["report"][f"{kind}{list(shape)}"]
            assert rep["single_convs_taller_than_one_row"] == ops["halo_exchange"], rep
            assert rep["single_group_norms"] == ops["all_reduce"] and rep["single_attentions"] == ops["attention"]
            # the full input is replicated and halos add rows: tiny shapes shrink less than large ones
            assert rep["rank_peak_activation_bytes"] < rep["single_peak_activation_bytes"], rep
            # (tiny encode: the gathered keys + values of the attention outgrow the tiny image activations)
            assert kind == "encode" or rep["rank_largest_activation_bytes"] < rep["single_largest_activation_bytes"]
        assert "size=3" in res["size_error"] and "4 ranks" in res["size_error"], res["size_error"]
        assert res["same"]
        # the pair's single-process decode graph is the world's (same VAE, same latent): reused, not traced again
        assert res["template_hits"] is None or res["template_hits"] >= 1, res["template_hits"]
        wan = res["wan"]
        where = f"rank {rank} wan {wan['kind']}"
        assert wan["err"] <= TOL, f"{where}: max relative error {wan['err']:.2e}"
        assert wan["shape"] == {"decode": (1, 3, 3, 10, 16), "encode": (1, 8, 3, 6, 8)}[wan["kind"]], where
        rep = wan["report"]
        assert rep["rows"] == {"decode": [3, 2], "encode": [6, 6]}[wan["kind"]], rep
        # causal 3-D convs (time and height padding folded into the halo); RMS norms are local
        assert rep["halo_exchange"] == rep["single_convs_taller_than_one_row"] > 0, rep
        assert "all_reduce" not in rep and rep["single_group_norms"] == 0, rep
        assert rep["all_gather"] == rep["single_attentions"] + 1, rep


def test_parallel_vae_needs_a_process_group_and_size_one_is_a_no_op():
    import torch.distributed as dist
    from dit_passes.parallel.vae import split_rows
    from dit_passes.passes.vae_parallel import parallel_vae

    assert not dist.is_initialized()
    vae = torch.nn.Conv2d(1, 1, 3)  # not traced: the checks come first
    assert parallel_vae(vae, 1) is vae
    with pytest.raises(RuntimeError, match="init_process_group"):
        parallel_vae(vae, 2)
    with pytest.raises(ValueError, match="positive int"):
        parallel_vae(vae, 0)
    assert split_rows(9, 4) == [3, 2, 2, 2]
    assert split_rows(12, 4, unit=2) == [4, 4, 2, 2]
    with pytest.raises(ValueError, match="too small"):
        split_rows(3, 4)


def test_an_op_that_mixes_rows_is_refused_by_name():
    from dit_passes.capture import capture
    from dit_passes.parallel.vae import shard_vae_graph

    class Mixer(torch.nn.Module):
        def forward(self, x):
            return x.cumsum(2) + 1

    gm = capture(Mixer(), (torch.randn(1, 2, 4, 4),)).gm
    with pytest.raises(NotImplementedError, match="cumsum"):
        shard_vae_graph(gm, [4, 4], 0, "unused")
