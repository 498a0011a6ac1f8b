"""The receiver's /metrics, /readyz and JSON logs: in-process and as `outbox receiver`."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families
from support.db_faults import database_down
from support.processes import PROCESS_EXIT
from support.receiver_helpers import SECRET, AppClient, ReceiverProcess, signed, wait_until

import outbox
import receiver
from receiver import ReceiptStore, create_app
from receiver.effects import record_effect

BODY = b'{"kind":"result","task_id":"t-1","status":"done"}'
OTHER = b'{"kind":"result","task_id":"t-1","status":"failed"}'


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text: (name, sorted labels) -> value."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def labelled(samples: dict[Any, float], name: str, *keys: str) -> dict[tuple[str, ...], float]:
    """One counter's samples, keyed by the values of `keys`, zeros left out."""
    return {
        tuple(dict(labels)[key] for key in keys): value
        for (sample, labels), value in samples.items()
        if sample == name and value
    }


def post(base: Any, reply_id: str, body: bytes) -> int:
    """POST a signed reply through an AppClient or to a URL; its status."""
    if isinstance(base, AppClient):
        return base.post("/replies", content=body, headers=signed(reply_id, body)).status_code
    return httpx.post(
        base + "/replies", content=body, headers=signed(reply_id, body), timeout=10
    ).status_code


def test_requests_and_receipts_are_counted(db_url: str) -> None:
    with ReceiptStore(db_url) as store:
        client = AppClient(create_app(store, [SECRET], effect=record_effect))
        assert post(client, "r-1", BODY) == 200  # stored
        assert post(client, "r-1", BODY) == 200  # duplicate
        assert post(client, "r-1", OTHER) == 409  # conflict
        unsigned = client.post("/replies", content=BODY, headers={})
        assert unsigned.status_code == 401
        assert client.get("/nowhere").status_code == 404
        pages: list[httpx.Response] = []

        def scraped_with_the_database() -> bool:
            pages[:] = [client.get("/metrics")]
            return "outbox_receiver_database_up 1.0" in pages[0].text

        # Its database read waits at most a second: a busy machine may need another look.
        wait_until(scraped_with_the_database, 20, "a scrape that reached the database")
    [page] = pages
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {key: value for key, value in scrape(page.text).items() if "/metrics" not in key[1]}
    assert labelled(samples, "outbox_receiver_receipts_total", "outcome") == {
        ("stored",): 1.0,
        ("duplicate",): 1.0,
        ("conflict",): 1.0,
    }
    assert labelled(samples, "outbox_receiver_requests_total", "route", "method", "status") == {
        ("/replies", "POST", "200"): 2.0,
        ("/replies", "POST", "409"): 1.0,
        ("/replies", "POST", "401"): 1.0,
        ("unmatched", "GET", "404"): 1.0,
    }
    # One transaction per POST here: each arrived alone, so each group held one message.
    assert samples["outbox_receiver_commit_seconds_count", ()] == 3.0
    assert samples["outbox_receiver_commit_receipts_sum", ()] == 3.0
    assert samples["outbox_receiver_database_up", ()] == 1.0


def test_readiness_follows_the_database_and_liveness_does_not(db_url: str) -> None:
    engine = outbox.create_engine(db_url)
    with ReceiptStore(engine) as store:
        client = AppClient(create_app(store, [SECRET], effect=record_effect))
        ready = client.get("/readyz")
        assert (ready.status_code, ready.json()) == (200, {"ok": True, "database": True})

        with database_down(engine):
            # The last answer is kept for a second: poll until readiness says so.
            wait_until(lambda: client.get("/readyz").status_code == 503, 10, "not ready")
            assert client.get("/readyz").json() == {"ok": False, "database": False}
            assert client.get("/healthz").status_code == 200  # alive all the same
            page = client.get("/metrics")
            assert page.status_code == 200  # /metrics answers without the database
            assert "outbox_receiver_database_up 0.0" in page.text
        wait_until(lambda: client.get("/readyz").status_code == 200, 10, "ready again")
    engine.dispose()


class StoreWithoutPing:
    """A store of an application's own: accept_many, lookup and retention, no ping."""

    def __init__(self, store: ReceiptStore) -> None:
        self.retention = store.retention
        self.accept_many = store.accept_many
        self.lookup = store.lookup


