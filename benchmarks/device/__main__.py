"""`python -m benchmarks.device`: the device benchmark (bench.py)."""

import sys

from .bench import main

sys.exit(main())
