"""Damaging a checkpoint directory the way disks and people do (shared by the checkpoint failure tests)."""

from __future__ import annotations

import zipfile
from pathlib import Path


def snapshot_of(root: Path) -> Path:
    """The snapshot directory ``root/latest`` names."""
    return root / (root / "latest").read_text().strip()


def flip_tensor_byte(path: Path) -> None:
    """Flip one byte in the middle of the largest tensor record of a torch.save archive."""
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as handle:
        handle.seek(info.header_offset + 26)
        name_len = int.from_bytes(handle.read(2), "little")
        extra_len = int.from_bytes(handle.read(2), "little")
        offset = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))
