"""The public names are a contract (SPEC section 9)."""

from __future__ import annotations

import outbox


def test_exported_names_are_exactly_the_contract() -> None:
    assert sorted(outbox.__all__) == sorted(
        [
            "Ack",
            "AuthContext",
            "BatchFailed",
            "Claim",
            "Envelope",
            "Fenced",
            "InvalidEnvelope",
            "InvalidMessage",
            "ManualClock",
            "OutboxError",
            "PayloadCollision",
            "SchemaNotReady",
            "TaskQueue",
            "Unauthorized",
            "create_engine",
            "failpoints",
            "publish",
            "upgrade",
        ]
    )
    for name in outbox.__all__:
        assert getattr(outbox, name) is not None


def test_invalid_input_errors_are_value_errors() -> None:
    assert issubclass(outbox.InvalidEnvelope, ValueError)
    assert issubclass(outbox.InvalidMessage, ValueError)
    assert issubclass(outbox.failpoints.Crash, BaseException)
    assert not issubclass(outbox.failpoints.Crash, Exception)
