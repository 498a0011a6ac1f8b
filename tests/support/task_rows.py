"""Task rows for the driver conformance tests of the task family."""

from __future__ import annotations

from typing import Any

from support.driver_helpers import START


def task_values(task_id: str, **more: Any) -> dict[str, Any]:
    """A pending task's columns, due at START."""
    return {
        "task_id": task_id,
        "tenant_id": "acme",
        "payload": '{"n":1}',
        "priority": 0,
        "deadline": START + 3600,
        "hops": 0,
        "state": "pending",
        "attempts": 0,
        "max_attempts": 3,
        "available_at": START,
        "fence": 0,
        "created_at": START,
        "updated_at": START,
        **more,
    }
