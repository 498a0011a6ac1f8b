"""The OUTBOX_* environment: a variable no command reads is refused, so a typo is not ignored.

A setting's variable names the command it belongs to (OUTBOX_RELAY_BATCH), and a shared
environment file for several sidecars is normal, so any command's settings are known
to every command. The project's own tests and benchmarks read variables of another
prefix (OUTBOXDEV_), outside the product's namespace.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from outbox.errors import ConfigError
from outbox.unknown_keys import did_you_mean
from outbox_cli.settings import load
from relay.config import DESTINATION_ENV_PREFIX, destination_variable, referenced_variables

PREFIX = "OUTBOX_"


def check_environment(
    environ: Mapping[str, str], known: Iterable[str], config: str | None = None
) -> None:
    """Refuse any OUTBOX_* variable that is not `known`, a destination's, one the `config`
    file names as a secret source."""
    names = set(known)
    if config:
        names |= referenced_variables(load(config))
    # A destination defined in the environment may name its secret's variable too.
    for variable, value in environ.items():
        named = destination_variable(variable)
        if named is not None and named[1] == "secret_env":
            names.add(value)
    for variable in sorted(environ):
        if not variable.startswith(PREFIX) or variable in names:
            continue
        if variable.startswith(DESTINATION_ENV_PREFIX) and destination_variable(variable):
            continue
        close = did_you_mean(variable, names)
        hint = f" (did you mean {close}?)" if close else ""
        raise ConfigError(
            f"unknown environment variable {variable}{hint}; the commands read only the "
            f"variables their --help lists and {DESTINATION_ENV_PREFIX}<NAME>_<KEY>"
        )
