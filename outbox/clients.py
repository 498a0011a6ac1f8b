"""Optional client libraries: imported only where a broker is used, named when missing.

An HTTP-only relay or receiver never needs a broker client, so nats-py and aio-pika
are extras of the package; what needs one imports it through here and, without it,
gets a ConfigError that says which extra installs it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from outbox.errors import ConfigError

PACKAGE = "outbox-relay"


def optional_client(extra: str, needed_for: str, *modules: str) -> ModuleType:
    """Import `modules` (the first is returned); ConfigError naming `extra` when missing."""
    try:
        imported = [importlib.import_module(module) for module in modules]
    except ImportError:
        raise ConfigError(
            f"{needed_for} needs the {extra} client: pip install '{PACKAGE}[{extra}]'"
        ) from None
    return imported[0]
