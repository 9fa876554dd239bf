"""cache-dit's configuration files (``load_configs`` and the loaders of each section): the same configs as
cache-dit 1.5.3's loaders on the same files, and a clear error, before any generation, where a file holds a key
no config knows or a value of the wrong type (the reference skips unknown keys)."""
from __future__ import annotations

import dataclasses

import pytest

import dit_passes as dp

FILE = """
cache_config:
  Fn_compute_blocks: 2
  Bn_compute_blocks: 1
  residual_diff_threshold: 0.12
  max_warmup_steps: 3
  max_continuous_cached_steps: 2
  enable_taylorseer: true
  taylorseer_order: 2
  num_inference_steps: 10
  steps_computation_mask: fast
parallelism_config:
  ulysses_size: 2
  ring_rotate_method: allgather
attention_backend: native
quantize_config:
  quant_type: float8_per_row
  exclude_layers: [embed]
  regional_quantize: false
"""


def _value(v):
    return getattr(v, "value", v)  # the reference's enums (CacheType.DBCache) against our strings


def _same_fields(ours, theirs, skip=("backend",)):
    """Every field of ``ours`` that the reference's object has holds the same value (``backend``: the reference
    resolves it to its own enum of installed backends)."""
    assert type(ours).__name__ == type(theirs).__name__
    diff = {f.name: (getattr(ours, f.name), getattr(theirs, f.name)) for f in dataclasses.fields(ours)
            if f.name not in skip and hasattr(theirs, f.name)
            and _value(getattr(ours, f.name)) != _value(getattr(theirs, f.name))}
    assert not diff, diff


def _reference():
    cache_dit = pytest.importorskip("cache_dit")
    pytest.importorskip("torchao")  # the reference's QuantizeConfig asserts its backend is installed
    return cache_dit


@pytest.mark.parity("load_configs", "load_cache_config", "load_parallelism_config", "load_attn_backend_config",
                    "load_quantize_config")
def test_every_section_as_cache_dit_loads_it(tmp_path):
    cache_dit = _reference()
    path = tmp_path / "config.yaml"
    path.write_text(FILE)
    ours, theirs = dp.load_configs(str(path)), cache_dit.load_configs(str(path))
    assert set(ours) == set(theirs)
    for key in ("cache_config", "calibrator_config", "parallelism_config", "quantize_config"):
        _same_fields(ours[key], theirs[key])
    assert ours["attention_backend"] == theirs["attention_backend"] == "native"
    assert ours["cache_config"].steps_computation_mask == theirs["cache_config"].steps_computation_mask
    assert dp.load_configs(str(path), return_dict=False) == tuple(ours.values())


@pytest.mark.parametrize("section", [
    {"max_warmup_steps": 4, "residual_diff_threshold": 0.2},  # the flat form: the file is the cache section
    {"cache_type": "DBPrune", "Fn_compute_blocks": 1, "enable_dmd": True, "dmd_history": 4,
     "non_prune_block_ids": [0]},
    {"cache_type": "DBCache", "enable_foca": True, "calibrator_cache_type": "residual"},
    {"Fn_compute_blocks": 1, "enable_taylorseer": False, "taylorseer_order": 3},  # a calibrator toggled off
])
def test_cache_sections_as_cache_dit_loads_them(section):
    cache_dit = _reference()
    ours, theirs = dp.load_cache_config(section), cache_dit.load_cache_config(section)
    _same_fields(ours[0], theirs[0])
    if theirs[1] is None:
        assert ours[1] is None
    else:
        _same_fields(ours[1], theirs[1])


def test_sections_absent():
    assert dp.load_cache_config({"parallelism_config": {"tp_size": 2}}) == (None, None)
    assert dp.load_parallelism_config({"cache_config": {}}) is None
    assert dp.load_parallelism_config({"parallelism_config": {"tp": 2}}, check_only=True) is True
    assert dp.load_quantize_config({}) is None and dp.load_attn_backend_config({}) is None


def test_size_aliases_and_auto():
    # cache-dit 1.5.3 passes the alias on to ParallelismConfig as well and fails there; here it names the field
    assert dp.load_parallelism_config({"parallelism_config": {"tp": 2}}).tp_size == 2
    # "auto" without a process group: a world of 1
    cfg = dp.load_parallelism_config({"parallelism_config": {"ulysses_size": "auto"}})
    assert cfg.ulysses_size == 1
    with pytest.raises(ValueError, match="tp=2 and tp_size=4 disagree"):
        dp.load_parallelism_config({"parallelism_config": {"tp": 2, "tp_size": 4}})
    with pytest.raises(ValueError, match="only one of ulysses_size / ring_size / tp_size may be 'auto'"):
        dp.load_parallelism_config({"parallelism_config": {"ulysses_size": "auto", "ring_size": "auto"}})


