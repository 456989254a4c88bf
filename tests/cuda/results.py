"""Where the GPU suite keeps what its scenarios measured: ``$ZEROPLAN_CUDA_OUT``, when set.

A GPU is lent for minutes; a failed assertion shows one value, the numbers behind it are in
these files (``benchmarks/gpu_validate.sh`` sets the folder and brings it back).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def keep(name: str, result: Any) -> None:
    """Write ``result`` as ``<name>.json`` under ``$ZEROPLAN_CUDA_OUT`` (nothing when unset)."""
    folder = os.environ.get("ZEROPLAN_CUDA_OUT")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{name}.json").write_text(json.dumps(result, indent=1))


def run_script(script: str, *args: str, timeout: float) -> Any:
    """``python tests/cuda/<script> PORT ARGS`` in a fresh interpreter (NCCL and its default group stay
    out of the test process), on a free port; its last line of output, as JSON. Fails with the tail
    of its stderr if it exits non-zero."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run(
        [sys.executable, str(HERE / script), str(port), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
