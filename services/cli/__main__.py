"""`python -m services.cli`: the `specvox` command (how the supervisor starts each service)."""

import sys

from services.cli import main

sys.exit(main())
