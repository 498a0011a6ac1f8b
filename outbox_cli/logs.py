"""Logging of the long-running commands (relay, receiver, worker): text or JSON lines.

With `--log-format json` every line on stderr is one JSON object: records
carry their `fields` (reply_id, destination, ...) as keys, a traceback goes in
`exception`, and an uncaught exception (in the main thread or any other) or
a Python warning is logged rather than printed raw, so a log shipper never
sees a stray line. Only a bad command line, refused before logging starts,
is one plain line.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from types import TracebackType
from typing import Any

from outbox import failpoints
from outbox.redaction import redact
from outbox_cli.settings import Option

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
log = logging.getLogger("outbox.cli")
_json = False  # whether configure_logging chose JSON lines for this process


def log_format(text: str) -> str:
    """argparse type of --log-format: text or json."""
    if text not in FORMATS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(FORMATS)}, got {text!r}")
    return text


def log_options(command: str) -> tuple[Option, Option]:
    """--log-format and --log-level of `command`, with its OUTBOX_<COMMAND>_* variables."""
    return (
        Option.of(command, "log_format", log_format, "text"),
        Option.of(command, "log_level", default="INFO"),
    )


LOG_HELP = {"log_format": "text or json (default text)", "log_level": "default INFO"}


class TextFormatter(logging.Formatter):
    """TEXT_FORMAT lines, credentials hidden (outbox.redaction) in the message and traceback."""

    def format(self, record: logging.LogRecord) -> str:
        """Render a record as text."""
        # A traceback quotes what an effect, a driver or a client raised: a URL with its
        # password, a secret in an argument. Hidden in the line, as in stored errors.
        return redact(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per log line, for log shippers; credentials hidden as in text lines."""

    def format(self, record: logging.LogRecord) -> str:
        """Render a record as JSON."""
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        # Before encoding: the redaction's URL pattern would read JSON's escapes as text.
        shown = {
            key: redact(value) if isinstance(value, str) else value for key, value in entry.items()
        }
        return json.dumps(shown, separators=(",", ":"), default=str)


def configure_logging(log_format: str, level: str = "INFO") -> None:
    """Logs to stderr, as text or JSON lines; with JSON, uncaught exceptions too."""
    global _json
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp logs each dropped keep-alive connection; those are retried, not news.
    logging.getLogger("aiohttp").setLevel(logging.WARNING)
    # Alembic says which dialect it drives each time the schema is checked (at start, and
    # in the relay's readiness mid-run): noise below DEBUG.
    debug = root.getEffectiveLevel() <= logging.DEBUG
    logging.getLogger("alembic").setLevel(logging.NOTSET if debug else logging.WARNING)
    _json = log_format == "json"
    if _json:
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_uncaught_in_thread
        logging.captureWarnings(True)  # warnings.warn writes to stderr itself otherwise


def announce(command: str, db: str, config: str | None) -> None:
    """A long-running command's first line: the database it uses (password hidden) and the
    config file it read, so a typo that fell back to a default shows at once."""
    database = redact(db)
    read = f", config {config}" if config else ", no config file"
    log.info(
        "outbox %s: database %s%s",
        command,
        database,
        read,
        extra={"fields": {"command": command, "database": database, "config": config}},
    )
    failpoints.announce()  # now, in the format just configured, not at import


def report_error(message: str) -> None:
    """A command's closing error: a log record under JSON logging, else a line on stderr;
    credentials in it (a destination URL's password or token, a secret) are hidden."""
    message = redact(message)
    if _json:
        log.error(message)
    else:
        print(message, file=sys.stderr)


def report_stopped(message: str) -> None:
    """A command's closing line after a stop signal: an INFO record when logging is set up,
    else a line on stderr (the signal may come before logging is configured)."""
    if logging.getLogger().handlers:
        log.info(message)
    else:
        print(message, file=sys.stderr)


def _log_uncaught(
    kind: type[BaseException], exc: BaseException, traceback: TracebackType | None
) -> None:
    log.critical("uncaught %s: %s", kind.__name__, exc, exc_info=(kind, exc, traceback))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is None or args.exc_type is SystemExit:
        return
    thread = args.thread.name if args.thread is not None else "?"
    log.critical(
        "uncaught %s in thread %s: %s",
        args.exc_type.__name__,
        thread,
        args.exc_value,
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
    )
