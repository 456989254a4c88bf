"""Model weight files in the ecosystem's formats, written one tensor at a time.

[Note: streamed weight files]
``zeroplan export`` must hold no more than one tensor (see [Note: offline
export] in ``checkpoint.export``), so a ``.safetensors`` file is written here
rather than by ``safetensors.torch.save_file``, which first turns every tensor
of the file into bytes. The format is simple: an 8-byte little-endian header
length, a JSON header (padded with spaces to a multiple of 8 bytes) giving
each tensor's dtype, shape and ``data_offsets`` in the data that follows, and
``__metadata__`` ``{"format": "pt"}``; then the tensors' bytes, in header
order, back to back. The header needs only names, dtypes and shapes, which the
manifest gives before any data is read; each tensor's bytes are then written
as they are read, in parts. A ``torch.save`` file (``--format torch``) needs
all its tensors at once: it holds one output file's tensors, at most
``max_shard_size`` bytes (a single tensor larger than the cap gets a file of
its own, as in Hugging Face).

Files larger than ``max_shard_size`` are split as ``save_pretrained`` does:
tensors in order, a new file when the next would pass the cap, named
``model-00001-of-00003.safetensors`` (``pytorch_model-00001-of-00003.bin``)
with an index ``model.safetensors.index.json`` (``pytorch_model.bin.index.json``)
mapping every name to its file.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import torch

from zeroplan.core import ConfigError
from zeroplan.core.errors import require

__all__ = ["Format", "OutTensor", "parse_size", "plan_files", "write_file", "write_index"]

#: safetensors' dtype names.
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")


class Format(str, Enum):
    """The file format weights are written in: its file names and index name."""

    SAFETENSORS = "safetensors"
    TORCH = "torch"

    @property
    def stem(self) -> str:
        """The file name without shard numbers."""
        return "model.safetensors" if self is Format.SAFETENSORS else "pytorch_model.bin"

    def shard_name(self, number: int, count: int) -> str:
        """The name of file ``number`` (from 1) of ``count``, or :attr:`stem` for a single file.

        Example:
            >>> Format.SAFETENSORS.shard_name(2, 3), Format.TORCH.shard_name(1, 1)
            ('model-00002-of-00003.safetensors', 'pytorch_model.bin')
        """
        if count == 1:
            return self.stem
        base, extension = self.stem.rsplit(".", 1)
        return f"{base}-{number:05d}-of-{count:05d}.{extension}"

    @property
    def index(self) -> str:
        """The index of a split export."""
        return self.stem + ".index.json"


def parse_size(text: str | int) -> int:
    """Bytes of a size in Hugging Face's convention: ``"5GB"`` is 5e9, ``"5GiB"`` 5 * 2**30.

    Example:
        >>> parse_size("5GB"), parse_size("1.5MiB"), parse_size("200KB"), parse_size(64)
        (5000000000, 1572864, 200000, 64)

    Raises:
        ConfigError: not a positive size.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    else:
        match = _SIZE.fullmatch(str(text))
        unit = match.group(2).upper() if match else ""
        if match is None or unit not in _UNITS:
            raise ConfigError(
                f"--max-shard-size {text!r} is no size: write a number of bytes with an optional unit, "
                "such as 5GB, 500MB or 2GiB"
            )
        size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise ConfigError(f"--max-shard-size must be at least 1 byte, got {text!r}")
    return size


@dataclass(frozen=True, slots=True, kw_only=True)
class OutTensor:
    """A tensor of the output: its name, shape and dtype (its values come later, in parts).

    Attributes:
        name: the name it is written under.
        shape: its shape.
        dtype: the dtype it is written in.
        nbytes: its bytes (derived).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        numel = 1
        for n in self.shape:
            numel *= n
        object.__setattr__(self, "nbytes", numel * self.dtype.itemsize)


def plan_files(tensors: Sequence[OutTensor], max_bytes: int) -> list[list[OutTensor]]:
    """``tensors`` in order, split into files of at most ``max_bytes`` (a larger tensor alone).

    Example:
        >>> sizes = [("a", 2), ("b", 2), ("c", 5)]
        >>> t = [OutTensor(name=n, shape=(k,), dtype=torch.float32) for n, k in sizes]
        >>> [[x.name for x in f] for f in plan_files(t, 16)]
        [['a', 'b'], ['c']]
    """
    files: list[list[OutTensor]] = [[]]
    used = 0
    for tensor in tensors:
        if files[-1] and used + tensor.nbytes > max_bytes:
            files.append([])
            used = 0
        files[-1].append(tensor)
        used += tensor.nbytes
    return files


def _raw(part: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor, without a copy."""
    return memoryview(part.reshape(-1).view(torch.uint8).numpy())


def _safetensors_header(tensors: Sequence[OutTensor]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise ConfigError(
                f"{t.name!r} is {t.dtype}, which safetensors cannot hold; export --format torch"
            )
        header[t.name] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


def write_file(
    path: Path,
    tensors: Sequence[OutTensor],
    parts_of: Callable[[OutTensor], Iterable[torch.Tensor]],
    fmt: Format,
) -> int:
    """Write ``tensors`` to ``path`` in ``fmt``; ``parts_of(t)`` yields ``t``'s values, flat, in order.

    A safetensors file holds one part at a time (see [Note: streamed weight
    files]); a torch file all of its tensors. Returns the file's size.

    Raises:
        CheckpointError: from ``parts_of`` (a damaged checkpoint).
        PlanInvariantError: the parts of a tensor are not its bytes.
    """
    if fmt is Format.TORCH:
        torch.save({t.name: _whole(t, parts_of(t)) for t in tensors}, path)
        return path.stat().st_size
    with open(path, "wb") as handle:
        handle.write(_safetensors_header(tensors))
        for t in tensors:
            written = 0
            for part in parts_of(t):
                data = _raw(part.contiguous().to(t.dtype))
                handle.write(data)
                written += data.nbytes
            _require_size(t, written)
    return path.stat().st_size


def _whole(t: OutTensor, parts: Iterable[torch.Tensor]) -> torch.Tensor:
    """Tensor ``t`` assembled from its parts, in its own storage."""
    out = torch.empty(t.shape, dtype=t.dtype)
    flat, at = out.view(-1), 0
    for part in parts:
        flat[at : at + part.numel()] = part
        at += part.numel()
    _require_size(t, at * t.dtype.itemsize)
    return out


def _require_size(t: OutTensor, written: int) -> None:
    require(written == t.nbytes, f"{t.name!r}: {written} bytes written, its shape and dtype make {t.nbytes}")


def write_index(path: Path, files: Sequence[tuple[str, Sequence[OutTensor]]]) -> None:
    """Write the index of a split export: ``total_size`` and each tensor's file."""
    total = sum(t.nbytes for _, tensors in files for t in tensors)
    weight_map = {t.name: name for name, tensors in files for t in tensors}
    document = {"metadata": {"total_size": total}, "weight_map": weight_map}
    path.write_text(json.dumps(document, indent=2, sort_keys=False) + "\n")
