"""`python -m kubegpu.cli`: the same as the `kubegpu` console script."""

import sys

from kubegpu.cli import main

sys.exit(main())
