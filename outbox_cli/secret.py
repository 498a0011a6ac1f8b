"""`outbox secret new`: a fresh Standard Webhooks signing secret, one line on stdout.

The secret is `whsec_` and the base64 of 32 random bytes from the operating system's
CSPRNG: a 256-bit key for HMAC-SHA256, twice the 16 bytes `outbox.signing` requires.
It goes to stdout alone, so it can be piped straight into a file or a secret store.
"""

from __future__ import annotations

import argparse
import base64
import secrets
from typing import Any

from outbox.signing import SECRET_PREFIX

SECRET_BYTES = 32


def add_parser(commands: Any) -> None:
    """Register `outbox secret new`."""
    parser = commands.add_parser("secret", help="make webhook signing secrets")
    actions = parser.add_subparsers(dest="secret_command", required=True)
    actions.add_parser(
        "new",
        help=f"print a fresh {SECRET_PREFIX} secret ({SECRET_BYTES} random bytes)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def new_secret() -> str:
    """A fresh `whsec_<base64>` secret of SECRET_BYTES random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode("ascii")


def run(args: argparse.Namespace) -> int:
    """Print a new secret; returns the exit status."""
    print(new_secret())
    return 0
