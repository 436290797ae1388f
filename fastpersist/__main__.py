"""``python -m fastpersist`` runs the ``fastpersist`` command line."""

import sys

from fastpersist.cli import main

sys.exit(main())
