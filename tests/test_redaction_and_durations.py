"""Redaction hides a URL's password, token user name and query; durations print as typed."""

from __future__ import annotations

from urllib.parse import quote

import pytest

from outbox.durations import duration_text
from outbox.redaction import redact, redact_quoted, url_credentials
from outbox_cli.arguments import parse_duration


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("postgresql://app@db/app", "postgresql://app@db/app"),
        ("postgresql://app:s3cret@db:5432/app", "postgresql://app:<redacted>@db:5432/app"),
        ("postgresql://app:s3@cr@t@db/app", "postgresql://app:<redacted>@db/app"),
        ("amqp://guest:guest@127.0.0.1:5672/", "amqp://guest:<redacted>@127.0.0.1:5672/"),
        ("nats://:token@h:4222", "nats://:<redacted>@h:4222"),
        # A user name alone is a token or key but in a database URL, where it is a role.
        ("nats://s3cr3tToken@nats:4222", "nats://<redacted>@nats:4222"),
        ("https://apikey@host/hook", "https://<redacted>@host/hook"),
        ("redis://token@r:6379/0", "redis://<redacted>@r:6379/0"),
        ("postgresql+psycopg://app@db/app", "postgresql+psycopg://app@db/app"),
        ("mysql+pymysql://app@db/app", "mysql+pymysql://app@db/app"),
        # SQLAlchemy takes a password holding '/', '?' or '#'.
        ("postgresql://app:ab/cd+ef==@db/app", "postgresql://app:<redacted>@db/app"),
        ("postgresql://app:ab?cd@db/app", "postgresql://app:<redacted>@db/app"),
        ("postgresql://app:ab#cd@db/app", "postgresql://app:<redacted>@db/app"),
        ("https://u:p@h/r?to=a@b", "https://u:<redacted>@h/r?<redacted>"),
        ("https://h/r?token=s3cret#f", "https://h/r?<redacted>"),
        ("at https://h/a@b and sqlite:///x.db", "at https://h/a@b and sqlite:///x.db"),
        ("secret whsec_c2VjcmV0LXZhbHVl here", "secret whsec_<redacted> here"),
    ],
)
def test_redaction_hides_credentials_keeps_a_user_before_a_password(text: str, shown: str) -> None:
    assert redact(text) == shown


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(2_592_000.0, "30d"), (7_200.0, "2h"), (5_400.0, "90m"), (90.0, "90s"), (1.5, "1.5s")],
)
def test_durations_print_in_the_largest_whole_unit(seconds: float, text: str) -> None:
    assert duration_text(seconds) == text
    if seconds == int(seconds):
        assert parse_duration(text) == seconds  # what is printed can be typed back


def test_a_quoted_credential_is_hidden_wherever_it_stands() -> None:
    url = "https://user:pa%2Fss-word@hooks.example/in?api_key=k3y-%2Babcdef&v=1"
    found = url_credentials(url)
    assert {"k3y-%2Babcdef", "k3y-+abcdef", "pa/ss-word"} <= set(found)
    assert "1" not in found  # too short to hide on its own: it would blank every digit
    quoted = "HTTP 400: no key k3y-+abcdef for user (pa/ss-word) at 10:01"
    hidden = "HTTP 400: no key <redacted> for user (<redacted>) at 10:01"
    assert redact_quoted(quoted, found) == hidden


def test_a_credential_is_hidden_in_the_spellings_a_destination_may_quote() -> None:
    sent = "ab%2Fcd+ef%3Dgh12"  # a '+' left raw, which a server may read as a space
    found = url_credentials(f"https://hooks.example/in?sig={sent}")
    for quoted in (
        sent,
        "ab/cd+ef=gh12",  # decoded
        "ab/cd ef=gh12",  # decoded, '+' read as a space
        quote("ab/cd+ef=gh12", safe="").lower(),  # encoded again, lower-case hex
        "ab\\/cd+ef=gh12",  # JSON's escaped '/'
    ):
        assert redact_quoted(f"refused {quoted}!", found) == "refused <redacted>!", quoted


def test_what_is_hidden_stops_where_a_quote_could_still_be_told_apart() -> None:
    found = url_credentials("amqp://outbox:s3cret-pass@mq.example/?api-version=2024-01-01")
    # The user name before a password stays (as redact_urls shows it), and so does a date.
    said = "exchange 'outbox.events' refused on 2024-01-01 for s3cret-pass"
    assert redact_quoted(said, found) == (
        "exchange 'outbox.events' refused on 2024-01-01 for <redacted>"
    )
    # A user name alone is a token (NATS), hidden wherever it is quoted.
    assert redact_quoted("no user t0ken-abc", url_credentials("nats://t0ken-abc@nats.example"))
    assert "t0ken-abc" not in redact_quoted(
        "no user t0ken-abc", url_credentials("nats://t0ken-abc@nats.example")
    )


def test_the_start_of_a_credential_left_by_an_errors_cut_is_hidden() -> None:
    found = url_credentials("https://hooks.example/in?token=s3cr3tT0kenValue0123456789")
    assert redact_quoted("HTTP 400: token s3cr3tT0kenValue0…", found) == (
        "HTTP 400: token <redacted>…"
    )
    assert redact_quoted("HTTP 400: token s3c…", found) == "HTTP 400: token s3c…"  # too short


@pytest.mark.parametrize("before", ["", "...", "1.", "3-", "see:.", "url=", "(", '"', "x"])
def test_a_url_glued_to_what_precedes_it_is_redacted(before: str) -> None:
    assert redact(f"{before}https://u:pass@h/?t=1") == f"{before}https://u:<redacted>@h/?<redacted>"


def test_a_word_that_starts_like_a_credential_is_hidden_only_at_a_cut() -> None:
    found = url_credentials("https://h/x?format=json&token=s3cr3tT0kenValue0123")
    assert redact_quoted("HTTP 400: invalid format", found) == "HTTP 400: invalid format"
    assert redact_quoted("HTTP 400: token s3cr3tT0ke…", found) == "HTTP 400: token <redacted>…"
