"""`outbox console`'s guard: the token, the login form, CSRF, and the headers of every answer."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from starlette.exceptions import HTTPException
from starlette.requests import Request
from support.console_helpers import (
    BOUND_PORT,
    OPERATOR,
    TOKEN,
    ConsoleClient,
    confirmation_of,
    csrf_of,
)

from outbox.operations import Operations
from outbox.testing import ManualClock
from outbox_cli import console as console_command
from outbox_cli import main
from outbox_cli.console import console_token, login_sessions
from outbox_cli.console.forms import CSRF_COOKIE, MAX_FORM_BYTES, form_body
from outbox_cli.console.guesses import GUESS_SECONDS, GUESSES, GuessLimit
from outbox_cli.console.hosts import is_loopback
from outbox_cli.console.login_sessions import SESSION_COOKIE, SESSION_SECONDS
from outbox_cli.console.security import CONTENT_SECURITY_POLICY


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("localhost", True),
     ("0.0.0.0", False), ("10.1.2.3", False), ("::", False), ("console.example", False)],
)  # fmt: skip
def test_only_loopback_addresses_count_as_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_a_token_is_optional_on_loopback_and_required_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OUTBOX_CONSOLE_TOKEN", raising=False)
    assert console_token("127.0.0.1") is None
    with pytest.raises(ValueError, match="OUTBOX_CONSOLE_TOKEN"):
        console_token("0.0.0.0")
    monkeypatch.setenv("OUTBOX_CONSOLE_TOKEN", TOKEN)
    assert console_token("0.0.0.0") == TOKEN


def test_the_command_refuses_to_listen_off_loopback_without_a_token(
    seeded: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("OUTBOX_CONSOLE_TOKEN", raising=False)
    assert main(["console", "--db", seeded, "--host", "0.0.0.0"]) == 2
    assert "not loopback: set OUTBOX_CONSOLE_TOKEN" in capsys.readouterr().err


def test_the_command_reads_its_token_variable_and_refuses_a_short_one(
    seeded: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The variable is known to the environment check: the complaint is its length.
    monkeypatch.setenv("OUTBOX_CONSOLE_TOKEN", "short")
    assert main(["console", "--db", seeded, "--host", "0.0.0.0"]) == 2
    assert "at least 16 characters" in capsys.readouterr().err


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[argparse.Namespace]:
    """The settings `outbox console` would start with (it is not started)."""
    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(console_command, "run", lambda args: seen.append(args) or 0)
    for name in ("OUTBOX_CONSOLE_OPERATOR", "OUTBOX_CONFIG", "OUTBOX_CONSOLE_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return seen


def test_the_operator_is_a_setting_of_the_command(
    seeded: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    started: list[argparse.Namespace],
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["console", "--db", seeded]) == 0
    config = tmp_path / "outbox.toml"
    config.write_text('[console]\noperator = " ops-lee "\n', encoding="utf-8")
    assert main(["console", "--db", seeded, "--config", str(config)]) == 0
    monkeypatch.setenv("OUTBOX_CONSOLE_OPERATOR", "ops-kim")
    assert main(["console", "--db", seeded, "--config", str(config)]) == 0
    assert main(["console", "--db", seeded, "--operator", "ops-anna"]) == 0
    assert [args.operator for args in started] == [None, "ops-lee", "ops-kim", "ops-anna"]
    capsys.readouterr()
    for bad in ("ops\nanna", "x" * 201):
        monkeypatch.setenv("OUTBOX_CONSOLE_OPERATOR", bad)
        assert main(["console", "--db", seeded]) == 2
        error = capsys.readouterr().err
        assert "OUTBOX_CONSOLE_OPERATOR: an operator's name is 1 to 200 printable" in error
    with pytest.raises(SystemExit) as refused:
        main(["console", "--db", seeded, "--operator", " "])
    assert refused.value.code == 2
    assert "1 to 200 printable characters" in capsys.readouterr().err
    assert len(started) == 4


def test_every_answer_carries_a_strict_policy_and_no_script_may_run(
    ops: Operations, make_client: Callable[..., ConsoleClient]
) -> None:
    console = make_client()
    for path in ("/", "/dead", "/reply?id=b-1", "/reply?id=missing", "/static/console.css"):
        headers = console.get(path).headers
        assert headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert headers["x-content-type-options"] == "nosniff"
        assert headers["referrer-policy"] == "same-origin"
    directives = dict(d.strip().split(" ", 1) for d in CONTENT_SECURITY_POLICY.split(";"))
    assert directives["default-src"] == "'none'"
    assert "script-src" not in directives  # so default-src 'none' forbids every script
    assert directives["style-src"] == "'self'"
    assert directives["frame-ancestors"] == "'none'"


def test_without_a_token_on_loopback_pages_open_directly(
    ops: Operations, make_client: Callable[..., ConsoleClient]
) -> None:
    console = make_client()
    assert console.get("/").status_code == 200
    assert console.get("/login").headers["location"] == "/"


@pytest.mark.parametrize(
    "authorization", [None, "Bearer wrong-token-of-some-length", f"Basic {TOKEN}", "Bearer "]
)
def test_a_missing_or_wrong_token_gets_401(
    ops: Operations, authorization: str | None, make_client: Callable[..., ConsoleClient]
) -> None:
    console = make_client(token=TOKEN)
    headers = {} if authorization is None else {"Authorization": authorization}
    for path in ("/", "/dead", "/reply?id=b-1", "/task?id=x", "/search?q=b-1"):
        answer = console.get(path, headers=headers)
        assert answer.status_code == 401
        assert answer.headers["www-authenticate"] == "Bearer"
        assert 'id="login"' in answer.text  # a browser gets the login form
        assert "b-1" not in answer.text.replace("/reply?id=b-1", "")
    answer = console.post("/reply/requeue", headers=headers, data={"reply_id": "b-1"})
    assert answer.status_code == 401


def test_the_bearer_token_opens_every_page(
    ops: Operations, make_client: Callable[..., ConsoleClient]
) -> None:
    console = make_client(token=TOKEN)
    answer = console.get("/dead", headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200
    assert 'data-reply-id="b-1"' in answer.text


def test_the_login_form_sets_an_httponly_strict_cookie_that_opens_the_pages(
    ops: Operations, make_client: Callable[..., ConsoleClient]
) -> None:
    console = make_client(token=TOKEN)
    form = console.get("/dead")
    assert form.status_code == 401
    csrf = csrf_of(form.text)
    wrong = console.post(
        "/login",
        data={"csrf_token": csrf, "operator": OPERATOR, "token": "not-the-token", "next": "/dead"},
    )
    assert wrong.status_code == 401
    assert 'id="wrong-token"' in wrong.text
    assert SESSION_COOKIE not in console.cookies
    right = console.post(
        "/login", data={"csrf_token": csrf, "operator": OPERATOR, "token": TOKEN, "next": "/dead"}
    )
    assert (right.status_code, right.headers["location"]) == (303, "/dead")
    set_cookie = right.headers["set-cookie"].lower()
    assert f"{SESSION_COOKIE}=" in set_cookie
    assert "httponly" in set_cookie
    assert "samesite=strict" in set_cookie
    assert TOKEN.lower() not in set_cookie  # the cookie proves the token, never holds it
    assert console.get("/dead").status_code == 200
    # Logging out forgets it.
    page = console.get("/")
    assert console.post("/logout", data={"csrf_token": csrf_of(page.text)}).status_code == 303
    assert console.get("/").status_code == 401


@pytest.mark.parametrize("given", [None, "", "   ", "anna\tlee", "anna\u202elee", "x" * 201])
def test_login_without_a_name_is_refused(
    given: str | None, ops: Operations, make_client: Callable[..., ConsoleClient]
) -> None:
    console = make_client(token=TOKEN, clock=ManualClock(1_000.0))
    form = {"csrf_token": csrf_of(console.get("/login").text), "token": TOKEN, "next": "/"}
    if given is not None:
        form["operator"] = given
    for _ in range(GUESSES + 1):  # checked before the token: not a guess at it
        answer = console.post("/login", data=form)
        assert answer.status_code == 400
        assert 'id="bad-name"' in answer.text
        assert "1 to 200 printable characters" in answer.text
    assert SESSION_COOKIE not in console.cookies
    assert console.get("/dead").status_code == 401


def test_the_name_given_at_login_is_trimmed_and_shown_on_every_page(
    ops: Operations, make_client: Callable[..., ConsoleClient], caplog: pytest.LogCaptureFixture
) -> None:
    console = make_client(token=TOKEN)
    csrf = csrf_of(console.get("/login").text)
    form = {"csrf_token": csrf, "operator": "  Anna <Lindqvist>  ", "token": TOKEN, "next": "/"}
    with caplog.at_level(logging.INFO, logger="outbox.console"):
        assert console.post("/login", data=form).status_code == 303
    shown = "signed in as <strong>Anna &lt;Lindqvist&gt;</strong>"
    for path in ("/", "/dead", "/reply?id=b-1", "/search?q=nothing"):
        assert shown in console.get(path).text, path
    # The log ties the name to the address it came from: the token alone is shared.
    assert "'Anna <Lindqvist>' logged in from 127.0.0.1" in caplog.text


def test_login_goes_back_only_to_a_page_of_this_console(
    ops: Operations, make_client: Callable[..., ConsoleClient]
) -> None:
    console = make_client(token=TOKEN)
    csrf = csrf_of(console.get("/login").text)
    for target in ("https://elsewhere.example/", "//elsewhere.example/", "/\\elsewhere"):
        answer = console.post(
            "/login",
            data={"csrf_token": csrf, "operator": OPERATOR, "token": TOKEN, "next": target},
        )
        assert answer.headers["location"] == "/"


def test_the_csrf_cookie_is_httponly_and_strict(
    ops: Operations, make_client: Callable[..., ConsoleClient]
) -> None:
    set_cookie = make_client().get("/").headers["set-cookie"].lower()
    assert f"{CSRF_COOKIE}=" in set_cookie
    assert "httponly" in set_cookie
    assert "samesite=strict" in set_cookie


@pytest.mark.parametrize("offered", [None, "", "forged-token"])
def test_a_post_without_the_csrf_token_is_refused(
    ops: Operations,
    offered: str | None,
    no_relay_config: None,
    make_client: Callable[..., ConsoleClient],
) -> None:
    console = make_client(token=TOKEN)
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    console.get("/", headers=bearer)  # the browser holds the CSRF cookie
    form = {"reply_id": "b-1", "reason": "r", "force": "yes"}
    if offered is not None:
        form["csrf_token"] = offered
    for path in ("/reply/requeue", "/login", "/logout"):
        answer = console.post(path, data=form, headers=bearer)
        assert answer.status_code == 403, path
        assert "CSRF" in answer.text
    assert ops.message("b-1")["state"] == "dead"  # type: ignore[index]


def test_a_cross_site_post_carries_no_cookie_and_is_refused(
    ops: Operations, make_client: Callable[..., ConsoleClient]
) -> None:
    # SameSite=Strict: a form on another site reaches the console without the cookies.
    console = make_client(operator=OPERATOR)
    csrf = csrf_of(console.get("/reply?id=b-1").text)
    console.cookies.clear()
    form = {"csrf_token": csrf, "reply_id": "b-1", "reason": "r", "force": "yes"}
    assert console.post("/reply/requeue", data=form).status_code == 403
    assert ops.message("b-1")["state"] == "dead"  # type: ignore[index]


def test_read_only_hides_the_requeue_and_refuses_it(
    ops: Operations, make_client: Callable[..., ConsoleClient]
) -> None:
    console = make_client(read_only=True, operator=OPERATOR)
    page = console.get("/reply?id=b-1")
    assert 'id="requeue-form"' not in page.text
    assert "read-only" in page.text
    form = {"csrf_token": console.cookies[CSRF_COOKIE], "reply_id": "b-1", "reason": "r"}
    assert console.post("/reply/requeue", data=form).status_code == 403
    assert ops.message("b-1")["state"] == "dead"  # type: ignore[index]


@pytest.mark.parametrize(
    "host",
    ["evil.example:8080", "evil.example", "127.0.0.1.evil.example:8080", "[::2]:8080", ""],
)
def test_a_request_naming_another_host_is_refused(
    ops: Operations, host: str, make_client: Callable[..., ConsoleClient]
) -> None:
    # DNS rebinding: a page of evil.example, its name now resolving to 127.0.0.1, asks the
    # console for itself; the browser names evil.example in the Host header. (Another port
    # of a loopback name is let in: an SSH tunnel forwards from a port of its own.)
    console = make_client()
    for path in ("/", "/dead", "/reply?id=b-1", "/static/console.css"):
        answer = console.get(path, headers={"Host": host})
        assert answer.status_code == 400, path
        assert "b-1" not in answer.text
        assert answer.headers["content-security-policy"] == CONTENT_SECURITY_POLICY


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1:1@evil.example", "[::1]evil.example", "[::1]:80evil.example",
     "127.0.0.1:8080:80", "localhost:", "localhost:99999", "localhost:+80", " localhost",
     "127.0.0.1/evil.example", "[127.0.0.1]", "[::1", "::1", "localhost\\evil",
     "local host", "[::1%25eth0]:80"],
)  # fmt: skip
def test_a_malformed_host_header_is_refused(
    ops: Operations, host: str, make_client: Callable[..., ConsoleClient]
) -> None:
    # A loose parser took the loopback name out of headers that name another host.
    for bound in ("127.0.0.1", "0.0.0.0"):
        console = make_client(host=bound, token=None if bound == "127.0.0.1" else TOKEN)
        answer = console.get("/dead", headers={"Host": host, "Authorization": f"Bearer {TOKEN}"})
        assert answer.status_code == 400, (bound, host)
        assert "b-1" not in answer.text


@pytest.mark.parametrize(
    "hosts",
    [["127.0.0.1", "evil.example"], ["evil.example", "127.0.0.1"], ["localhost", "localhost"]],
)
def test_two_host_headers_are_refused(
    ops: Operations, hosts: list[str], make_client: Callable[..., ConsoleClient]
) -> None:
    # The console read the first, a proxy in front of it may read the last.
    answer = make_client().get("/dead", headers=[("Host", each) for each in hosts])
    assert answer.status_code == 400
    assert "b-1" not in answer.text


@pytest.mark.parametrize(
    "host",
    [f"127.0.0.1:{BOUND_PORT}", f"localhost:{BOUND_PORT}", f"[::1]:{BOUND_PORT}",
     f"LocalHost:{BOUND_PORT}", "localhost:9000", "127.0.0.1", "[0:0:0:0:0:0:0:1]:80"],
)  # fmt: skip
def test_the_loopback_names_are_let_in_on_any_port(
    ops: Operations, host: str, make_client: Callable[..., ConsoleClient]
) -> None:
    assert make_client().get("/dead", headers={"Host": host}).status_code == 200


def test_a_console_bound_to_a_name_answers_to_that_name(
    ops: Operations, make_client: Callable[..., ConsoleClient]
) -> None:
    console = make_client(host="localhost")
    assert console.get("/").status_code == 200
    assert console.get("/", headers={"Host": f"127.0.0.1:{BOUND_PORT}"}).status_code == 200
    assert console.get("/", headers={"Host": "evil.example:8080"}).status_code == 400


def test_off_loopback_the_token_guards_whatever_name_reached_the_console(
    ops: Operations, make_client: Callable[..., ConsoleClient]
) -> None:
    # Operators reach it by names it cannot know (DNS, a proxy); a rebinding page has
    # neither the token nor the session cookie, which belongs to the console's own name.
    console = make_client(host="0.0.0.0", token=TOKEN)
    headers = {"Host": "console.example:8080"}
    assert console.get("/dead", headers=headers).status_code == 401
    bearer = {**headers, "Authorization": f"Bearer {TOKEN}"}
    assert console.get("/dead", headers=bearer).status_code == 200


@pytest.mark.parametrize(
    "origin", ["http://evil.example:8080", f"http://localhost:{BOUND_PORT}", "null",
               f"https://127.0.0.1:{BOUND_PORT}"],
)  # fmt: skip
def test_a_post_from_another_origin_is_refused_even_with_the_csrf_token(
    ops: Operations,
    origin: str,
    no_relay_config: None,
    make_client: Callable[..., ConsoleClient],
) -> None:
    console = make_client(operator=OPERATOR)
    csrf = csrf_of(console.get("/reply?id=b-1").text)  # the cookie is held, the token read
    form = {"csrf_token": csrf, "reply_id": "b-1", "reason": "r"}
    # From the console's own origin the form goes through: refused, and confirmable.
    own = {"Origin": f"http://127.0.0.1:{BOUND_PORT}"}
    refusal = console.post("/reply/requeue", data=form, headers=own)
    assert refusal.status_code == 409
    force = {**form, "force": "yes", "confirm": confirmation_of(refusal.text)}
    answer = console.post("/reply/requeue", data=force, headers={"Origin": origin})
    assert answer.status_code == 403
    assert "Origin" in answer.text
    assert ops.message("b-1")["state"] == "dead"  # type: ignore[index]
    # The refused POST never reached the requeue: its confirmation still holds.
    assert console.post("/reply/requeue", data=force, headers=own).status_code == 303
    assert ops.message("b-1")["state"] == "pending"  # type: ignore[index]


class MovableClock:
    """The session clock of a test: stays where it is put."""

    def __init__(self, at: float) -> None:
        self.at = at

    def __call__(self) -> float:
        return self.at


@pytest.fixture
def session_clock(monkeypatch: pytest.MonkeyPatch) -> MovableClock:
    """The console's session clock, moved by the test."""
    clock = MovableClock(1_700_000_000.0)
    monkeypatch.setattr(login_sessions, "now", clock)
    return clock


