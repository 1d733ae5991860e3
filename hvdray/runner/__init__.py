"""``hvdrayrun``: run an unmodified Horovod-style script on Ray workers, like ``horovodrun``.

``hvdrayrun -np 4 python train.py ARGS`` (also ``python -m hvdray.runner ...``).
"""

from hvdray.runner.cli import main

__all__ = ["main"]
