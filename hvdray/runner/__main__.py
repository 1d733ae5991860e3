"""``python -m hvdray.runner``: the same as the ``hvdrayrun`` command."""

import sys

from hvdray.runner.cli import main

if __name__ == "__main__":  # importing the module (a docs build inspecting the package) runs nothing
    sys.exit(main())
