"""The benchmark harness for the scripts beside this file and the lab tools in tools/: ``moe_nvfp4.bench.harness``,
which ships in the package (``moe-nvfp4 bench`` uses it), under the name they import (``from harness import
time_graph``)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's moe_nvfp4

from moe_nvfp4.bench.harness import *  # noqa: E402,F401,F403
from moe_nvfp4.bench.harness import __all__  # noqa: E402,F401
