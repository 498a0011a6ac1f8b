"""Write the reference pages that are read off the code: settings, commands, metrics.

    python -m tools.docs_reference          # rewrite docs/reference/{config,commands,metrics}.md
    python -m tools.docs_reference --check  # exit 1 naming each page that is out of date

Each page is made from what the program itself uses: the settings from the commands'
Option lists (outbox_cli.OPTIONS, outbox_cli.settings.DB) and the relay's destination
keys (relay.config); the commands from the `outbox` argument parser; the metrics from
the Prometheus registries of the relay, the worker, the receiver and the consumer.
tests/test_docs_reference.py fails when a committed page differs from what this makes.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference"
REGENERATE = "python -m tools.docs_reference"
# argparse wraps --help to the terminal; a fixed width makes the page the same everywhere.
HELP_WIDTH = "100"

HEADER = "<!-- Written by `{command}` from the code; do not edit by hand: run it again. -->\n\n"

# What each argument type accepts, by the parse function's name (outbox_cli.arguments).
VALUE_KINDS = {
    "str": "text",
    "int": "whole number",
    "positive_int": "whole number >= 1",
    "non_negative_int": "whole number >= 0",
    "positive_float": "seconds > 0",
    "non_negative_float": "seconds >= 0",
    "parse_duration": "duration (30d, 12h, 90m, 45s)",
    "boolean": "true or false",
    "log_format": "text or json",
    "load_handler": "MODULE:FUNCTION",
    "non_empty": "text",
    "operator_name": "1 to 200 printable characters",
}

# What each [destinations.NAME] key is for; the test fails when a key has none.
DESTINATION_HELP = {
    "kind": "`http`, `nats` or `rabbitmq`: which transport delivers here",
    "url": "HTTP: the endpoint; NATS: `nats://` or `tls://`; RabbitMQ: `amqp://` or "
    "`amqps://` with the vhost (required)",
    "secret": "the `whsec_` signing secret itself: environment only, never in the file",
    "secret_file": "file whose first non-empty line is the `whsec_` secret",
    "secret_env": "environment variable that holds the `whsec_` secret",
    "timeout": "seconds for a whole attempt (HTTP) or parcel (brokers); below the relay lease",
    "mode": "HTTP: `single` (one POST per message) or `batch`",
    "concurrency": "requests (HTTP) or parcels (brokers) in flight to this destination",
    "receipt_lookup": "HTTP: GET `<url>/<reply_id>` settles an unknown outcome and guards requeues",
    "batch_url": "HTTP batch mode: the batch endpoint (default `<url>/batch`)",
    "max_batch_items": "messages per batch POST or broker parcel",
    "max_batch_bytes": "HTTP batch mode: bytes per POST; keep under the receiver's max_body",
    "ordered_batches": "HTTP batch mode: the receiver applies a batch's items of one ordering "
    "key in order and answers `held` after one it did not apply, so a batch may carry several "
    "messages of a key; without it a batch carries at most one per key",
    "require_retention": "refuse to start when the destination publishes no receipt retention",
    "unsigned": "send without signatures (refused unless said, and exclusive with a secret)",
    "allow_short_retention": "run although the receipt retention (or the stream's duplicate "
    "window) is shorter than the retry window: a late resend could apply twice",
    "stream": "NATS: the JetStream stream that captures the subject (required)",
    "subject": "NATS: the subject; may name `{ordering_key}` (required)",
    "fast_client": "NATS: publish through the relay's own client, which sends each parcel's "
    "publishes and header blocks as encoded once and reads PubAcks straight from the parser "
    "(less CPU per message), by overriding nats-py internals it checks at first use; `false`: "
    "through nats-py's public publish, slower, with the same PubAcks and order",
    "exchange": 'RabbitMQ: the exchange ("" is the default exchange; required)',
    "routing_key": "RabbitMQ: the routing key; may name `{ordering_key}` (required)",
}


def _cell(text: object) -> str:
    """Text that a Markdown table cell shows as written."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _value_kind(parse: Callable[..., Any]) -> str:
    return VALUE_KINDS.get(getattr(parse, "__name__", ""), "text")


