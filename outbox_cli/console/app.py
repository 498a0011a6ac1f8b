"""The console's Starlette app: the pages, the login form, the style sheet, the guard."""

from __future__ import annotations

import argparse
import logging
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from outbox.clock import Clock
from outbox.operations import Operations
from outbox_cli.arguments import operator_name
from outbox_cli.console.actions import Actions
from outbox_cli.console.audit_page import AuditPage
from outbox_cli.console.confirmations import Confirmations
from outbox_cli.console.forms import checked_form
from outbox_cli.console.guesses import GuessLimit, too_many_guesses
from outbox_cli.console.hosts import allowed_hosts
from outbox_cli.console.lists import REPLIES, TASKS, Lists
from outbox_cli.console.login_sessions import SESSION_COOKIE, SESSION_SECONDS, Sessions
from outbox_cli.console.pages import HERE, Pages
from outbox_cli.console.security import Guard, authenticated, client_address, secure, token_matches

STYLE = (HERE / "static" / "console.css").read_text(encoding="utf-8")
log = logging.getLogger("outbox.console")


class Login:
    """The login form: the token and the operator's name entered once, remembered in a
    server-side session whose cookie is HttpOnly and SameSite."""

    def __init__(
        self, pages: Pages, token: str | None, guesses: GuessLimit, sessions: Sessions | None
    ) -> None:
        """Checks against `token`, as often as `guesses` allows, and opens `sessions`;
        without a token (and sessions), there is nothing to log in to."""
        self.pages = pages
        self.token = token
        self.guesses = guesses
        self.sessions = sessions

    async def unauthorized(self, request: Request) -> Response:
        """401: the login form for a page, a short text for anything else."""
        headers = {"WWW-Authenticate": "Bearer"}
        if request.method == "GET":
            response = self.page(request, 401, _local(request.url.path))
            response.headers.update(headers)
            return response
        return PlainTextResponse("401: the console token is required", 401, headers)

    async def form(self, request: Request) -> Response:
        """GET /login: the form (or the overview when already in, or when no token is set)."""
        if authenticated(request, self.token, self.sessions):
            return RedirectResponse(_local(request.query_params.get("next", "/")), 303)
        return self.page(request, 200, _local(request.query_params.get("next", "/")))

    def page(
        self,
        request: Request,
        status: int,
        target: str,
        *,
        wrong: bool = False,
        bad_name: str | None = None,
        given: str = "",
    ) -> Response:
        """The login form going on to `target`, saying the token was `wrong` or the name
        given was bad, the name `given` filled in again."""
        return self.pages.render(
            request,
            "login.html",
            status,
            next=target,
            wrong=wrong,
            bad_name=bad_name,
            given_name=given,
        )

    async def submit(self, request: Request) -> Response:
        """POST /login: a right token and a name open a session (its cookie set); a wrong
        token answers 401, a missing or unprintable name 400."""
        form = await checked_form(request)
        target = _local(form.get("next", "/"))
        if self.token is None or self.sessions is None:
            return RedirectResponse(target, 303)
        client = client_address(request)
        if wait := self.guesses.wait(client):
            return too_many_guesses(wait)
        given = form.get("operator", "")
        try:
            operator = operator_name(given)
        except argparse.ArgumentTypeError as exc:
            # Before the token is checked: this answer tells nothing of the token.
            return self.page(request, 400, target, bad_name=str(exc), given=given)
        if not token_matches(self.token, form.get("token", "")):
            self.guesses.wrong(client)
            return self.page(request, 401, target, wrong=True, given=given)
        # Who gave which name from where: the audit rows hold the name, the log ties it to
        # an address, as the token alone is shared.
        log.info("console: %r logged in from %s", operator, client)
        response = RedirectResponse(target, 303)
        response.set_cookie(
            SESSION_COOKIE,
            self.sessions.new(operator),
            max_age=SESSION_SECONDS,
            httponly=True,
            samesite="strict",
            secure=secure(request),
            path="/",
        )
        return response

    async def logout(self, request: Request) -> Response:
        """POST /logout: end the session, and forget its cookie."""
        await checked_form(request)
        if self.sessions is not None:
            self.sessions.end(request.cookies.get(SESSION_COOKIE, ""))
        response = RedirectResponse("/login", 303)
        response.delete_cookie(
            SESSION_COOKIE, path="/", httponly=True, samesite="strict", secure=secure(request)
        )
        return response


def _local(target: str) -> str:
    """A path on this console to go to after login; anything else (another site) is "/"."""
    if target.startswith("/") and not target.startswith("//") and "\\" not in target:
        return target
    return "/"


def style(request: Request) -> Response:
    """The one style sheet (the policy allows styles from this origin only)."""
    return Response(STYLE, media_type="text/css")


async def refused(request: Request, exc: Exception) -> Response:
    """An HTTP error as short text (403 for a missing CSRF token, and so on)."""
    assert isinstance(exc, HTTPException)
    return PlainTextResponse(f"{exc.status_code}: {exc.detail}", exc.status_code)


def create_app(
    ops: Operations,
    *,
    config: str | None,
    token: str | None,
    read_only: bool,
    host: str,
    warm: bool = False,
    clock: Clock | None = None,
    operator: str | None = None,
    reply_destination: str = "default",
) -> Starlette:
    """The console on `ops`, bound to `host`; `token` None means no token is asked
    (loopback only), and then `operator` is who requeues (no one: requeues are refused).
    With `warm`, what the first overview would read is read now; `clock` times the limit
    on wrong tokens and the life of force confirmations (a ManualClock in tests); a task
    cancelled here has its reply sent to `reply_destination`, as the worker's are."""
    ticking: Clock = time.monotonic if clock is None else clock
    confirmations = Confirmations(ticking)
    pages = Pages(
        ops, config, read_only, token is not None, operator, confirmations, reply_destination
    )
    # Bulk counts' confirmations apart: a burst of counts cannot push out a force's.
    actions = Actions(pages, Confirmations(ticking))
    if warm:
        pages.warm()
    guesses = GuessLimit(ticking)
    sessions = None if token is None else Sessions(token)
    login = Login(pages, token, guesses, sessions)
    routes = [
        Route("/", pages.overview),
        Route("/dead", pages.dead),
        Route("/replies", Lists(pages, REPLIES).page),
        Route("/tasks", Lists(pages, TASKS).page),
        Route("/reply", pages.reply),
        Route("/reply/requeue", pages.requeue, methods=["POST"]),
        Route("/reply/resolve", actions.resolve, methods=["POST"]),
        Route("/dead/bulk", actions.bulk, methods=["POST"]),
        Route("/audit", AuditPage(pages).page),
        Route("/task", pages.task),
        Route("/task/cancel", actions.cancel, methods=["POST"]),
        Route("/search", pages.search),
        Route("/login", login.form),
        Route("/login", login.submit, methods=["POST"]),
        Route("/logout", login.logout, methods=["POST"]),
        Route("/static/console.css", style),
    ]
    return Starlette(
        routes=routes,
        middleware=[
            Middleware(
                Guard,
                token=token,
                unauthorized=login.unauthorized,
                hosts=allowed_hosts(host),
                guesses=guesses,
                sessions=sessions,
            )
        ],
        exception_handlers={HTTPException: refused},
    )
