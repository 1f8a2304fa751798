"""`python -m fusekit.bench.e2e` (see the package docstring)."""

import sys

from fusekit.bench.e2e.cli import main

sys.exit(main())
