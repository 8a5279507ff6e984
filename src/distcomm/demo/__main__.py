"""``python -m distcomm.demo``: the demo's launcher, and with ``--worker`` one of its workers."""

import sys

from . import main

sys.exit(main())
