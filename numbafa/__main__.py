"""``python -m numbafa``: see :mod:`numbafa.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
