"""What the installed distribution holds: every module imports, from where it should.

Every module must import with no extra installed: the extras only make things faster or
bring a broker client, which the modules needing one import when used (outbox.clients).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import pkgutil
import traceback
from collections.abc import Callable
from pathlib import Path
from subprocess import CompletedProcess

import pytest

import outbox
import outbox_cli
import receiver
import relay
from outbox.clients import optional_client
from outbox.errors import ConfigError

PACKAGES = (outbox, relay, receiver, outbox_cli)
DISTRIBUTION = "outbox-relay"


def all_modules() -> list[str]:
    """The dotted name of every module and subpackage of outbox, relay, receiver and
    outbox_cli, but `__main__` modules, which run the command when imported."""
    names = []
    for package in PACKAGES:
        names.append(package.__name__)
        for found in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + "."):
            if not found.name.endswith(".__main__"):
                names.append(found.name)
    return sorted(names)


def test_the_packages_come_from_the_copy_under_test(expected_home: Path) -> None:
    for package in PACKAGES:
        assert Path(package.__file__ or "").resolve().is_relative_to(expected_home), (
            f"{package.__name__} imported from {package.__file__}, not from {expected_home}"
        )


# Modules that exist only to adapt an extra's package, imported only when it is installed
# (receiver.protocol picks the parser): the module each one needs.
ADAPTERS = {"receiver.protocol_httptools": "httptools"}


def test_every_module_imports() -> None:
    names = all_modules()
    # A walk that found nothing would pass below: these stand for each layer and the data.
    assert {"outbox_cli.console.app", "relay.transports.nats", "receiver.protocol"} <= set(names)
    assert set(ADAPTERS) <= set(names), "an adapter listed here no longer exists"
    failed = {}
    for name in names:
        needs = ADAPTERS.get(name)
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # Without its extra an adapter may fail for that one missing module, no other.
            if needs is None or importlib.util.find_spec(needs) is not None or exc.name != needs:
                failed[name] = traceback.format_exc(limit=-3)
        except Exception:
            failed[name] = traceback.format_exc(limit=-3)
    assert not failed, "\n".join(f"{name}:\n{error}" for name, error in failed.items())


def test_each_package_says_it_is_typed() -> None:
    for package in PACKAGES:
        assert (Path(package.__file__ or "").parent / "py.typed").is_file(), package.__name__


@pytest.mark.parametrize(
    ("extra", "client"), [("nats", "nats"), ("rabbitmq", "aio_pika")], ids=["nats", "rabbitmq"]
)
def test_a_broker_client_is_there_or_named_by_its_extra(extra: str, client: str) -> None:
    if importlib.util.find_spec(client) is not None:
        assert optional_client(extra, "this", client).__name__ == client
    else:
        with pytest.raises(ConfigError, match=rf"pip install '{DISTRIBUTION}\[{extra}\]'"):
            optional_client(extra, "this", client)


def test_version_is_the_distributions_and_the_command_prints_it(
    command: Callable[..., CompletedProcess[str]],
) -> None:
    installed = importlib.metadata.version(DISTRIBUTION)
    assert outbox.__version__ == installed
    done = command("--version")
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{DISTRIBUTION} {installed}\n", "")