def logged_in_cookie(console: ConsoleClient, token: str = TOKEN) -> str:
    """Log in with `token` through the form; the session cookie's value."""
    csrf = csrf_of(console.get("/login").text)
    answer = console.post(
        "/login", data={"csrf_token": csrf, "operator": OPERATOR, "token": token, "next": "/"}
    )
    assert answer.status_code == 303
    return str(console.cookies[SESSION_COOKIE])


def opens(console: ConsoleClient, cookie: str) -> bool:
    """Whether the session cookie `cookie` alone opens the dead list."""
    console.cookies.clear()
    answer = console.get("/dead", headers={"Cookie": f"{SESSION_COOKIE}={cookie}"})
    assert answer.status_code in (200, 401)
    return answer.status_code == 200


def test_a_session_lasts_a_bounded_time(
    ops: Operations, session_clock: MovableClock, make_client: Callable[..., ConsoleClient]
) -> None:
    console = make_client(token=TOKEN)
    cookie = logged_in_cookie(console)
    session_clock.at += SESSION_SECONDS - 1
    assert opens(console, cookie)
    session_clock.at += 2
    assert not opens(console, cookie)


def test_a_session_cookie_from_the_future_is_refused(
    ops: Operations, session_clock: MovableClock, make_client: Callable[..., ConsoleClient]
) -> None:
    console = make_client(token=TOKEN)
    cookie = logged_in_cookie(console)
    session_clock.at -= 60
    assert not opens(console, cookie)


