"""`python -m dgr`: the same as the `dgr` command."""

import sys

from dgr.cli.main import main

sys.exit(main())
