"""Where the CLI gets parameter specs: a preset, a JSON list of shapes, or a HF ``config.json``.

I/O lives here (the facade), never in ``zeroplan.core``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zeroplan.core import (
    ConfigError,
    ParamSpec,
    TransformerDims,
    ZeroPlan,
    canonical_dtype,
    dims_from_config,
    preset_specs,
    specs_from_module,
)
from zeroplan.core.sizing.trace import ActivationTrace

__all__ = [
    "dims_from_hf_config",
    "specs_from_hf_config",
    "specs_from_json",
    "specs_from_preset",
    "trace_hf_config",
]


def specs_from_preset(name: str, dtype: str) -> tuple[ParamSpec, ...]:
    """Specs of a built-in preset (see ``zeroplan.core.sizing.presets``)."""
    return preset_specs(name, canonical_dtype(dtype))


def specs_from_json(path: str | Path, dtype: str) -> tuple[ParamSpec, ...]:
    """Specs from a JSON file.

    Accepted forms: a list of shapes (``[[768, 3072], [3072]]``), or a list of
    objects ``{"name", "shape", "dtype"?, "trainable"?}``, optionally under a
    top-level ``"params"`` key. ``dtype`` applies where an entry names none.

    Raises:
        ConfigError: the file is missing, not JSON, or not in one of the forms.
    """
    path = Path(path)
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"shapes file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read shapes file {str(path)!r}: {exc}") from None
    entries = document.get("params") if isinstance(document, dict) else document
    if not isinstance(entries, list) or not entries:
        raise ConfigError(
            f"{str(path)!r} must hold a non-empty list of shapes or of {{'name', 'shape'}} objects"
        )
    specs = []
    for i, entry in enumerate(entries):
        specs.append(_entry_spec(i, entry, dtype, path))
    return tuple(specs)


def _entry_spec(i: int, entry: Any, dtype: str, path: Path) -> ParamSpec:
    where = f"{str(path)!r} entry {i}"
    if isinstance(entry, dict):
        shape, name = entry.get("shape"), entry.get("name", f"p{i}")
        entry_dtype, trainable = entry.get("dtype", dtype), entry.get("trainable", True)
    else:
        shape, name, entry_dtype, trainable = entry, f"p{i}", dtype, True
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise ConfigError(f"{where}: shape must be a list of integers, got {shape!r}")
    if any(d < 0 for d in shape):
        raise ConfigError(f"{where}: shape {shape} has a negative size")
    if not isinstance(trainable, bool):
        raise ConfigError(f"{where}: 'trainable' must be true or false, got {trainable!r}")
    return ParamSpec(
        index=i, name=str(name), shape=tuple(shape), dtype=entry_dtype, trainable=bool(trainable)
    )


def _read_hf_config(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """The file and the values of a HF ``config.json`` (``path`` may be its folder)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        values = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {str(file)!r} does not exist") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read config file {str(file)!r}: {exc}") from None
    if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
        raise ConfigError(
            f"{str(file)!r} must be a JSON object with a string 'model_type' (a HF config.json)"
        )
    return file, values


def dims_from_hf_config(path: str | Path) -> TransformerDims:
    """Layers, hidden size, heads and vocabulary written in a HF ``config.json``.

    Read from the file's keys (``num_hidden_layers`` or ``n_layer``, ...: see
    :func:`zeroplan.core.dims_from_config`); ``transformers`` is not needed, and
    its defaults for keys the file leaves out are not used.

    Raises:
        ConfigError: the file cannot be read, or lacks one of the dimensions.
    """
    file, values = _read_hf_config(path)
    try:
        return dims_from_config(values)
    except ConfigError as exc:
        raise ConfigError(f"{str(file)!r}: {exc}; add it, or pass --activation-bytes") from None


def _hf_model_factory(path: str | Path, dtype: str) -> Callable[[], Any]:
    """A function building the ``config.json`` model in ``dtype``, checked once on the meta device.

    Raises:
        ConfigError: ``transformers`` is missing or the config cannot be read or built.
    """
    file, values = _read_hf_config(path)
    model_type = values.pop("model_type")
    wanted = canonical_dtype(dtype)
    # Validate the file and the dtype first: importing torch and transformers takes seconds.
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ConfigError(
            "--hf-config needs the 'transformers' package: pip install 'zeroplan[hf]'"
        ) from None

    def build() -> Any:
        return AutoModelForCausalLM.from_config(config, torch_dtype=getattr(torch, wanted))

    try:
        config = AutoConfig.for_model(model_type, **values)
        with torch.device("meta"):
            build()
    except Exception as exc:  # transformers raises many types for a bad config; report, don't trace
        detail = " ".join(str(exc).split()) or type(exc).__name__
        detail = detail if len(detail) <= 300 else detail[:300] + " …"
        raise ConfigError(f"cannot build a causal LM from {str(file)!r}: {detail}") from None
    return build


def trace_hf_config(
    path: str | Path,
    dtype: str,
    *,
    seq_len: int,
    micro_batch: int,
    recompute: bool,
    plan: ZeroPlan | None = None,
) -> ActivationTrace:
    """The activations of the ``config.json`` model on ``micro_batch`` sequences of ``seq_len`` tokens,
    traced under fake tensors (see [Note: traced activations]); its loss is the model's own
    (``labels=input_ids``), with gradient checkpointing when ``recompute``; with ``plan``, its
    gradients kept as that plan's schedule keeps them.

    Raises:
        ConfigError: transformers missing, or a config that cannot be built.
        TraceError: the model cannot run under fake tensors.
    """
    import torch

    from zeroplan.facade.diagnostics.activation_trace import trace_activations

    make = _hf_model_factory(path, dtype)

    def build() -> torch.nn.Module:
        model = make()
        if recompute:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model.train()

    def loss_of(model: torch.nn.Module) -> torch.Tensor:
        ids = torch.zeros((micro_batch, seq_len), dtype=torch.long)
        return model(input_ids=ids, labels=ids).loss

    return trace_activations(build, loss_of, plan=plan)


def specs_from_hf_config(path: str | Path, dtype: str) -> tuple[ParamSpec, ...]:
    """Specs of a Hugging Face model built from ``config.json`` on the meta device.

    No weights are downloaded or allocated. Needs ``transformers``.

    Raises:
        ConfigError: ``transformers`` is missing or the config cannot be read.
    """
    import torch

    build = _hf_model_factory(path, dtype)
    with torch.device("meta"):
        model = build()
    wanted = canonical_dtype(dtype)
    return tuple(
        ParamSpec(index=s.index, name=s.name, shape=s.shape, dtype=wanted, trainable=s.trainable)
        for s in specs_from_module(model)
    )
