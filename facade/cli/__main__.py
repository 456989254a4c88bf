"""``python -m zeroplan.facade.cli``: the ``zeroplan`` console script."""

from __future__ import annotations

import sys

from zeroplan.facade.cli import main

sys.exit(main())