def _actions(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """Every action of `parser` and of its subcommands, depth first."""
    for action in parser._actions:
        yield action
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _actions(child)


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            found: argparse.ArgumentParser = action.choices[name]
            return found
    raise KeyError(name)


def _flag_help(parser: argparse.ArgumentParser, flag: str) -> str:
    """The --help text of `flag` without its "(env ...)" note, which the table shows."""
    for action in _actions(parser):
        if flag in action.option_strings:
            return re.sub(r"\s*\(env [^)]*\)$", "", action.help or "")
    return ""


def _help_default(help_text: str) -> str | None:
    """The default a flag's help states, "(default ...)", for settings resolved later."""
    match = re.search(r"\(default:? ([^)]*)\)", help_text)
    return match.group(1) if match else None


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _setting_rows(command: str, parser: argparse.ArgumentParser) -> list[str]:
    """One table row per setting of `command`, with its real default."""
    from outbox_cli import command_options
    from relay import Relay

    relay_defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(Relay.__init__).parameters.items()
    }
    command_parser = _subparser(parser, command)
    rows = []
    for option in command_options(command):
        help_text = _flag_help(command_parser, option.flag) or _flag_help(parser, option.flag)
        if option.required:
            default = "required"
        elif option.default is not None:
            default = f"`{_shown(option.default)}`"
        elif command == "relay" and relay_defaults.get(option.dest) not in (None, inspect._empty):
            default = f"`{_shown(relay_defaults[option.dest])}`"
        else:
            default = _help_default(help_text) or "none"
        rows.append(
            f"| `{option.flag}` | `{option.env}` | `{option.key}` | {_value_kind(option.parse)} "
            f"| {_cell(default)} | {_cell(help_text)} |"
        )
    return rows


def destination_rows() -> list[str]:
    """One table row per key of a [destinations.NAME] table, with its real default."""
    from relay.config import DEFAULT_KIND, DESTINATION_ENV_PREFIX, DESTINATION_KEYS, Destination
    from relay.transports import KINDS

    defaults: dict[str, object] = {"kind": DEFAULT_KIND}
    holders: list[type[Any]] = [Destination, *(kind.options for kind in KINDS.values())]
    for holder in holders:
        for field in dataclasses.fields(holder):
            if field.default is not dataclasses.MISSING:
                defaults[field.name] = field.default
    rows = []
    # In the order of DESTINATION_HELP: the keys every kind has and each kind's own, mixed
    # as a reader looks for them.
    for key in DESTINATION_HELP:
        read = DESTINATION_KEYS[key]
        default = defaults.get(key)
        if key == "url":
            shown = "required"
        elif key in ("secret", "secret_file", "secret_env"):
            shown = "one of the three, unless `unsigned = true`"
        elif default is None:
            shown = "none"
        else:
            shown = f"`{_shown(default)}`"
        env = f"`{DESTINATION_ENV_PREFIX}<NAME>_{key.upper()}`"
        file_key = "(environment only)" if key == "secret" else f"`{key}`"
        kind = {"text": "text", "number": "number", "count": "whole number"}.get(
            read.__name__, "true or false"
        )
        rows.append(
            f"| {file_key} | {env} | {kind} | {_cell(shown)} | {_cell(DESTINATION_HELP[key])} |"
        )
    return rows


def config_page() -> str:
    """docs/reference/config.md."""
    from outbox_cli import OPTIONS, build_parser
    from outbox_cli.settings import CONFIG_ENV, DB

    parser = build_parser()
    columns = "| flag | environment | config file | value | default | what |"
    rule = "| --- | --- | --- | --- | --- | --- |"
    out = [
        HEADER.format(command=REGENERATE),
        "# Configuration\n\n",
        "Each setting comes from, highest first: its flag, its `OUTBOX_*` environment "
        "variable, the TOML config file (`--config FILE` or `OUTBOX_CONFIG`), then its "
        "default. A bad value names where it came from. A key or table of the config file "
        "that no command reads is an error naming the nearest known one (``[worker]: unknown "
        "key `concurency` (did you mean `concurrency`?)``; `[destination.billing]` is named as "
        "a typo of `[destinations.billing]`), and so is an `OUTBOX_*` variable that no "
        "command reads: a typo never leaves a default silently in force. Every command "
        "checks the whole file, whichever part it reads. The defaults below are the ones "
        "the code uses.\n\n",
        "## Every command\n\n",
        f"{columns}\n{rule}\n",
        f"| `--db` (or `--url`) | `{DB.env}` | `{DB.key}` | database URL | `{DB.default}` "
        "| the database; `postgresql://` (psycopg 3) or `sqlite:///PATH` |\n",
        f"| `--config` | `{CONFIG_ENV}` | | path | none | TOML file with `db` and a table "
        "per command |\n",
    ]
    titles = {
        "worker": "`outbox worker` (`[worker]`)",
        "relay": "`outbox relay` (`[relay]`)",
        "receiver": "`outbox receiver` and `outbox receiver consume` (`[receiver]`)",
        "console": "`outbox console` (`[console]`)",
    }
    for command in OPTIONS:
        out.append(f"\n## {titles.get(command, command)}\n\n{columns}\n{rule}\n")
        out.extend(row + "\n" for row in _setting_rows(command, parser)[1:])
    out.append(
        "\n## Destinations (`[destinations.NAME]`)\n\n"
        "`outbox relay` delivers to the destinations of its config file and of the "
        "`OUTBOX_DESTINATION_<NAME>_<KEY>` variables, which win key by key (the name is "
        "lowercased; the key is the longest known one at the end).\n\n"
        "| config file | environment | value | default | what |\n"
        "| --- | --- | --- | --- | --- |\n"
    )
    out.extend(row + "\n" for row in destination_rows())
    return "".join(out)


