"""Checkpoint files: tensors and plain data only, with block checksums, written atomically.

Files are ``torch.save`` archives of ``{"tensors": {name: tensor}, "crc": {name:
[crc32 per block]}}`` and load with ``torch.load(weights_only=True, mmap=True)``:
a reader touches only the blocks it needs, and verifies exactly those (the
manifest's file sizes catch truncation before any read). The manifest is JSON
(tuples, tensors and non-string keys encoded explicitly).

[Note: mapped pages]
``torch.load(mmap=True)`` maps the whole file, privately, for as long as any
tensor views it: a ``TensorFile`` keeps it mapped while it is open. Every page
a read touches is then mapped into the process and counts in its resident set
until the mapping goes, so a reader that walks a whole checkpoint (``zeroplan
export``, ``inspect``) would end up holding every page it read: exporting 403
MB of weights peaked at 718 MB resident against a 312 MB import (452 MB with
the pages released; docs/benchmarks.md, "Export's resident memory").
``TensorFile.release()`` gives back the pages of the tensors read since the
last release (``madvise(MADV_DONTNEED)`` over the pages lying wholly inside
each one's storage). The pages are clean (nothing writes into what a read
returns), so a later access maps them again from the file, usually from the
page cache, and sees the same bytes: views already returned and blocks already
verified stay valid. Elsewhere than Linux, whose semantics this relies on,
``release`` does nothing and the pages stay until the file is closed. ``load``
does not release: what it reads it holds until installed, and its files are
closed, their mappings gone, when it returns.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from zeroplan.core import CheckpointError
from zeroplan.facade.mechanisms.torch_dtypes import dtype_name, torch_dtype
from zeroplan.facade.state.tree import TensorMeta, tensor_meta

__all__ = [
    "BLOCK_BYTES",
    "TensorFile",
    "decode",
    "encode",
    "read_json",
    "write_json",
    "write_tensors",
]

#: Checksum granularity: a reader verifies (and reads) whole blocks of this size.
BLOCK_BYTES = 1 << 20


def _bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy())


def _block_elements(tensor: torch.Tensor) -> int:
    return max(1, BLOCK_BYTES // max(1, tensor.element_size()))


def _crcs(tensor: torch.Tensor) -> list[int]:
    flat = tensor.detach().reshape(-1)
    step = _block_elements(tensor)
    return [zlib.crc32(_bytes(flat[i : i + step])) for i in range(0, max(flat.numel(), 1), step)]


def _find_madvise() -> Callable[[int, int, int], int] | None:
    """The C library's ``madvise`` on Linux, else ``None`` (see [Note: mapped pages])."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTNEED"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


_MADVISE = _find_madvise()


