"""`outbox receiver consume`: the receiver's dedupe fed from a broker instead of HTTP.

    outbox receiver consume --db URL --from nats://HOST:4222 --stream S --durable D
                            [--secret-file F | --unsigned]
    outbox receiver consume --db URL --from amqp://USER:PASS@HOST:5672/ --queue Q
                            [--secret-file F | --unsigned]

Each message is checked (signature without a freshness limit, content hash, JSON),
stored with the reference effect in one transaction, and only then acknowledged; see
docs/reference/receiver-contract.md, *Consuming from a broker*. SIGTERM or SIGINT stops after the
messages in hand are committed and settled.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Callable, Sequence
from typing import Any

from outbox.errors import ConfigError
from outbox.observability.server import DEFAULT_HOST
from outbox_cli.arguments import boolean, non_negative_int, positive_float, positive_int
from outbox_cli.logs import announce, configure_logging
from outbox_cli.own_process import tune_if_own_process
from outbox_cli.ports import metrics_server
from outbox_cli.settings import Option, add_flags, config_path

OPTIONS = (
    Option.of("receiver", "from"),
    Option.of("receiver", "stream"),
    Option.of("receiver", "durable"),
    Option.of("receiver", "queue"),
    Option.of("receiver", "batch", positive_int, 100),
    Option.of("receiver", "ack_wait", positive_float, 60.0),
    Option.of("receiver", "max_deliveries", positive_int, 5),
    Option.of("receiver", "unsigned", boolean, False),
    Option.of("receiver", "metrics_port", non_negative_int),
    Option.of("receiver", "metrics_host", default=DEFAULT_HOST),
)
"""`consume` settings: each a flag, an OUTBOX_RECEIVER_* variable, or receiver.* in the file."""

HELP = {
    "from": "the broker: nats://HOST:PORT (or tls://) or amqp://USER:PASS@HOST:PORT/ (amqps://)",
    "stream": "NATS: the JetStream stream",
    "durable": "NATS: the durable pull consumer (created when missing)",
    "queue": "RabbitMQ: the queue (it must exist)",
    "batch": "messages fetched and stored per transaction; RabbitMQ's prefetch (default 100)",
    "ack_wait": "NATS: seconds before an unacknowledged message is delivered again, for a "
    "durable this command creates (default 60)",
    "max_deliveries": "deliveries whose effect raises before a message goes to the dead "
    "letters (outbox receiver dead list), acknowledged (default 5)",
    "unsigned": "accept messages without a signature (only on a broker you trust completely)",
    "metrics_port": "serve /metrics, /healthz, /readyz on this port (0: off)",
    "metrics_host": f"address the metrics port binds (default {DEFAULT_HOST})",
}
NATS_SCHEMES = ("nats", "tls")
AMQP_SCHEMES = ("amqp", "amqps")

log = logging.getLogger("outbox.receiver.consume")


def add_parser(
    actions: Any,
    db_argument: Callable[[argparse.ArgumentParser, Any], None],
    shared: Sequence[Option],
    helps: dict[str, str],
) -> argparse.ArgumentParser:
    """Register `consume` on the receiver's actions; `shared` are receiver options it reads too."""
    parser: argparse.ArgumentParser = actions.add_parser(
        "consume",
        help="consume from NATS JetStream or RabbitMQ with the receiver's dedupe",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    db_argument(parser, argparse.SUPPRESS)
    add_flags(parser, OPTIONS, HELP, absent=argparse.SUPPRESS)
    add_flags(parser, shared, helps, absent=argparse.SUPPRESS)
    return parser


EARLY = ("from", "stream", "durable", "queue", "ack_wait", "metrics_port", "metrics_host")
"""`consume` options also taken before the word `consume` (`receiver --from X consume`)."""


class _Early(argparse.Action):
    """A `consume` option given before `consume`: kept, and noted so that another action
    than `consume` can refuse it rather than let it be read as that action's name."""

    def __call__(
        self, parser: Any, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        setattr(namespace, self.dest, values)
        namespace.consume_options = [*getattr(namespace, "consume_options", []), option]


def add_early_flags(parser: argparse.ArgumentParser) -> None:
    """Take the EARLY options on `outbox receiver` itself, for `consume` to read."""
    for option in OPTIONS:
        if option.dest in EARLY:
            parser.add_argument(
                option.flag,
                type=option.parse,
                action=_Early,
                default=argparse.SUPPRESS,
                help=f"`consume` only: {HELP[option.dest]}",
            )


def refuse_early(args: argparse.Namespace) -> None:
    """ConfigError when an action other than `consume` was given `consume` options."""
    given = getattr(args, "consume_options", None)
    if given and args.receiver_command != "consume":
        what = "is an option" if len(given) == 1 else "are options"
        raise ConfigError(
            f"{', '.join(given)} {what} of `outbox receiver consume`; the HTTP receiver "
            "serves /metrics, /healthz and /readyz on its own --port"
        )


def run(args: argparse.Namespace, secrets_from: Callable[[str | None], list[str]]) -> int:
    """Consume until SIGTERM/SIGINT; 0 after the messages in hand are settled."""
    from receiver.effects import record_effect
    from receiver.metrics import ConsumerMetrics
    from receiver.store import ReceiptStore

    source: str | None = getattr(args, "from")
    if not source:
        raise ConfigError("--from is required: nats://HOST:PORT or amqp://USER:PASS@HOST:PORT/")
    if args.unsigned and args.secret_file:
        raise ConfigError("--unsigned and --secret-file: choose one")
    secrets = None if args.unsigned else secrets_from(args.secret_file)
    metrics = ConsumerMetrics()
    with ReceiptStore(args.db) as store:
        common: dict[str, Any] = {
            "secrets": secrets,
            "unsigned": args.unsigned,
            "effect": record_effect,
            "batch": args.batch,
            "max_deliveries": args.max_deliveries,
            "metrics": metrics,
            "continue_traces": args.continue_traces,
        }
        consumer = _consumer(args, source, store, common)
        # Only now: a refusal above is one plain line, like every bad command line.
        configure_logging(args.log_format, args.log_level)
        announce("receiver consume", args.db, config_path(args))
        server = _metrics_server(args, store, metrics)
        try:
            tune_if_own_process()
            asyncio.run(_until_signal(consumer))
        finally:
            if server is not None:
                server.close()
    counts = {
        sample.labels["outcome"]: int(sample.value)
        for family in metrics.consumed.collect()
        for sample in family.samples
        if sample.name.endswith("_total")
    }
    log.info(
        "consumer stopped: %s",
        ", ".join(f"{outcome} {count}" for outcome, count in counts.items()),
        extra={"fields": counts},
    )
    return 0


def _consumer(args: argparse.Namespace, source: str, store: Any, common: dict[str, Any]) -> Any:
    """The broker consumer `--from` names, its broker's options checked."""
    scheme = source.partition("://")[0].lower() if "://" in source else ""
    if scheme in NATS_SCHEMES:
        if not args.stream or not args.durable:
            raise ConfigError("consuming from NATS needs --stream and --durable")
        if args.queue:
            raise ConfigError("--queue is for RabbitMQ; NATS takes --stream and --durable")
        from receiver.nats_consumer import NatsConsumer

        return NatsConsumer(
            store,
            url=source,
            stream=args.stream,
            durable=args.durable,
            ack_wait=args.ack_wait,
            **common,
        )
    if scheme in AMQP_SCHEMES:
        if not args.queue:
            raise ConfigError("consuming from RabbitMQ needs --queue")
        if args.stream or args.durable:
            raise ConfigError("--stream and --durable are for NATS; RabbitMQ takes --queue")
        from receiver.rabbitmq_consumer import RabbitMQConsumer

        return RabbitMQConsumer(store, url=source, queue=args.queue, **common)
    raise ConfigError("--from must start with nats://, tls://, amqp:// or amqps://")


def _metrics_server(args: argparse.Namespace, store: Any, metrics: Any) -> Any:
    """The /metrics server when --metrics-port is set, else None."""
    if not args.metrics_port:
        return None
    from outbox.observability.probe import Probe

    database = Probe(store.ping, deadline=1.0)
    metrics.watch(database)

    def ready() -> dict[str, Any]:
        answered = database() is not None
        return {"ok": answered, "database": answered}

    return metrics_server(
        args,
        render=metrics.render,
        health=lambda: {"ok": True},
        ready=ready,
    ).start()


async def _until_signal(consumer: Any) -> None:
    """Run the consumer; SIGTERM or SIGINT asks it to stop after what it holds."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, consumer.stop)
    try:
        await consumer.run()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
