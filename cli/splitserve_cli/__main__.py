"""``python -m splitserve_cli``: the same as the ``splitserve`` console command."""

import sys

from splitserve_cli import main

sys.exit(main())