def test_a_tampered_session_cookie_is_refused(
    ops: Operations, session_clock: MovableClock, make_client: Callable[..., ConsoleClient]
) -> None:
    console = make_client(token=TOKEN)
    cookie = logged_in_cookie(console)
    assert opens(console, cookie)
    issued, _, proof = cookie.partition(".")
    later = str(int(issued) + SESSION_SECONDS)  # the same proof, a longer life
    flipped = proof[:-1] + ("0" if proof[-1] != "0" else "1")
    for forged in (f"{later}.{proof}", f"{issued}.{flipped}", proof, f"{issued}.", "", "x.y"):
        assert not opens(console, forged), forged
    # Nor does the session of another token open this console.
    another = "another-token-of-enough-length"
    assert not opens(console, logged_in_cookie(make_client(token=another), another))


def test_the_session_cookie_is_httponly_strict_and_ends(
    ops: Operations, session_clock: MovableClock, make_client: Callable[..., ConsoleClient]
) -> None:
    console = make_client(token=TOKEN)
    csrf = csrf_of(console.get("/login").text)
    answer = console.post(
        "/login", data={"csrf_token": csrf, "operator": OPERATOR, "token": TOKEN, "next": "/"}
    )
    set_cookie = answer.headers["set-cookie"].lower()
    assert set_cookie.startswith(f"{SESSION_COOKIE}=")
    assert "httponly" in set_cookie
    assert "samesite=strict" in set_cookie
    assert f"max-age={SESSION_SECONDS}" in set_cookie
    assert "secure" not in set_cookie  # over http a Secure cookie would never come back


