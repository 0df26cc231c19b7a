"""``python -m leangrad ...`` (and ``torchrun -m leangrad train ...``): the ``leangrad`` command."""

import sys

from .cli import main

sys.exit(main())
