"""Makes the helpers beside the tests importable (``--import-mode=importlib`` adds no path)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
