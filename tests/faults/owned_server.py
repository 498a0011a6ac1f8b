"""What the database servers a test owns share: a temp folder, a log, a port, waiting
until the server accepts connections, and stopping and removing it at the end."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Self

from support.receiver_helpers import wait_until

START_TIMEOUT = 60.0


class OwnedServer:
    """A throwaway server in `root`, logging to `log`, on `port`; a context manager.

    A subclass says whether it accepts connections (`accepting`) and how it stops at
    once (`halt`)."""

    name = "the test's server"
    root: Path
    log: Path
    port: int

    def accepting(self) -> bool:
        """Whether a new session can run a query now."""
        raise NotImplementedError

    def halt(self) -> None:
        """Stop the server at once (nothing in it is worth keeping)."""
        raise NotImplementedError

    def wait_accepting(self, timeout: float = START_TIMEOUT) -> None:
        """Poll until the server accepts connections; fail with its log after `timeout`."""
        try:
            wait_until(self.accepting, timeout, f"{self.name} on port {self.port}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.log_tail()}") from None

    def log_tail(self, lines: int = 40) -> str:
        """The end of the server's log, for failure messages."""
        try:
            text = self.log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def close(self) -> None:
        """Stop the server and remove its folder."""
        try:
            self.halt()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Self:
        """The server; stopped and removed on exit."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop and remove the server."""
        self.close()
