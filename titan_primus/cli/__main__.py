"""``python -m titan_primus.cli``: the same as the ``titan-primus`` command."""

import sys

from . import main

sys.exit(main())
