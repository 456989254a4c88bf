"""Where the GPU suite keeps what its scenarios measured: ``$ZEROPLAN_CUDA_OUT``, when set.

A GPU is lent for minutes; a failed assertion shows one value, the numbers behind it are in
these files (``benchmarks/gpu_validate.sh`` sets the folder and brings it back).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def keep(name: str, result: Any) -> None:
    """Write ``result`` as ``<name>.json`` under ``$ZEROPLAN_CUDA_OUT`` (nothing when unset)."""
    folder = os.environ.get("ZEROPLAN_CUDA_OUT")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{name}.json").write_text(json.dumps(result, indent=1))
