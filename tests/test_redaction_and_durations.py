"""Redaction keeps a URL's user and hides its password and query; durations print as typed."""

from __future__ import annotations

import pytest

from outbox.cli.arguments import parse_duration
from outbox.durations import duration_text
from outbox.redaction import redact


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("postgresql://app@db/app", "postgresql://app@db/app"),
        ("postgresql://app:s3cret@db:5432/app", "postgresql://app:<redacted>@db:5432/app"),
        ("postgresql://app:s3@cr@t@db/app", "postgresql://app:<redacted>@db/app"),
        ("amqp://guest:guest@127.0.0.1:5672/", "amqp://guest:<redacted>@127.0.0.1:5672/"),
        ("nats://:token@h:4222", "nats://:<redacted>@h:4222"),
        ("https://h/r?token=s3cret#f", "https://h/r?<redacted>"),
        ("at https://h/a@b and sqlite:///x.db", "at https://h/a@b and sqlite:///x.db"),
        ("secret whsec_c2VjcmV0LXZhbHVl here", "secret whsec_<redacted> here"),
    ],
)
def test_redaction_hides_credentials_and_keeps_the_user(text: str, shown: str) -> None:
    assert redact(text) == shown


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(2_592_000.0, "30d"), (7_200.0, "2h"), (5_400.0, "90m"), (90.0, "90s"), (1.5, "1.5s")],
)
def test_durations_print_in_the_largest_whole_unit(seconds: float, text: str) -> None:
    assert duration_text(seconds) == text
    if seconds == int(seconds):
        assert parse_duration(text) == seconds  # what is printed can be typed back