def _command_parsers(
    parser: argparse.ArgumentParser, path: Sequence[str] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """(words after `outbox`, parser) for the command and every subcommand, depth first."""
    yield tuple(path), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                if child is parser:
                    continue
                yield from _command_parsers(child, (*path, name))


def commands_page() -> str:
    """docs/reference/commands.md."""
    from outbox_cli import build_parser

    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_WIDTH
    try:
        out = [
            HEADER.format(command=REGENERATE),
            "# Commands\n\n",
            "Every `outbox` command and its `--help`. Bad arguments print one line and exit 2; "
            "the exit statuses are listed under `outbox` below.\n",
        ]
        for path, parser in _command_parsers(build_parser()):
            title = " ".join(("outbox", *path))
            out.append(f"\n## `{title}`\n\n```text\n{parser.format_help().rstrip()}\n```\n")
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous
    return "".join(out)


def _registries() -> list[tuple[str, str, object]]:
    """(process, how to turn on, metrics object) of every process that serves /metrics."""
    from outbox.observability.worker_metrics import WorkerMetrics
    from receiver.metrics import ConsumerMetrics, ReceiverMetrics
    from relay.figures import DestinationFigures, Figures
    from relay.metrics import RelayMetrics

    def answered() -> object:
        return True

    worker = WorkerMetrics()
    worker.watch(answered, lambda: 0)
    receiver = ReceiverMetrics()
    receiver.watch(answered)
    consumer = ConsumerMetrics()
    consumer.watch(answered)
    figures = Figures({"billing": DestinationFigures()}, 0, None)
    return [
        ("`outbox relay`", "`--metrics-port N`", RelayMetrics(lambda: figures, ["billing"])),
        ("`outbox worker`", "`--metrics-port N`", worker),
        ("`outbox receiver`", "always, on its `--port`", receiver),
        ("`outbox receiver consume`", "`--metrics-port N`", consumer),
    ]


def _metric_rows(metrics: object) -> list[str]:
    """One row per metric family in `metrics.registry`, as Prometheus exposes it."""
    wrappers = {
        value._name: value
        for value in vars(metrics).values()
        if isinstance(value, MetricWrapperBase)
    }
    registry: CollectorRegistry = metrics.registry  # type: ignore[attr-defined]
    rows = []
    for family in registry.collect():
        wrapper = wrappers.get(family.name)
        if wrapper is not None:
            labels = list(wrapper._labelnames)
        else:
            labels = sorted({name for sample in family.samples for name in sample.labels})
        exposed = {
            "counter": f"`{family.name}_total`",
            "histogram": f"`{family.name}_bucket`, `_sum`, `_count`",
        }.get(family.type, f"`{family.name}`")
        shown_labels = ", ".join(f"`{label}`" for label in labels) or "none"
        rows.append(
            f"| {exposed} | {family.type} | {shown_labels} | {_cell(family.documentation)} |"
        )
    return rows


def metrics_page() -> str:
    """docs/reference/metrics.md."""
    out = [
        HEADER.format(command=REGENERATE),
        "# Metrics\n\n",
        "Every metric each process serves on `/metrics` (Prometheus text format), read "
        "from the registries the processes use. The endpoints, what the probes check and "
        "the log lines are in [Monitoring](../how-to/monitoring.md).\n",
    ]
    for process, switch, metrics in _registries():
        out.append(
            f"\n## {process}\n\nServed: {switch}.\n\n"
            "| metric | type | labels | what |\n| --- | --- | --- | --- |\n"
        )
        out.extend(row + "\n" for row in _metric_rows(metrics))
    return "".join(out)


PAGES: dict[str, Callable[[], str]] = {
    "config.md": config_page,
    "commands.md": commands_page,
    "metrics.md": metrics_page,
}


def stale_pages() -> list[Path]:
    """The committed reference pages that differ from what the code makes now."""
    return [
        REFERENCE / name
        for name, make in PAGES.items()
        if not (REFERENCE / name).exists()
        or (REFERENCE / name).read_text(encoding="utf-8") != make()
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Write the pages, or with --check report the stale ones; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m tools.docs_reference", description=__doc__)
    parser.add_argument("--check", action="store_true", help="only report stale pages")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_pages()
        for path in stale:
            sys.stderr.write(f"{path.relative_to(ROOT)} is out of date: run {REGENERATE}\n")
        return 1 if stale else 0
    for name, make in PAGES.items():
        (REFERENCE / name).write_text(make(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
