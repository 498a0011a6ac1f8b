"""outbox_cli.logs: under JSON logging every stderr line is one JSON object, whatever wrote it."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

from outbox_cli.logs import TEXT_FORMAT, JsonFormatter, TextFormatter

ROOT = Path(__file__).resolve().parent.parent


def test_a_record_keeps_its_fields_and_its_traceback() -> None:
    try:
        raise ValueError("bad value")
    except ValueError:
        record = logging.getLogger("t").makeRecord(
            "t", logging.ERROR, __file__, 1, "failed %s", ("x",), sys.exc_info()
        )
    record.fields = {"reply_id": "r-1", "status": 410}
    entry = json.loads(JsonFormatter().format(record))
    assert (entry["level"], entry["message"], entry["reply_id"], entry["status"]) == (
        "error",
        "failed x",
        "r-1",
        410,
    )
    assert entry["exception"].startswith("Traceback")
    assert "ValueError: bad value" in entry["exception"]


def failed_with_credentials() -> logging.LogRecord:
    """An error record whose message, field and traceback each quote a credential."""
    try:
        raise ConnectionError("cannot reach postgresql://app:hunter2pass@db.internal/orders")
    except ConnectionError:
        record = logging.getLogger("t").makeRecord(
            "t",
            logging.ERROR,
            __file__,
            1,
            "effect failed for %s",
            ("https://hooks.example/in?token=tok-abcdef123456",),
            sys.exc_info(),
        )
    record.fields = {"reason": "signed with whsec_c2VjcmV0LXNlY3JldC1zZWNyZXQ="}
    return record


def test_text_lines_hide_credentials_in_message_and_traceback() -> None:
    line = TextFormatter(TEXT_FORMAT).format(failed_with_credentials())
    assert "ConnectionError" in line
    assert "db.internal/orders" in line
    for secret in ("hunter2pass", "tok-abcdef123456"):
        assert secret not in line, line


def test_json_lines_hide_credentials_in_every_field() -> None:
    entry = json.loads(JsonFormatter().format(failed_with_credentials()))
    assert "db.internal/orders" in entry["exception"]
    text = json.dumps(entry)
    for secret in ("hunter2pass", "tok-abcdef123456", "c2VjcmV0LXNlY3JldC1zZWNyZXQ="):
        assert secret not in text, entry


def test_uncaught_errors_warnings_and_the_closing_error_are_json_lines() -> None:
    script = textwrap.dedent(
        """
        import threading, warnings
        from outbox_cli.logs import configure_logging, report_error
        configure_logging("json", "info")
        thread = threading.Thread(target=lambda: 1 / 0, name="doomed")
        thread.start()
        thread.join()
        warnings.warn("deprecated thing", DeprecationWarning, stacklevel=1)
        report_error("outbox: error: the end")
        raise RuntimeError("uncaught at the top")
        """
    )
    result = subprocess.run(
        [sys.executable, "-W", "always", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    logged = [json.loads(line) for line in result.stderr.splitlines()]
    assert [entry["level"] for entry in logged] == ["critical", "warning", "error", "critical"]
    thread, warned, closing, top = logged
    assert "ZeroDivisionError" in thread["exception"]
    assert "doomed" in thread["message"]
    assert "deprecated thing" in warned["message"]
    assert closing["message"] == "outbox: error: the end"
    assert "RuntimeError: uncaught at the top" in top["exception"]
