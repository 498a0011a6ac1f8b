"""`outbox console` renders its pages from the templates and style sheet the distribution
ships, a dead reply's body shown as text."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import sqlalchemy as sa
from sqlalchemy.orm import Session

import outbox
from outbox.operations import Operations
from outbox.schema import messages
from outbox_cli.console import app as console_app
from outbox_cli.console.app import create_app

BODY = {"note": "<script>document.title='ran'</script>"}


def fetch(app: object, *paths: str) -> list[httpx.Response]:
    """GET each path through the app, in process, as a browser on loopback would."""

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8080") as c:
            return [await c.get(path) for path in paths]

    return asyncio.run(go())


def test_the_pages_render_from_the_shipped_templates(tmp_path: Path, expected_home: Path) -> None:
    url = f"sqlite:///{tmp_path / 'console.db'}"
    outbox.upgrade(url)
    engine = outbox.create_engine(url)
    try:
        with Session(engine) as session, session.begin():
            outbox.publish(session, "billing", "order-1:refunded", BODY)
        with engine.begin() as conn:
            conn.execute(
                sa.update(messages).values(state="dead", attempts=3, last_error="HTTP 410: gone")
            )
    finally:
        engine.dispose()
    shipped = Path(console_app.__file__).parent
    assert shipped.resolve().is_relative_to(expected_home)
    with Operations(url) as ops:
        app = create_app(ops, config=None, token=None, read_only=False, host="127.0.0.1")
        overview, dead, reply, style = fetch(
            app, "/", "/dead", "/reply?id=order-1%3Arefunded", "/static/console.css"
        )
    for page in (overview, dead, reply):
        assert page.status_code == 200, page.text
        assert '<link rel="stylesheet" href="/static/console.css"' in page.text
    assert 'data-reply-id="order-1:refunded"' in dead.text
    assert "&lt;script&gt;" in reply.text
    assert "<script>document" not in reply.text
    assert style.status_code == 200
    assert style.text == (shipped / "static" / "console.css").read_text(encoding="utf-8")
