"""The reference receiver storing receipts only: the destination of the drains and live
runs compared with the bare relay.

The bare receiver (benchmarks.bare_receiver) stores each reply and runs no effect, so
the comparison would otherwise charge our side a second row per message, the reference
effect's (a copy of the body), that the baseline never writes. This is `outbox
receiver` itself, the same application, checks and receipt store, with no effect.

Run as `outbox receiver` would be: python -m benchmarks.receipts_receiver receiver --db URL ...
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from outbox_cli import build_parser, command_options, own_process, receiver, settings


def main(argv: Sequence[str] | None = None) -> int:
    """Serve `outbox receiver`'s arguments without the reference effect."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.command != "receiver" or args.receiver_command is not None:
        raise SystemExit("usage: python -m benchmarks.receipts_receiver receiver --db URL ...")
    settings.resolve(args, command_options("receiver"))
    own_process.run_as_command()  # as `outbox receiver` run as its process's command
    return receiver.run(args, receipts_only=True)


if __name__ == "__main__":
    sys.exit(main())