def _drop_pages(storage: torch.UntypedStorage) -> None:
    """Drop from the resident set the pages wholly inside ``storage``, a file mapping ([Note: mapped pages]).

    Advice only: if the kernel refuses, the pages stay mapped.
    """
    start, stop = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    first = start + (-start) % mmap.PAGESIZE
    last = stop - stop % mmap.PAGESIZE
    if _MADVISE is not None and last > first:
        _MADVISE(first, last - first, mmap.MADV_DONTNEED)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor alone: ``torch.save`` would otherwise store the whole storage behind a view."""
    whole = (
        tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )
    return tensor if whole and tensor.is_contiguous() else tensor.clone(memory_format=torch.contiguous_format)


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    """Write ``tensors`` (moved to CPU) with block checksums; fsync; return the file size."""
    cpu = {name: _compact(t.detach().cpu()) for name, t in tensors.items()}
    torch.save({"tensors": cpu, "crc": {name: _crcs(t) for name, t in cpu.items()}}, path)
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())
    return path.stat().st_size


def _contents(path: Path, loaded: Any) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """The tensors and checksums of a loaded file, after checking that they are what we write."""
    not_ours = f"checkpoint file {str(path)!r} is not a zeroplan tensor file"
    if not isinstance(loaded, dict) or not isinstance(loaded.get("tensors"), dict):
        raise CheckpointError(not_ours)
    tensors, crc = loaded["tensors"], loaded.get("crc")
    if not isinstance(crc, dict):
        raise CheckpointError(not_ours)
    for name, tensor in tensors.items():
        if not (isinstance(name, str) and torch.is_tensor(tensor)):
            raise CheckpointError(
                f"{not_ours}: its entry {name!r} is a {type(tensor).__name__}, not a tensor "
                "(the file was crafted or damaged): restore it from a copy or load another snapshot"
            )
        checksums = crc.get(name)
        if not (isinstance(checksums, list) and all(type(c) is int for c in checksums)):
            raise CheckpointError(f"{not_ours}: the checksums of {name!r} are missing or not integers")
    return tensors, crc


class TensorFile:
    """A checkpoint file opened lazily (memory-mapped) whose reads are checksum-verified.

    The pages a read touches stay resident until :meth:`release` (see [Note: mapped pages]).
    """

    def __init__(self, path: Path, size: int | None = None) -> None:
        self.path = path
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {str(path)!r} is missing")
        if size is not None and path.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint file {str(path)!r} has {path.stat().st_size} bytes, the manifest says {size}: "
                "it is truncated or was replaced"
            )
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # truncated archives surface as several error types
            raise CheckpointError(
                f"checkpoint file {str(path)!r} is unreadable (truncated or corrupted): {exc}"
            ) from None
        self._tensors, self._crc = _contents(path, loaded)
        self._verified: set[tuple[str, int]] = set()
        self._touched: set[str] = set()  # tensors read since the last release

    def names(self) -> list[str]:
        """Names of the tensors in the file."""
        return list(self._tensors)

    def meta(self, name: str) -> TensorMeta:
        """Shape and dtype of tensor ``name`` (no data is read)."""
        return tensor_meta(self._get(name))

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` verified whole (it is read completely)."""
        t = self._get(name)
        return self.read(name, 0, t.numel()).view(t.shape)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name`` (no data is read)."""
        return tuple(self._get(name).shape)

    def _get(self, name: str) -> torch.Tensor:
        if name not in self._tensors:
            raise CheckpointError(f"checkpoint file {str(self.path)!r} lacks tensor {name!r}")
        return self._tensors[name]

    def read(self, name: str, start: int, stop: int, *, verify: bool = True) -> torch.Tensor:
        """Elements ``[start, stop)`` of tensor ``name`` (flattened), after verifying their blocks.

        ``verify=False`` skips the checksums: for pieces that several ranks
        read and one of them verifies (all ranks agree before committing).
        """
        flat = self._get(name).reshape(-1)
        self._touched.add(name)
        if not 0 <= start <= stop <= flat.numel():
            raise CheckpointError(
                f"{str(self.path)!r}: tensor {name!r} has {flat.numel()} elements, "
                f"range [{start}, {stop}) requested"
            )
        if not verify:
            return flat[start:stop]
        step = _block_elements(flat)
        crcs = self._crc.get(name, [])
        first, last = start // step, max(start, stop - 1) // step
        for block in range(first, last + 1):
            if (name, block) in self._verified:
                continue
            lo, hi = block * step, min(flat.numel(), (block + 1) * step)
            if block >= len(crcs) or zlib.crc32(_bytes(flat[lo:hi])) != crcs[block]:
                raise CheckpointError(
                    f"checksum mismatch in {str(self.path)!r}, tensor {name!r}, elements [{lo}, {hi}): "
                    "the file is corrupted"
                )
            self._verified.add((name, block))
        return flat[start:stop]

    def release(self) -> None:
        """Give the pages read since the last release back to the kernel ([Note: mapped pages]).

        What reads returned stays valid and equal: its pages are read again from the file when
        next touched. Callers must not have written into it.
        """
        for name in sorted(self._touched):
            _drop_pages(self._tensors[name].untyped_storage())
        self._touched.clear()


def encode(value: Any) -> Any:
    """Plain JSON form of ``value`` (tensors, tuples and non-string keys encoded explicitly)."""
    if torch.is_tensor(value):
        return {
            "__tensor__": value.detach().cpu().reshape(-1).tolist(),
            "dtype": dtype_name(value.dtype),
            "shape": list(value.shape),
        }
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not any(k.startswith("__") for k in value):
            return {k: encode(v) for k, v in value.items()}
        return {"__items__": [[encode(k), encode(v)] for k, v in value.items()]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(f"cannot store a {type(value).__name__} in a checkpoint manifest: {value!r:.80}")


def decode(value: Any) -> Any:
    """Inverse of :func:`encode`."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        if "__tensor__" in value:
            data = torch.tensor(value["__tensor__"], dtype=torch_dtype(value["dtype"]))
            return data.reshape(value["shape"])
        if "__tuple__" in value:
            return tuple(decode(v) for v in value["__tuple__"])
        if "__items__" in value:
            return {decode(k): decode(v) for k, v in value["__items__"]}
        return {k: decode(v) for k, v in value.items()}
    return value


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Write ``document`` to ``path`` through a temporary file, fsynced, then atomically renamed."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as handle:
        json.dump(document, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    _fsync_dir(path.parent)


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON document, turning any failure into :class:`CheckpointError`."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{str(path)!r} is missing: not a complete zeroplan checkpoint") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{str(path)!r} is unreadable: {exc}") from None
