# zeroplan.core — pure planning: no torch, no I/O.
# Parameter lists of well-known architectures, built from their formulas.
"""Model presets: parameter specs and dimensions of known architectures, from their formulas.

Shapes follow the Hugging Face implementations (``(out, in)`` for linear
weights in Llama/Mixtral, GPT-2's ``Conv1D`` ``(in, out)``), so a preset's
specs match :func:`~zeroplan.core.specs.specs_from_module` on the real model
up to names of tied weights (GPT-2's ``lm_head`` is tied to ``wte`` and appears
once).

:func:`preset_dims` gives the dimensions the activations depend on (see
:mod:`zeroplan.core.sizing.activations`), from the same architecture values.

Example:
    >>> specs = preset_specs("gpt2")
    >>> sum(s.numel for s in specs)
    124439808
    >>> preset_dims("llama-70b")
    TransformerDims(layers=80, hidden=8192, heads=64, vocab=32000)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from zeroplan.core.errors import ConfigError
from zeroplan.core.sizing.activations import TransformerDims
from zeroplan.core.specs import ParamSpec

__all__ = ["PRESETS", "preset_dims", "preset_names", "preset_specs"]

Shapes = list[tuple[str, tuple[int, ...]]]


class Architecture(Protocol):
    """A preset: its parameter shapes and its dimensions, from one set of values."""

    def shapes(self) -> Shapes: ...

    def dims(self) -> TransformerDims: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class _Gpt2:
    layers: int
    width: int
    heads: int
    vocab: int = 50257
    positions: int = 1024

    def dims(self) -> TransformerDims:
        return TransformerDims(layers=self.layers, hidden=self.width, heads=self.heads, vocab=self.vocab)

    def shapes(self) -> Shapes:
        d = self.width
        out: Shapes = [
            ("transformer.wte.weight", (self.vocab, d)),
            ("transformer.wpe.weight", (self.positions, d)),
        ]
        for i in range(self.layers):
            h = f"transformer.h.{i}"
            out += [
                (f"{h}.ln_1.weight", (d,)),
                (f"{h}.ln_1.bias", (d,)),
                (f"{h}.attn.c_attn.weight", (d, 3 * d)),
                (f"{h}.attn.c_attn.bias", (3 * d,)),
                (f"{h}.attn.c_proj.weight", (d, d)),
                (f"{h}.attn.c_proj.bias", (d,)),
                (f"{h}.ln_2.weight", (d,)),
                (f"{h}.ln_2.bias", (d,)),
                (f"{h}.mlp.c_fc.weight", (d, 4 * d)),
                (f"{h}.mlp.c_fc.bias", (4 * d,)),
                (f"{h}.mlp.c_proj.weight", (4 * d, d)),
                (f"{h}.mlp.c_proj.bias", (d,)),
            ]
        return [*out, ("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Llama:
    layers: int
    width: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int = 32000
    experts: int = 0

    def dims(self) -> TransformerDims:
        return TransformerDims(layers=self.layers, hidden=self.width, heads=self.heads, vocab=self.vocab)

    def shapes(self) -> Shapes:
        d, f = self.width, self.ffn
        kv = self.kv_heads * (d // self.heads)
        out: Shapes = [("model.embed_tokens.weight", (self.vocab, d))]
        for i in range(self.layers):
            h = f"model.layers.{i}"
            out += [
                (f"{h}.self_attn.q_proj.weight", (d, d)),
                (f"{h}.self_attn.k_proj.weight", (kv, d)),
                (f"{h}.self_attn.v_proj.weight", (kv, d)),
                (f"{h}.self_attn.o_proj.weight", (d, d)),
            ]
            if self.experts:
                out.append((f"{h}.block_sparse_moe.gate.weight", (self.experts, d)))
                for e in range(self.experts):
                    x = f"{h}.block_sparse_moe.experts.{e}"
                    out += [
                        (f"{x}.w1.weight", (f, d)),
                        (f"{x}.w2.weight", (d, f)),
                        (f"{x}.w3.weight", (f, d)),
                    ]
            else:
                out += [
                    (f"{h}.mlp.gate_proj.weight", (f, d)),
                    (f"{h}.mlp.up_proj.weight", (f, d)),
                    (f"{h}.mlp.down_proj.weight", (d, f)),
                ]
            out += [(f"{h}.input_layernorm.weight", (d,)), (f"{h}.post_attention_layernorm.weight", (d,))]
        return [*out, ("model.norm.weight", (d,)), ("lm_head.weight", (self.vocab, d))]


PRESETS: dict[str, Architecture] = {
    "gpt2": _Gpt2(layers=12, width=768, heads=12),
    "gpt2-medium": _Gpt2(layers=24, width=1024, heads=16),
    "gpt2-large": _Gpt2(layers=36, width=1280, heads=20),
    "gpt2-xl": _Gpt2(layers=48, width=1600, heads=25),
    "llama-7b": _Llama(layers=32, width=4096, ffn=11008, heads=32, kv_heads=32),
    "llama-13b": _Llama(layers=40, width=5120, ffn=13824, heads=40, kv_heads=40),
    "llama-70b": _Llama(layers=80, width=8192, ffn=28672, heads=64, kv_heads=8),
    "mixtral-8x7b": _Llama(layers=32, width=4096, ffn=14336, heads=32, kv_heads=8, experts=8),
}


def preset_names() -> tuple[str, ...]:
    """Names of the presets."""
    return tuple(PRESETS)


def _preset(name: str) -> Architecture:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None


def preset_specs(name: str, dtype: str = "float32") -> tuple[ParamSpec, ...]:
    """Specs of preset ``name`` with every parameter in ``dtype``.

    Raises:
        ConfigError: unknown preset (the message lists the known ones).
    """
    shapes = _preset(name).shapes()
    return tuple(
        ParamSpec(index=i, name=pname, shape=shape, dtype=dtype) for i, (pname, shape) in enumerate(shapes)
    )


def preset_dims(name: str) -> TransformerDims:
    """Layers, hidden size, attention heads and vocabulary of preset ``name``.

    Raises:
        ConfigError: unknown preset (the message lists the known ones).

    Example:
        >>> preset_dims("gpt2-xl")
        TransformerDims(layers=48, hidden=1600, heads=25, vocab=50257)
    """
    return _preset(name).dims()
