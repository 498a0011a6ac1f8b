"""`outbox receiver dead list|show|retry|purge`: what an operator does with dead letters."""

from __future__ import annotations

import json

import pytest
from sqlalchemy.orm import Session
from support.receiver_helpers import count_effects, stored_receipts

from outbox_cli import main
from receiver import ReceiptStore
from receiver.dead_letters import LastTry


def refuse(session: Session, body: bytes) -> None:
    """An effect that always raises."""
    raise RuntimeError("the ledger is closed")


@pytest.fixture
def buried(db_url: str) -> str:
    """The test database holding one dead letter, p1, as a NATS consumer left it."""
    store = ReceiptStore(db_url)
    last = LastTry({"webhook-id": "p1", "traceparent": "00-ab-cd-01"}, 5, 9, "nats", "ORDERS/42")
    try:
        body = b'{"order":7}'
        assert store.accept_many([("p1", body)], refuse, isolate=True, last_tries={0: last}) == [
            "dead"
        ]
    finally:
        store.close()
    return db_url


def test_list_shows_each_dead_letter_with_its_reason(
    buried: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["receiver", "dead", "list", "--db", buried]) == 0
    out = capsys.readouterr().out
    assert "p1" in out
    assert "RuntimeError: the ledger is closed" in out
    assert main(["receiver", "dead", "list", "--db", buried, "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["reply_id"] == "p1"
    assert (row["failures"], row["deliveries"], row["broker"]) == (5, 9, "nats")
    assert row["reason"] == "RuntimeError: the ledger is closed"
    assert row["dead"].endswith("Z")


def test_show_gives_the_headers_and_the_body(
    buried: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["receiver", "dead", "show", "p1", "--db", buried, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["body"] == {"order": 7}
    assert shown["headers"] == {"webhook-id": "p1", "traceparent": "00-ab-cd-01"}
    assert shown["broker_ref"] == "ORDERS/42"
    assert main(["receiver", "dead", "show", "p1", "--db", buried]) == 0
    assert "traceparent: 00-ab-cd-01" in capsys.readouterr().out
    assert main(["receiver", "dead", "show", "nobody", "--db", buried]) == 1


def test_retry_applies_it_through_the_reference_effect_once(
    buried: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["receiver", "dead", "retry", "p1", "--db", buried]) == 0
    assert "p1 applied" in capsys.readouterr().out
    assert stored_receipts(buried) == {"p1": b'{"order":7}'}
    assert count_effects(buried, "p1") == 1
    assert main(["receiver", "dead", "retry", "p1", "--db", buried]) == 1  # gone
    assert main(["receiver", "dead", "list", "--db", buried]) == 0
    assert "no dead letters" in capsys.readouterr().out


def test_purge_forgets_one_or_the_old_ones(buried: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["receiver", "dead", "purge", "--older-than", "1d", "--db", buried]) == 0
    assert "forgot 0 dead letter(s)" in capsys.readouterr().out
    assert main(["receiver", "dead", "purge", "p1", "--db", buried]) == 0
    assert main(["receiver", "dead", "purge", "p1", "--db", buried]) == 1
    assert stored_receipts(buried) == {}
