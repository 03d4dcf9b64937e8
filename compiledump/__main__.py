"""``python -m compiledump``: the same command line as the ``compiledump`` console script."""

import sys

from .cli import main

sys.exit(main())
