"""Fixtures for the package tests, which `make package-check` runs against installed wheels.

Self-contained on purpose: the check copies this folder out of the checkout and runs it
with only pytest and httpx beside the installed package, so nothing here may import the
suite's `support` helpers or rely on the fixtures of tests/conftest.py.
"""

from __future__ import annotations

import os
import subprocess
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

import outbox

INSTALLED_ENV = "OUTBOXDEV_PACKAGE_UNDER_TEST"
"""Set by .ci/package_check.py to the site-packages folder the packages must come from."""


def pytest_report_header() -> str:
    """Which copy of outbox the run imported: the point of these tests."""
    return f"outbox {outbox.__version__} from {Path(outbox.__file__).parent}"


@pytest.fixture(scope="session")
def expected_home() -> Path:
    """Where outbox, relay, receiver and outbox_cli must be imported from: the site-packages
    the check names, or else the checkout this file sits in (an editable install)."""
    named = os.environ.get(INSTALLED_ENV)
    if named:
        return Path(named).resolve()
    return Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def command() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Runs the installed `outbox` script with arguments; returns the finished process."""
    script = Path(sysconfig.get_path("scripts")) / "outbox"
    env = {name: value for name, value in os.environ.items() if not name.startswith("OUTBOX_")}

    def run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(script), *argv], capture_output=True, text=True, env=env,
            timeout=timeout, check=False,
        )  # fmt: skip

    return run


@pytest.fixture
def process() -> Iterator[Callable[[Sequence[str]], subprocess.Popen[bytes]]]:
    """Starts the installed `outbox` script as a child; each is stopped after the test."""
    script = Path(sysconfig.get_path("scripts")) / "outbox"
    env = {name: value for name, value in os.environ.items() if not name.startswith("OUTBOX_")}
    started: list[subprocess.Popen[bytes]] = []

    def start(argv: Sequence[str]) -> subprocess.Popen[bytes]:
        child = subprocess.Popen(
            [str(script), *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        started.append(child)
        return child

    yield start
    for child in started:
        if child.poll() is None:
            child.terminate()
        try:
            child.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
