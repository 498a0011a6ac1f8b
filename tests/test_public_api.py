"""The public names are a contract: what a user touches is exported, test helpers are not."""

from __future__ import annotations

import outbox
import outbox.alembic_filters
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


def test_a_services_alembic_finds_its_filters_and_our_rule() -> None:
    filters = outbox.alembic_filters
    assert sorted(filters.__all__) == [
        "TABLE_PREFIXES",
        "include_name",
        "include_object",
        "is_ours",
        "only_ours",
    ]
    ours_only_name, ours_only_object = filters.only_ours("postgresql")
    for table, ours in [
        ("outbox_messages", True),
        ("outbox_alembic_version", True),
        ("receiver_receipts", True),
        ("orders", False),
        ("my_outbox_events", False),
    ]:
        assert filters.is_ours(table) is ours
        assert filters.include_name(table, "table", {"schema_name": None}) is not ours
        assert filters.include_object(None, table, "table", True, None) is not ours
        assert ours_only_name(table, "table", {"schema_name": None}) is ours
        assert ours_only_object(None, table, "table", True, None) is ours
    assert filters.include_name("public", "schema", {})  # the filters judge tables only


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


def test_the_relay_and_receiver_errors_join_the_one_tree() -> None:
    import inspect

    import receiver
    import receiver.errors
    import relay.errors

    for module in (relay.errors, receiver.errors):
        own = [value for value in vars(module).values() if inspect.isclass(value)]
        own = [error for error in own if error.__module__ == module.__name__]
        assert sorted(module.__all__) == sorted(error.__name__ for error in own)
        for error in own:
            assert issubclass(error, outbox.OutboxError), error
            assert error.__name__ in (module.__doc__ or ""), f"{error.__name__} not drawn"
    assert receiver.StoreUnavailable is receiver.errors.StoreUnavailable