def test_over_https_the_cookies_are_secure(
    ops: Operations, session_clock: MovableClock, make_client: Callable[..., ConsoleClient]
) -> None:
    console = make_client(token=TOKEN, scheme="https")
    form = console.get("/login")
    assert "; secure" in form.headers["set-cookie"].lower()  # the CSRF cookie
    answer = console.post(
        "/login",
        data={"csrf_token": csrf_of(form.text), "operator": OPERATOR, "token": TOKEN, "next": "/"},
    )
    assert answer.status_code == 303
    assert "; secure" in answer.headers["set-cookie"].lower()


CHUNK = 16_384


def pulled_before_refusal(declared: int | None) -> tuple[int, int]:
    """Feeds `form_body` a 16 MB body in 16 KiB chunks: (its answer's status, chunks it read)."""
    pulled = 0
    total = 1_000

    async def receive() -> dict[str, object]:
        nonlocal pulled
        pulled += 1
        return {"type": "http.request", "body": b"x" * CHUNK, "more_body": pulled < total}

    headers = [] if declared is None else [(b"content-length", str(declared).encode())]
    request = Request({"type": "http", "method": "POST", "headers": headers}, receive)
    with pytest.raises(HTTPException) as refused:
        asyncio.run(form_body(request))
    return refused.value.status_code, pulled


