"""The GPU suite's helpers (``results``) import by name, as tests/facade's do."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