def test_a_store_without_ping_is_served_and_always_ready(db_url: str) -> None:
    with ReceiptStore(db_url) as store:
        client = AppClient(create_app(StoreWithoutPing(store), [SECRET]))
        assert post(client, "n-1", BODY) == 200
        ready = client.get("/readyz")
        assert (ready.status_code, ready.json()) == (200, {"ok": True})
        page = client.get("/metrics").text
    assert 'outbox_receiver_receipts_total{outcome="stored"} 1.0' in page
    assert "outbox_receiver_database_up" not in page


def json_lines(err: bytes) -> list[dict[str, Any]]:
    """Every stderr line as JSON (fails on a line that is not one JSON object)."""
    lines = err.decode().splitlines()
    assert lines, "nothing logged"
    parsed = [json.loads(line) for line in lines]
    assert all(isinstance(entry, dict) for entry in parsed), lines
    return parsed


def test_a_batch_counts_each_receipt_by_its_outcome(db_url: str) -> None:
    with ReceiptStore(db_url) as store:
        store.accept("b-1", BODY)
        store.accept("b-2", BODY)
        client = AppClient(create_app(store, [SECRET], effect=record_effect))
        items = [("b-1", BODY), ("b-2", OTHER), ("b-3", BODY), ("b-4", BODY), ("b-5", OTHER)]
        batch = json.dumps(
            {"replies": [{"reply_id": r, "body": b.decode()} for r, b in items]}
        ).encode()
        answer = client.post("/replies/batch", content=batch, headers=signed("batch:1-5-5", batch))
        assert answer.status_code == 200
        page = client.get("/metrics").text
    samples = scrape(page)
    assert labelled(samples, "outbox_receiver_receipts_total", "outcome") == {
        ("stored",): 3.0,
        ("duplicate",): 1.0,
        ("conflict",): 1.0,
    }
    assert samples["outbox_receiver_commit_receipts_sum", ()] == 5.0


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    """A secrets file with the test secret."""
    path = tmp_path / "secrets"
    path.write_text(f"{SECRET}\n", encoding="utf-8")
    return path


def test_the_receiver_process_counts_answers_readiness_and_logs_json(
    pg_server: sa.Engine, secret_file: Path
) -> None:
    # A database of its own, dropped under the running receiver: its database goes away.
    name = f"outbox_receiver_{uuid.uuid4().hex[:12]}"
    with pg_server.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = pg_server.url.set(database=name).render_as_string(hide_password=False)
    receiver.upgrade(url)
    served = ReceiverProcess(url, secret_file, {"OUTBOX_RECEIVER_LOG_FORMAT": "json"})
    try:
        served.wait_ready()
        assert [post(served.base, "p-1", b) for b in (BODY, BODY, OTHER)] == [200, 200, 409]
        samples = scrape(httpx.get(served.base + "/metrics", timeout=10).text)
        assert labelled(samples, "outbox_receiver_receipts_total", "outcome") == {
            ("stored",): 1.0,
            ("duplicate",): 1.0,
            ("conflict",): 1.0,
        }
        assert httpx.get(served.base + "/readyz", timeout=10).status_code == 200
        with pg_server.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE "{name}" WITH (FORCE)'))
        wait_until(
            lambda: httpx.get(served.base + "/readyz", timeout=10).status_code == 503,
            20,
            "readiness to fail",
        )
        assert post(served.base, "p-2", BODY) == 503  # stored nowhere: the relay retries
        assert httpx.get(served.base + "/healthz", timeout=10).status_code == 200
        page = httpx.get(served.base + "/metrics", timeout=10)
        assert "outbox_receiver_database_up 0.0" in page.text
    finally:
        served.proc.terminate()
        try:
            _, err = served.proc.communicate(timeout=PROCESS_EXIT)
        finally:
            served.stop()  # kills it if it did not stop in time
            with pg_server.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    logged = json_lines(err)
    messages = [entry["message"] for entry in logged]
    assert any(m.startswith("receiver listening on") for m in messages), messages
    assert any(entry["logger"].startswith("uvicorn") for entry in logged), messages
    assert any(entry["level"] == "warning" for entry in logged), messages  # the failed probe