def test_a_form_body_is_refused_as_soon_as_it_outgrows_the_limit() -> None:
    # Login reads a form with no credential: reading the whole body before the check let
    # anyone fill the console's memory.
    assert pulled_before_refusal(None) == (413, MAX_FORM_BYTES // CHUNK + 1)
    assert pulled_before_refusal(CHUNK * 1_000) == (413, 0)


def log_in(console: ConsoleClient, token: str) -> int:
    """POST the login form with `token`; the answer's status."""
    csrf = csrf_of(console.get("/login").text)
    answer = console.post(
        "/login", data={"csrf_token": csrf, "operator": OPERATOR, "token": token, "next": "/"}
    )
    return answer.status_code


def test_wrong_tokens_at_the_login_form_are_limited_per_client_address(
    ops: Operations, make_client: Callable[..., ConsoleClient]
) -> None:
    # Each wrong token was answered at once: 130 guesses a second on one connection.
    clock = ManualClock(1_000.0)
    console = make_client(token=TOKEN, clock=clock)
    for _ in range(GUESSES):
        assert log_in(console, "wrong-token-of-some-length") == 401
    csrf = csrf_of(console.get("/login").text)
    refused = console.post(
        "/login", data={"csrf_token": csrf, "operator": OPERATOR, "token": TOKEN, "next": "/"}
    )
    # Even the right token is refused unchecked: telling it apart would answer the guess.
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == str(int(GUESS_SECONDS))
    assert SESSION_COOKIE not in console.cookies
    # Another address is not held up by this one's guesses.
    elsewhere = make_client(app=console.app, peer="192.0.2.7")
    assert log_in(elsewhere, TOKEN) == 303
    clock.advance(GUESS_SECONDS - 1)
    assert log_in(console, TOKEN) == 429
    clock.advance(1)  # one guess earned back
    assert log_in(console, "wrong-token-of-some-length") == 401
    assert log_in(console, TOKEN) == 429
    clock.advance(GUESS_SECONDS)
    assert log_in(console, TOKEN) == 303


def test_wrong_bearer_tokens_are_limited_too(
    ops: Operations, make_client: Callable[..., ConsoleClient]
) -> None:
    clock = ManualClock(1_000.0)
    console = make_client(token=TOKEN, clock=clock)
    wrong = {"Authorization": "Bearer wrong-token-of-some-length"}
    right = {"Authorization": f"Bearer {TOKEN}"}
    for _ in range(GUESSES):
        assert console.get("/dead", headers=wrong).status_code == 401
    for headers in (wrong, right):
        answer = console.get("/dead", headers=headers)
        assert answer.status_code == 429
        assert "b-1" not in answer.text
        assert answer.headers["retry-after"] == str(int(GUESS_SECONDS))
    # Right tokens are never counted: a script polling with the token is not held up.
    clock.advance(GUESSES * GUESS_SECONDS)
    for _ in range(3 * GUESSES):
        assert console.get("/dead", headers=right).status_code == 200


def test_the_guess_limit_remembers_a_bounded_number_of_addresses() -> None:
    clock = ManualClock()
    limit = GuessLimit(clock, guesses=1, seconds=60.0, remembered=3)
    for n in range(100):
        limit.wrong(f"192.0.2.{n}")
    assert len(limit.buckets) == 3
    assert limit.wait("192.0.2.99") == 60  # the latest are remembered
    assert limit.wait("192.0.2.0") == 0  # the first forgotten


def test_an_ipv6_host_guesses_as_its_64() -> None:
    # One host is handed a whole /64: each of its addresses is not a new guesser.
    limit = GuessLimit(ManualClock(), guesses=2, seconds=60.0)
    limit.wrong("2001:db8:1:2::1")
    limit.wrong("2001:db8:1:2:ffff::9")
    assert limit.wait("2001:db8:1:2::77") == 60
    assert limit.wait("2001:db8:1:3::1") == 0
    # IPv4 clients of a dual-stack socket arrive mapped into one /64: each is its own.
    limit.wrong("::ffff:192.0.2.1")
    limit.wrong("::ffff:192.0.2.1")
    assert limit.wait("::ffff:192.0.2.1") == 60
    assert limit.wait("::ffff:192.0.2.2") == 0


def test_wrong_bearer_tokens_at_the_login_page_are_counted(
    ops: Operations, make_client: Callable[..., ConsoleClient]
) -> None:
    # GET /login redirects a right bearer token and shows the form to a wrong one: an
    # answer that tells them apart is a guess like any other.
    console = make_client(token=TOKEN, clock=ManualClock(1_000.0))
    wrong = {"Authorization": "Bearer wrong-token-of-some-length"}
    for _ in range(GUESSES):
        assert console.get("/login", headers=wrong).status_code == 200
    assert console.get("/login", headers=wrong).status_code == 429
    assert console.get("/login", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 429


def test_logout_ends_the_session_for_every_copy_of_its_cookie(
    ops: Operations, session_clock: MovableClock, make_client: Callable[..., ConsoleClient]
) -> None:
    # A copied cookie stayed valid for SESSION_SECONDS after its owner logged out.
    console = make_client(token=TOKEN)
    cookie = logged_in_cookie(console)
    other = logged_in_cookie(make_client(app=console.app))  # a second browser's session
    assert opens(console, cookie)
    console.cookies.set(SESSION_COOKIE, cookie)
    page = console.get("/")
    assert console.post("/logout", data={"csrf_token": csrf_of(page.text)}).status_code == 303
    assert not opens(console, cookie)
    assert opens(console, other)  # only the session logged out of ends


def test_a_new_token_or_a_restart_ends_every_session(
    ops: Operations, session_clock: MovableClock, make_client: Callable[..., ConsoleClient]
) -> None:
    # A new token takes a restart: sessions are held by the process that opened them.
    cookie = logged_in_cookie(make_client(token=TOKEN))
    assert not opens(make_client(token=TOKEN), cookie)
    assert not opens(make_client(token="another-token-of-enough-length"), cookie)


def test_only_so_many_sessions_are_held_the_oldest_ending_first(
    monkeypatch: pytest.MonkeyPatch, session_clock: MovableClock
) -> None:
    monkeypatch.setattr(login_sessions, "LIVE_SESSIONS", 3)
    sessions = login_sessions.Sessions(TOKEN)
    cookies = [sessions.new(OPERATOR) for _ in range(5)]
    assert len(sessions.live) == 3
    assert [sessions.opened(cookie) is not None for cookie in cookies] == [
        False, False, True, True, True,
    ]  # fmt: skip
