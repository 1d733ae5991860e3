"""``python -m hvdray.runner``: the same as the ``hvdrayrun`` command."""

import sys

from hvdray.runner.cli import main

sys.exit(main())
