"""outbox_cli.logs: under JSON logging every stderr line is one JSON object, whatever wrote it."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

from outbox_cli.logs import JsonFormatter

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
