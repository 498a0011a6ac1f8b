"""`--continue-traces` (or OUTBOX_RECEIVER_CONTINUE_TRACES) from the command line to the HTTP
receiver's app and to both consumers; no process is started, nothing is served."""

from __future__ import annotations

from pathlib import Path

import pytest
import uvicorn
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.receiver_helpers import SECRET, AppClient, signed
from support.tracing import SPAN_ID, TRACE_ID, TRACEPARENT, ids, linked, named, spans

from outbox_cli import main
from receiver import NatsConsumer, RabbitMQConsumer

__all__ = ["spans"]  # the fixture, used by name

# Reading the command line does not depend on the store.
pytestmark = pytest.mark.parametrize("backend", ["sqlite"], indirect=True)

CHOICES: list[tuple[list[str], dict[str, str], bool]] = [
    ([], {}, False),
    (["--continue-traces"], {}, True),
    ([], {"OUTBOX_RECEIVER_CONTINUE_TRACES": "true"}, True),
]
"""(flags, environment, continued): the switch, its variable, and neither."""


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    """A secret file holding the tests' secret."""
    path = tmp_path / "secrets"
    path.write_text(SECRET + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize(("flags", "environment", "continued"), CHOICES)
def test_the_receiver_app_continues_traces_as_the_command_line_says(
    db_url: str,
    secret_file: Path,
    spans: InMemorySpanExporter,
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    environment: dict[str, str],
    continued: bool,
) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    answers: list[int] = []

    def serve(server: uvicorn.Server, sockets: object) -> None:
        # Instead of serving: one message to the app the command line built, its store open.
        headers = {**signed("r-1", b"{}"), "traceparent": TRACEPARENT}
        answer = AppClient(server.config.app).post("/replies", content=b"{}", headers=headers)
        answers.append(answer.status_code)

    monkeypatch.setattr(uvicorn.Server, "run", serve)
    argv = ["receiver", "--db", db_url, "--secret-file", str(secret_file), "--port", "0"]
    assert main([*argv, *flags]) == 0
    assert answers == [200]
    (span,) = named(spans.get_finished_spans(), "process replies")
    if continued:
        assert (ids(span.parent), linked(span)) == ((TRACE_ID, SPAN_ID), [])
    else:
        assert (span.parent, linked(span)) == (None, [(TRACE_ID, SPAN_ID)])


@pytest.mark.parametrize(("flags", "environment", "continued"), CHOICES)
@pytest.mark.parametrize(
    ("source", "consumer"),
    [
        (["--from", "nats://127.0.0.1:1", "--stream", "S", "--durable", "D"], NatsConsumer),
        (["--from", "amqp://127.0.0.1:1/", "--queue", "Q"], RabbitMQConsumer),
    ],
)
def test_a_consumer_continues_traces_as_the_command_line_says(
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,
    source: list[str],
    consumer: type[NatsConsumer | RabbitMQConsumer],
    flags: list[str],
    environment: dict[str, str],
    continued: bool,
) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    built: list[NatsConsumer | RabbitMQConsumer] = []

    async def taken(self: NatsConsumer | RabbitMQConsumer) -> None:
        built.append(self)  # what would consume is taken instead: nothing connects

    monkeypatch.setattr(consumer, "run", taken)
    argv = ["receiver", "consume", "--db", db_url, "--unsigned", *source]
    assert main([*argv, *flags]) == 0
    assert [type(made) for made in built] == [consumer]
    assert built[0].continue_traces is continued
