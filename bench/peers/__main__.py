"""``python -m bench.peers``: see ``bench.peers.driver``."""

from __future__ import annotations

import sys

from bench.peers.driver import main

sys.exit(main())
