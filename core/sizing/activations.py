# zeroplan.core — pure planning: no torch, no I/O.
# The activations of a transformer's training step, from Korthikanti et al. (2022).
"""Activation memory of one rank's micro-batch, by the formulas of Korthikanti et al.

[Note: activation memory]
The bytes autograd keeps from the forward for the backward of a GPT-style
transformer, from "Reducing Activation Recomputation in Large Transformer
Models" (Korthikanti et al., 2022; arXiv:2205.05198, MLSys 2023), with no
tensor, sequence or pipeline parallelism (``t = p = 1``: zeroplan is data
parallel, so every rank keeps the activations of its own micro-batch whole).
``s`` is the sequence length, ``b`` the micro-batch, ``h`` the hidden size,
``a`` the attention heads, ``v`` the vocabulary and ``L`` the layers. All
terms are bytes of 16-bit activations (1-byte dropout masks):

* per layer, everything stored (:attr:`Recompute.NONE`), Equation 1:
  ``s*b*h*(34 + 5*a*s/h) = 34*s*b*h + 5*a*s*s*b`` (Equation 5 with ``t = 1``
  sums it over the ``L`` layers);
* selective recomputation (:attr:`Recompute.SELECTIVE`), Equation 6 with
  ``t = 1``: ``34*s*b*h`` per layer; the attention core (``QK^T``, softmax,
  its dropout, attention over ``V``: the ``5*a*s*s*b`` term) is recomputed.
  FlashAttention keeps no ``s x s`` tensor either, so this is also the figure
  for a model using it without recomputation;
* full recomputation (:attr:`Recompute.FULL`), Section 5 and Table 2:
  ``2*s*b*h`` per layer (its input, the checkpoint), plus one layer's worth,
  Equation 1, alive while that layer is recomputed in the backward. (Counting
  that layer's input twice, as checkpoint and inside Equation 1, adds
  ``2*s*b*h``: an upper bound.) With few layers and long sequences, this can
  exceed selective recomputation (``34 + 5*a*s/h > 32*L``);
* outside the layers, in every mode, Section 4.3 with ``p = t = 1``: the
  embedding dropout's mask ``s*b*h``, the final layer norm's input ``2*s*b*h``,
  the output projection's input ``2*s*b*h`` and the fp32 logits the cross
  entropy keeps, ``4*s*b*v``: ``5*s*b*h + 4*s*b*v`` in all.

Left out, as in the paper: layer-norm statistics (``2*s*b`` per norm),
position embeddings, the loss itself and the batch, and the gradient of the
logits (``4*s*b*v`` while the backward starts; a fused linear + cross entropy
keeps neither). The formula describes the paper's layer (multi-head attention,
a ``4h`` GeLU MLP, dropout); for Llama/Mixtral presets (SwiGLU MLPs of another
width, grouped-query attention, no dropout, Mixtral's two experts per token)
it is an approximation. Memory the allocator holds beyond these tensors
(fragmentation, the CUDA context, NCCL's buffers) is not planned either.

Example:
    >>> gpt2 = TransformerDims(layers=12, hidden=768, heads=12, vocab=50257)
    >>> a = activation_memory(gpt2, micro_batch=8, seq_len=1024, recompute="selective")
    >>> a.layer_bytes == 34 * 1024 * 8 * 768
    True
    >>> round(a.total_bytes / 2**30, 2)
    3.95
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from zeroplan.core.errors import ConfigError, check_config

__all__ = ["ActivationMemory", "Recompute", "TransformerDims", "activation_memory", "dims_from_config"]


class Recompute(str, Enum):
    """What the backward recomputes instead of keeping (see [Note: activation memory])."""

    NONE = "none"
    """Every activation of every layer is kept (Equation 1)."""
    SELECTIVE = "selective"
    """The attention core is recomputed; ``34*s*b*h`` per layer kept (Equation 6)."""
    FULL = "full"
    """Only each layer's input is kept; one layer at a time is recomputed."""

    def __str__(self) -> str:
        return self.value


def _positive(value: Any, what: str) -> None:
    check_config(type(value) is int and value >= 1, f"{what} must be an int >= 1, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TransformerDims:
    """The dimensions of a decoder-only transformer that its activations depend on.

    Attributes:
        layers: transformer layers ``L``.
        hidden: hidden size ``h``.
        heads: attention (query) heads ``a``.
        vocab: vocabulary size ``v``.

    Example:
        >>> TransformerDims(layers=2, hidden=64, heads=0, vocab=100)
        Traceback (most recent call last):
        ...
        zeroplan.core.errors.ConfigError: attention heads must be an int >= 1, got 0
    """

    layers: int
    hidden: int
    heads: int
    vocab: int

    def __post_init__(self) -> None:
        _positive(self.layers, "layers")
        _positive(self.hidden, "hidden size")
        _positive(self.heads, "attention heads")
        _positive(self.vocab, "vocabulary size")


#: The keys of a Hugging Face ``config.json`` that hold each dimension, in the order they are tried.
HF_KEYS: dict[str, tuple[str, ...]] = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "heads": ("num_attention_heads", "n_head", "num_heads"),
    "vocab": ("vocab_size",),
}


