"""Model presets: parameter counts from the architecture formulas."""

from __future__ import annotations

import pytest

from zeroplan.core import ConfigError, check_specs, preset_names, preset_specs

COUNTS = {
    "gpt2": 124_439_808,
    "gpt2-xl": 1_557_611_200,
    "llama-7b": 6_738_415_616,
    "llama-70b": 68_976_648_192,
    "mixtral-8x7b": 46_702_792_704,
}


@pytest.mark.parametrize(("name", "count"), COUNTS.items())
def test_parameter_counts_match_the_published_models(name, count):
    specs = preset_specs(name)
    assert sum(s.numel for s in specs) == count
    assert check_specs(specs) == specs
    assert all(s.trainable and s.group == 0 and s.dtype == "float32" for s in specs)


def test_presets_are_listed():
    assert set(COUNTS) <= set(preset_names())


def test_shapes_follow_the_hugging_face_layout():
    gpt2 = {s.name: s.shape for s in preset_specs("gpt2")}
    assert gpt2["transformer.wte.weight"] == (50257, 768)
    assert gpt2["transformer.h.0.attn.c_attn.weight"] == (768, 2304)  # Conv1D: (in, out)
    assert "lm_head.weight" not in gpt2  # tied to wte, listed once
    llama = {s.name: s.shape for s in preset_specs("llama-70b")}
    assert llama["model.layers.0.self_attn.k_proj.weight"] == (1024, 8192)  # 8 KV heads of 128
    assert llama["model.layers.79.mlp.down_proj.weight"] == (8192, 28672)
    assert llama["lm_head.weight"] == (32000, 8192)
    mixtral = {s.name: s.shape for s in preset_specs("mixtral-8x7b")}
    assert mixtral["model.layers.0.block_sparse_moe.gate.weight"] == (8, 4096)
    assert mixtral["model.layers.31.block_sparse_moe.experts.7.w2.weight"] == (4096, 14336)


def test_dtype_applies_to_every_parameter():
    specs = preset_specs("gpt2", "bf16")
    assert {s.dtype for s in specs} == {"bfloat16"}
    assert [s.index for s in specs] == list(range(len(specs)))


def test_unknown_preset_is_a_config_error_listing_the_known_ones():
    with pytest.raises(ConfigError) as info:
        preset_specs("llama-8b")
    assert "'llama-8b'" in str(info.value) and "llama-7b" in str(info.value)
