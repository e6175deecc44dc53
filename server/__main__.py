"""``python -m server ...`` is the ``pagedserve`` command."""

import sys

from server.cli import main

sys.exit(main())
