"""Launcher kept for ``python benchmarks/bench.py``; the benchmark is :mod:`hvdray.bench` (``hvdray-bench``)."""

import sys

from hvdray.bench import main

if __name__ == "__main__":
    sys.exit(main())
