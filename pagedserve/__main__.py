"""``python -m pagedserve ...`` is the ``pagedserve`` command."""

import sys

from pagedserve.server.cli import main

sys.exit(main())
