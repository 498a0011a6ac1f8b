"""`python -m outbox_cli`: the `outbox` command."""

import sys

from outbox_cli import main

sys.exit(main())