@pytest.mark.parametrize("data, error, match", [
    ({"cache_config": {"Fn_compute_block": 2}}, ValueError, r"cache_config: unknown key\(s\) \['Fn_compute_block'\]"),
    ({"cache_config": {"Fn_compute_blocks": "two"}}, TypeError, "DBCacheConfig.Fn_compute_blocks must be an int"),
    ({"cache_config": {"cache_type": "FBCache"}}, ValueError, "cache_config.cache_type='FBCache'"),
    ({"cache_config": {"enable_taylorseer": True, "enable_dmd": True}}, ValueError, "mutually exclusive"),
    ({"cache_config": {"taylorseer_order": 2}}, ValueError, "configure a calibrator the section does not enable"),
    ({"cache_config": {"steps_computation_mask": "fast"}}, ValueError, "needs num_inference_steps"),
    ({"parallelism_config": {"ulysses_sizes": 2}}, ValueError, r"parallelism_config: unknown key\(s\) \['ulysses_sizes'\]"),
    ({"parallelism_config": {"tp_size": "two"}}, ValueError, "tp_size='two': use an int or 'auto'"),
    ({"quantize_config": {"quant_typ": "float8_per_row"}}, ValueError, r"quantize_config: unknown key\(s\) \['quant_typ'\]"),
    ({"quantize_config": {"quant_type": "int3"}}, ValueError, "quant_type='int3' is not supported"),
    ({"cache_config": {}, "compile_config": {}}, ValueError, r"the configuration file: unknown key\(s\) \['compile_config'\]"),
    ({"attention_backend": 3}, ValueError, "attention_backend must be a backend name"),
])
def test_bad_files_fail_naming_the_setting(data, error, match):
    with pytest.raises(error, match=match):
        dp.load_configs(data)


@pytest.mark.parity("load_options")
def test_bad_file_and_reset(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="must hold a mapping of settings"):
        dp.load_configs(str(path))
    with pytest.raises(FileNotFoundError):
        dp.load_configs(str(tmp_path / "missing.yaml"))
    with pytest.raises(NotImplementedError, match="reset=True blanks a config for cache-dit's ParamsModifier"):
        dp.load_cache_config({"cache_config": {}}, reset=True)
    with pytest.deprecated_call():
        assert dp.load_options({"Fn_compute_blocks": 1})["cache_config"].Fn_compute_blocks == 1


@pytest.mark.parity("set_attn_backend")
def test_enable_cache_takes_every_section_and_pins_the_attention_kernel():
    """``enable_cache(pipe, **load_configs(...))``, the reference's usage: the cache and the pinned SDPA kernel both
    act (the kernel's op in the graph, the output as the unpinned one's within SDPA kernels' rounding);
    ``set_attn_backend`` then swaps the pin on the accelerated transformer."""
    import torch
    from dit_passes.models.zoo import build
    from dit_passes.testing.pipelines import flux_pipeline

    def run(pipe):
        g = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            return pipe(prompt_embeds=torch.randn(1, 7, 32, generator=g), pooled_prompt_embeds=torch.randn(1, 32, generator=g),
                        height=16, width=16, num_inference_steps=6, guidance_scale=3.5, output_type="latent",
                        generator=torch.Generator().manual_seed(3)).images

    def pinned(pipe):
        return [n.args[-1] for n in pipe.transformer.graph.nodes if "sdpa_backend" in str(n.target)]

    cache = {"Fn_compute_blocks": 1, "residual_diff_threshold": 1.0, "max_warmup_steps": 2}
    plain = flux_pipeline(build("flux").model)
    dp.enable_cache(plain, **dp.load_configs({"cache_config": cache}))
    ref = run(plain)
    pipe = flux_pipeline(build("flux").model)
    dp.enable_cache(pipe, **dp.load_configs({"cache_config": cache, "attention_backend": "_native_math"}))
    out = run(pipe)
    assert pinned(pipe) and set(pinned(pipe)) == {"math"}
    assert dp.summary(pipe, logging=False)[0].cached_steps == dp.summary(plain, logging=False)[0].cached_steps != []
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    dp.set_attn_backend(pipe, "_native_efficient")
    assert [p.name for p in pipe.transformer.passes] == ["dbcache", "attention_backend"] or \
        [p.name for p in pipe.transformer.passes] == ["attention_backend", "dbcache"]
    dp.set_attn_backend(pipe, "native")  # SDPA's own choice again: no pin
    torch.testing.assert_close(run(pipe), ref, rtol=0, atol=0)
    assert not pinned(pipe)
    with pytest.raises(ValueError, match="is not accelerated by dit_passes"):
        dp.set_attn_backend(flux_pipeline(build("flux").model), "_native_math")
    with pytest.raises(NotImplementedError, match="another package's attention kernel"):
        dp.enable_cache(flux_pipeline(build("flux").model), attention_backend="sage")
    with pytest.raises(ValueError, match="disagree"):
        dp.enable_cache(flux_pipeline(build("flux").model), attention_backend="_native_math",
                        parallelism_config=dp.ParallelismConfig(tp_size=2, attention_backend="_native_cudnn"))
