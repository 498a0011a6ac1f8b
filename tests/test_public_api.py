"""The public names are a contract: what a user touches is exported, test helpers are not."""

from __future__ import annotations

import outbox
import outbox.testing


def test_exported_names_are_exactly_the_contract() -> None:
    assert sorted(outbox.__all__) == sorted(
        [
            "Ack",
            "AuthContext",
            "BatchFailed",
            "Claim",
            "Envelope",
            "ErrorCode",
            "Fenced",
            "InvalidEnvelope",
            "InvalidMessage",
            "MessageState",
            "OutboxError",
            "PayloadCollision",
            "PermanentFailure",
            "SchemaNotReady",
            "TaskQueue",
            "TaskState",
            "Unauthorized",
            "Worker",
            "create_engine",
            "publish",
            "upgrade",
        ]
    )
    for name in outbox.__all__:
        assert getattr(outbox, name) is not None


def test_invalid_input_errors_are_value_errors() -> None:
    assert issubclass(outbox.InvalidEnvelope, ValueError)
    assert issubclass(outbox.InvalidMessage, ValueError)
    assert issubclass(outbox.testing.Crash, BaseException)
    assert not issubclass(outbox.testing.Crash, Exception)


def test_every_public_exception_is_an_outbox_error_in_the_one_tree() -> None:
    import inspect

    import outbox.errors

    raised = [
        value
        for name, value in vars(outbox.errors).items()
        if inspect.isclass(value) and issubclass(value, Exception) and not name.startswith("_")
    ]
    assert len(raised) >= 14
    documented = outbox.errors.__doc__ or ""
    for error in raised:
        assert issubclass(error, outbox.OutboxError), error
        assert error.__name__ in documented, f"{error.__name__} missing from the tree"
