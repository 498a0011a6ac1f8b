"""A bad failpoint variable is a command's one-line error with status 2, never a traceback,
and never breaks `import outbox`; the start-up WARNING comes in the configured log format."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from outbox import failpoints
from outbox.errors import ConfigError
from outbox_cli import logs
from outbox_cli.logs import configure_logging

BAD = [
    ({failpoints.SWITCH_VAR: "true"}, "OUTBOX_FAILPOINTS_ENABLED must be 1 or 0, got 'true'"),
    (
        {failpoints.SWITCH_VAR: "1", failpoints.ENV_VAR: "bogus"},
        "OUTBOX_FAILPOINT: unknown failpoint 'bogus'",
    ),
    (
        {
            failpoints.SWITCH_VAR: "1",
            failpoints.ENV_VAR: "intake.before_commit",
            failpoints.ACTION_VAR: "pause",
        },
        "OUTBOX_FAILPOINT_ACTION must be one of",
    ),
]


def child_env(variables: dict[str, str]) -> dict[str, str]:
    """This process's environment without its failpoint variables, plus `variables`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    return {**env, **variables}


@pytest.fixture
def restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Tests that re-read the environment leave the module as this process's own."""
    yield
    # The test's variables undone first: read with them, the module would keep a bad
    # switch, and every later failpoint this process hits would raise.
    monkeypatch.undo()
    failpoints.read_environment()


@pytest.mark.parametrize(("variables", "message"), BAD)
def test_a_bad_failpoint_variable_is_one_line_and_status_2(
    variables: dict[str, str], message: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "outbox_cli", "secret", "new"],
        env=child_env(variables),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith(f"outbox: error: {message}")


@pytest.mark.parametrize(("variables", "message"), BAD)
def test_import_succeeds_and_the_first_hit_names_the_bad_value(
    variables: dict[str, str], message: str
) -> None:
    script = (
        "import outbox\n"
        "from outbox import failpoints\n"
        "from outbox.errors import ConfigError\n"
        "try:\n"
        "    failpoints.hit('intake.after_commit')\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=child_env(variables),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # nothing logged at import either
    assert done.stdout.startswith(message)


def test_check_raises_config_error(monkeypatch: pytest.MonkeyPatch, restored: None) -> None:
    monkeypatch.setenv(failpoints.SWITCH_VAR, "yes")
    failpoints.read_environment()
    with pytest.raises(ConfigError, match="must be 1 or 0"):
        failpoints.check()


@pytest.fixture
def json_logging() -> Iterator[None]:
    """JSON logs for the test; the process's own logging after."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, sys.excepthook, threading.excepthook, logs._json)
    yield
    root.handlers[:], root.level = saved[0], saved[1]
    sys.excepthook, threading.excepthook, logs._json = saved[2], saved[3], saved[4]
    logging.captureWarnings(False)


@pytest.mark.parametrize(
    ("variables", "words"),
    [
        (failpoints.environment("claim.after_commit"), "failpoint claim.after_commit is armed"),
        ({failpoints.ENV_VAR: "claim.after_commit"}, "is ignored"),
    ],
)
def test_the_start_warning_comes_after_logging_is_configured(
    variables: dict[str, str],
    words: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    restored: None,
    json_logging: None,
) -> None:
    for name in (failpoints.ENV_VAR, failpoints.ACTION_VAR, failpoints.SWITCH_VAR):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    failpoints.read_environment()
    assert capsys.readouterr().err == ""  # reading the environment logs nothing
    configure_logging("json")
    logs.announce("worker", "sqlite:///x.db", None)
    logs.announce("worker", "sqlite:///x.db", None)  # and it is said once
    records = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    warnings = [r for r in records if r["level"] == "warning"]
    assert len(warnings) == 1
    assert words in warnings[0]["message"]
