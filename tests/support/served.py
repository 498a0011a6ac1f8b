"""An ASGI app served by uvicorn on a loopback port, in a thread of the test's process."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from receiver import ReceiptStore
from receiver.app import create_app
from receiver.effects import record_effect
from support.receiver_helpers import SECRET, free_port, wait_until


class Served:
    """An ASGI app served by uvicorn on a loopback port, in a thread of this process."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="error", timeout_graceful_shutdown=1
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> Served:
        self._thread.start()

        def started() -> bool:
            assert self._thread.is_alive(), "uvicorn stopped before it started serving"
            return bool(self._server.started)

        wait_until(started, 10, "uvicorn to serve the app")
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


@contextmanager
def served_receiver(db_url: str) -> Iterator[Served]:
    """The reference receiver on `db_url` (its receipt lookup too, signed with SECRET), in a
    thread of this process: for the tests of what asks it, where `outbox receiver` in a
    process of its own cost 0.7 s of CPU to start (tests/receiver holds the process)."""
    store = ReceiptStore(db_url)
    try:
        with Served(create_app(store, [SECRET], effect=record_effect)) as served:
            yield served
    finally:
        store.close()
