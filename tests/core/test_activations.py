"""Activation memory (Korthikanti et al. 2022), model dimensions of presets and HF configs."""

from __future__ import annotations

import pytest

from zeroplan.core import (
    ConfigError,
    Recompute,
    TransformerDims,
    activation_memory,
    dims_from_config,
    preset_dims,
    preset_names,
    preset_specs,
)

# L = 2 layers, h = 8, a = 2 heads, v = 16; s = 4 tokens, b = 3 sequences: s*b*h = 96.
SMALL = TransformerDims(layers=2, hidden=8, heads=2, vocab=16)


def small(recompute):
    return activation_memory(SMALL, micro_batch=3, seq_len=4, recompute=recompute)


def test_hand_computed_bytes_of_a_small_model():
    # Equation 1: s*b*h*(34 + 5*a*s/h) = 96 * (34 + 5*2*4/8) = 96 * 39.
    # Outside the layers (Section 4.3, p = t = 1): 5*s*b*h + 4*s*b*v = 480 + 768.
    none = small("none")
    assert none.layer_bytes == 96 * 39 == 3744
    assert none.outside_bytes == 5 * 96 + 4 * 4 * 3 * 16 == 1248
    assert none.recompute_bytes == 0
    assert none.total_bytes == 2 * 3744 + 1248 == 8736
    # Equation 6 (t = 1): 34*s*b*h per layer.
    selective = small(Recompute.SELECTIVE)
    assert selective.layer_bytes == 34 * 96 == 3264
    assert selective.total_bytes == 2 * 3264 + 1248 == 7776
    # Section 5: each layer keeps its input, 2*s*b*h, and one layer (Equation 1) is recomputed at a time.
    full = small("full")
    assert (full.layer_bytes, full.recompute_bytes) == (2 * 96, 3744)
    assert full.total_bytes == 2 * 192 + 3744 + 1248 == 5376


def test_recompute_modes_are_ordered():
    totals = [small(mode).total_bytes for mode in Recompute]
    assert [mode.value for mode in Recompute] == ["none", "selective", "full"]
    assert totals[0] > totals[1] > totals[2]
    for name in preset_names():
        dims = preset_dims(name)
        t = [activation_memory(dims, micro_batch=1, seq_len=2048, recompute=m).total_bytes for m in Recompute]
        assert t[0] > t[1] > t[2], name


def test_the_papers_gpt3_and_mt_nlg_figures():
    # Section 5: 5as/h = 80 for GPT-3 and 64 for MT-NLG; selective recomputation saves 70% and 65%.
    for (layers, hidden, heads), saved in [((96, 12288, 96), 0.70), ((105, 20480, 128), 0.65)]:
        dims = TransformerDims(layers=layers, hidden=hidden, heads=heads, vocab=51200)
        none = activation_memory(dims, micro_batch=1, seq_len=2048)
        selective = activation_memory(dims, micro_batch=1, seq_len=2048, recompute="selective")
        assert none.layer_bytes == 2048 * hidden * (34 + 5 * heads * 2048 // hidden)
        assert 1 - selective.layer_bytes / none.layer_bytes == pytest.approx(saved, abs=0.005)
        # The layers dominate: the terms outside them are small (the paper: under 0.01% for 22B, with t = 8).
        assert none.outside_bytes < 0.01 * none.total_bytes


def test_full_recomputation_of_a_shallow_model_with_long_sequences_exceeds_selective():
    # 34 + 5*a*s/h > 32*L: the one recomputed layer's attention scores dominate.
    dims = TransformerDims(layers=1, hidden=64, heads=8, vocab=100)
    full = activation_memory(dims, micro_batch=1, seq_len=4096, recompute="full")
    selective = activation_memory(dims, micro_batch=1, seq_len=4096, recompute="selective")
    assert full.total_bytes > selective.total_bytes


def test_activations_scale_with_the_micro_batch():
    one = activation_memory(SMALL, micro_batch=1, seq_len=4)
    assert small("none").total_bytes == 3 * one.total_bytes


def test_as_dict():
    record = small("full").as_dict()
    assert record == {
        "layers": 2,
        "hidden": 8,
        "heads": 2,
        "vocab": 16,
        "micro_batch": 3,
        "seq_len": 4,
        "recompute": "full",
        "layer_bytes": 192,
        "recompute_bytes": 3744,
        "outside_bytes": 1248,
        "total_bytes": 5376,
    }


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"micro_batch": 0, "seq_len": 4}, "micro-batch must be an int >= 1, got 0"),
        ({"micro_batch": -2, "seq_len": 4}, "micro-batch must be an int >= 1, got -2"),
        ({"micro_batch": True, "seq_len": 4}, "micro-batch must be an int >= 1, got True"),
        ({"micro_batch": 1, "seq_len": 2.5}, "sequence length must be an int >= 1, got 2.5"),
        (
            {"micro_batch": 1, "seq_len": 4, "recompute": "partial"},
            "recompute must be one of none, selective",
        ),
    ],
)
def test_bad_sizes_are_config_errors(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        activation_memory(SMALL, **kwargs)


def test_bad_dimensions_are_config_errors():
    with pytest.raises(ConfigError, match="layers must be an int >= 1, got 0"):
        TransformerDims(layers=0, hidden=8, heads=2, vocab=16)
    with pytest.raises(ConfigError, match="dims must be a TransformerDims"):
        activation_memory((2, 8, 2, 16), micro_batch=1, seq_len=4)


# ----------------------------------------------------------------- dimensions of models
@pytest.mark.parametrize("name", preset_names())
def test_preset_dims_agree_with_the_preset_shapes(name):
    dims = preset_dims(name)
    shapes = {s.name: s.shape for s in preset_specs(name)}
    embedding = shapes.get("transformer.wte.weight") or shapes["model.embed_tokens.weight"]
    assert embedding == (dims.vocab, dims.hidden)
    blocks = {n.split(".")[2] for n in shapes if n.split(".")[1] in ("h", "layers")}
    assert len(blocks) == dims.layers
    assert dims.hidden % dims.heads == 0


def test_preset_dims_of_the_published_models():
    assert preset_dims("gpt2") == TransformerDims(layers=12, hidden=768, heads=12, vocab=50257)
    assert preset_dims("gpt2-xl") == TransformerDims(layers=48, hidden=1600, heads=25, vocab=50257)
    assert preset_dims("llama-7b") == TransformerDims(layers=32, hidden=4096, heads=32, vocab=32000)
    assert preset_dims("llama-70b") == TransformerDims(layers=80, hidden=8192, heads=64, vocab=32000)
    assert preset_dims("mixtral-8x7b") == TransformerDims(layers=32, hidden=4096, heads=32, vocab=32000)
    with pytest.raises(ConfigError, match="unknown preset 'llama-8b'"):
        preset_dims("llama-8b")


def test_dims_from_hugging_face_configs():
    llama = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "vocab_size": 32000}
    assert dims_from_config(llama) == preset_dims("llama-7b")
    gpt2 = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000, "n_inner": None}
    assert dims_from_config(gpt2) == TransformerDims(layers=2, hidden=64, heads=2, vocab=1000)


def test_a_config_without_a_dimension_names_the_keys_tried():
    with pytest.raises(ConfigError, match="no num_attention_heads / n_head / num_heads"):
        dims_from_config({"n_layer": 2, "n_embd": 64, "vocab_size": 1000})
    with pytest.raises(ConfigError, match="vocabulary size must be an int >= 1, got '1000'"):
        dims_from_config({"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": "1000"})
