"""``python -m kiln`` is the ``kiln`` command."""

import sys

from kiln.commands import main

sys.exit(main())
