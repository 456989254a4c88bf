"""Optimizer state held in tensor subclasses, taken apart into plain tensors and put back together.

[Note: subclass state]
torchao's low-bit optimizers keep each moment as a tensor subclass (codes, block
scales and a code table behind one ``OptimState8bit``; see [Note: low-bit
optimizer state]). zeroplan's state codec ([Note: state codec]) stores tensors
by their bytes, so a subclass leaf at ``path`` is split with the protocol torch
itself compiles and serialises subclasses by (``__tensor_flatten__``): its inner
tensors become the leaves ``path@<attr>`` and its class, flatten context, shape
and stride the plain value ``path@subclass``. Joining rebuilds the object with
``__tensor_unflatten__``. A checkpoint names a class by module and qualified name;
only classes registered with ``torch.serialization.add_safe_globals`` are built
from it (torchao registers its own), as ``torch.load(weights_only=True)`` would,
and no module is imported on a checkpoint's word.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from zeroplan.core import CheckpointError
from zeroplan.facade.mechanisms.torch_dtypes import dtype_name, torch_dtype

__all__ = ["SUBCLASS", "copy_tensor", "join_subclasses", "split_subclasses"]

#: The suffix of the plain value that describes a subclass leaf.
SUBCLASS = "@subclass"
#: How a ``torch.dtype`` in a flatten context is written (the other values are plain data).
_DTYPE = "zeroplan_dtype"


def _context(value: Any, cls: type) -> Any:
    """A flatten context as plain data (bools, numbers, strings, dtypes, in lists and tuples)."""
    if isinstance(value, torch.dtype):
        return {_DTYPE: dtype_name(value)}
    if isinstance(value, (list, tuple)):
        return type(value)(_context(v, cls) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(
        f"cannot store state of class {cls.__qualname__}: its flatten context holds a "
        f"{type(value).__name__} ({value!r:.60}); only numbers, strings, dtypes, lists and tuples"
    )


def _uncontext(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {_DTYPE}:
        return torch_dtype(value[_DTYPE])
    if isinstance(value, (list, tuple)):
        return type(value)(_uncontext(v) for v in value)
    return value


def _split(path: str, value: torch.Tensor, out: dict[str, Any]) -> None:
    cls = type(value)
    attrs, context = value.__tensor_flatten__()
    out[path + SUBCLASS] = {
        "class": f"{cls.__module__}:{cls.__qualname__}",
        "attrs": list(attrs),
        "context": _context(context, cls),
        "shape": list(value.shape),
        "stride": list(value.stride()),
    }
    for attr in attrs:
        inner = getattr(value, attr)
        if is_traceable_wrapper_subclass(inner):
            _split(f"{path}@{attr}", inner, out)
        else:
            out[f"{path}@{attr}"] = inner


def copy_tensor(tensor: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """A detached copy of ``tensor`` (onto ``device`` if given); a subclass part by part, as
    torchao's implement no ``clone``."""
    if not is_traceable_wrapper_subclass(tensor):
        return tensor.detach().clone() if device is None else tensor.detach().to(device, copy=True)
    attrs, context = tensor.__tensor_flatten__()
    inner = {attr: copy_tensor(getattr(tensor, attr), device) for attr in attrs}
    return type(tensor).__tensor_unflatten__(inner, context, tensor.size(), tensor.stride())


def split_subclasses(leaves: Mapping[str, Any]) -> dict[str, Any]:
    """``leaves`` with every tensor-subclass leaf split into plain tensors and a description."""
    out: dict[str, Any] = {}
    for path, value in leaves.items():
        if torch.is_tensor(value) and is_traceable_wrapper_subclass(value):
            _split(path, value, out)
        else:
            out[path] = value
    return out


def _class(name: Any, path: str) -> type:
    """The subclass ``module:qualname`` among those registered with ``add_safe_globals``; nothing is
    imported on a checkpoint's word (the optimizer being loaded into has imported its own)."""
    for entry in torch.serialization.get_safe_globals():
        cls = entry[0] if isinstance(entry, tuple) else entry
        if isinstance(cls, type) and f"{cls.__module__}:{cls.__qualname__}" == str(name):
            return cls
    raise CheckpointError(
        f"state {path!r} is a {name}, which is not registered with torch.serialization.add_safe_globals: "
        "import the package whose optimizer saved it (torchao registers its own), or register the class"
    )


def _join(path: str, leaves: dict[str, Any]) -> torch.Tensor:
    meta = leaves.pop(path + SUBCLASS)
    inner = {}
    for attr in meta["attrs"]:
        key = f"{path}@{attr}"
        if key + SUBCLASS in leaves:
            inner[attr] = _join(key, leaves)
        elif key in leaves:
            inner[attr] = leaves.pop(key)
        else:
            raise CheckpointError(f"state {path!r} lacks its part {attr!r}: the state is incomplete")
    cls = _class(meta["class"], path)
    return cls.__tensor_unflatten__(
        inner, _uncontext(meta["context"]), torch.Size(meta["shape"]), tuple(meta["stride"])
    )


def join_subclasses(leaves: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`split_subclasses`.

    Raises:
        CheckpointError: a part is missing, or a class cannot be imported or is not registered.
    """
    out = dict(leaves)
    for path in [
        p[: -len(SUBCLASS)] for p in leaves if p.endswith(SUBCLASS) and "@" not in p[: -len(SUBCLASS)]
    ]:
        out[path] = _join(path, out)
    return out
