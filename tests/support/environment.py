"""What the test run knows of its surroundings: whether it is CI, and the tables it empties.

In a module of its own: a test that did `from conftest import ...` got whichever
conftest.py was imported last under that name.
"""

from __future__ import annotations

import os

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
"""Under CI a missing service or tool fails the run instead of skipping."""
ALL_TABLES = (
    "outbox_inbox",
    "outbox_tasks",
    "outbox_messages",
    "outbox_requeues",
    "outbox_relays",
    "receiver_receipts",
    "receiver_effects",
)
"""Every table the migrations create, emptied between tests."""
