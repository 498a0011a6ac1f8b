"""Helpers for tests of the `outbox` command line and its long-running services."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import pytest

from outbox_cli import main


def one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run `outbox ARGV`, which must exit 2 with exactly one line on stderr; that line."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


class Service(Protocol):
    """Anything with run(install_signal_handlers=...) and a thread-safe stop()."""

    def run(self, install_signal_handlers: bool = True) -> None:
        """Run until stopped."""

    def stop(self) -> None:
        """Ask run() to return."""


@contextmanager
def running_in_thread(service: Service) -> Iterator[threading.Thread]:
    """service.run() on a thread; stopped and joined on the way out."""
    thread = threading.Thread(target=service.run, kwargs={"install_signal_handlers": False})
    thread.start()
    try:
        yield thread
    finally:
        service.stop()
        thread.join(timeout=30)
        assert not thread.is_alive(), "the service did not stop"