def dims_from_config(values: Mapping[str, Any]) -> TransformerDims:
    """The dimensions written in a Hugging Face config (``config.json``'s mapping).

    Args:
        values: the config's keys and values (``num_hidden_layers`` or
            ``n_layer``, ``hidden_size`` or ``n_embd``, ``num_attention_heads``
            or ``n_head``, ``vocab_size``; see :data:`HF_KEYS`).

    Raises:
        ConfigError: a dimension is missing (the message names the keys tried)
            or is not an int >= 1.

    Example:
        >>> dims_from_config({"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 1000})
        TransformerDims(layers=2, hidden=64, heads=2, vocab=1000)
    """
    found: dict[str, Any] = {}
    for name, keys in HF_KEYS.items():
        present = [k for k in keys if values.get(k) is not None]
        if not present:
            raise ConfigError(
                f"the config has no {' / '.join(keys)}: the activations need the model's {name}"
            )
        found[name] = values[present[0]]
    return TransformerDims(**found)


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivationMemory:
    """Activation bytes of one micro-batch on one rank (see [Note: activation memory]).

    Attributes:
        dims: the model's dimensions.
        micro_batch: sequences per rank per forward (``b``).
        seq_len: tokens per sequence (``s``).
        recompute: what the backward recomputes.
        layer_bytes: kept per layer (derived).
        recompute_bytes: alive while one layer is recomputed (full recomputation
            only, derived).
        outside_bytes: embedding dropout, final norm, output projection and fp32
            logits (derived).
        total_bytes: everything alive when the backward starts (derived).
    """

    dims: TransformerDims
    micro_batch: int
    seq_len: int
    recompute: Recompute = Recompute.NONE
    layer_bytes: int = field(init=False)
    recompute_bytes: int = field(init=False)
    outside_bytes: int = field(init=False)
    total_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        check_config(
            isinstance(self.dims, TransformerDims), f"dims must be a TransformerDims, got {self.dims!r}"
        )
        _positive(self.micro_batch, "micro-batch")
        _positive(self.seq_len, "sequence length")
        try:
            object.__setattr__(self, "recompute", Recompute(self.recompute))
        except ValueError:
            choices = ", ".join(r.value for r in Recompute)
            raise ConfigError(f"recompute must be one of {choices}, got {self.recompute!r}") from None
        s, b, h, a, v = self.seq_len, self.micro_batch, self.dims.hidden, self.dims.heads, self.dims.vocab
        everything = 34 * s * b * h + 5 * a * s * s * b  # Equation 1: s*b*h*(34 + 5*a*s/h)
        layer = {
            Recompute.NONE: everything,
            Recompute.SELECTIVE: 34 * s * b * h,  # Equation 6 with t = 1
            Recompute.FULL: 2 * s * b * h,  # Section 5: the layer's input only
        }
        object.__setattr__(self, "layer_bytes", layer[self.recompute])
        object.__setattr__(self, "recompute_bytes", everything if self.recompute is Recompute.FULL else 0)
        object.__setattr__(self, "outside_bytes", 5 * s * b * h + 4 * s * b * v)
        total = self.dims.layers * self.layer_bytes + self.recompute_bytes + self.outside_bytes
        object.__setattr__(self, "total_bytes", total)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready mapping (the CLI's ``--json`` ``activations`` record)."""
        return {
            "layers": self.dims.layers,
            "hidden": self.dims.hidden,
            "heads": self.dims.heads,
            "vocab": self.dims.vocab,
            "micro_batch": self.micro_batch,
            "seq_len": self.seq_len,
            "recompute": self.recompute.value,
            "layer_bytes": self.layer_bytes,
            "recompute_bytes": self.recompute_bytes,
            "outside_bytes": self.outside_bytes,
            "total_bytes": self.total_bytes,
        }


def activation_memory(
    dims: TransformerDims, *, micro_batch: int, seq_len: int, recompute: Recompute | str = Recompute.NONE
) -> ActivationMemory:
    """Activation bytes of a ``micro_batch`` of ``seq_len`` tokens (see [Note: activation memory]).

    Raises:
        ConfigError: a size that is not an int >= 1, or an unknown ``recompute``.

    Example:
        >>> dims = TransformerDims(layers=4, hidden=16, heads=2, vocab=10)
        >>> [activation_memory(dims, micro_batch=1, seq_len=8, recompute=r).total_bytes
        ...  for r in ("none", "selective", "full")]
        [20928, 18368, 6976]
    """
    return ActivationMemory(dims=dims, micro_batch=micro_batch, seq_len=seq_len, recompute=recompute)
