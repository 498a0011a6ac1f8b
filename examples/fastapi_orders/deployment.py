"""The example as it is deployed: its databases, its four processes and what they share.

The commands are those of a real deployment (uvicorn, `outbox worker`, `outbox relay`,
`outbox receiver`), run with this interpreter so they use the code beside this file.
"""

from __future__ import annotations

import base64
import os
import re
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy as sa

import outbox
import receiver
from examples.fastapi_orders import settings
from examples.fastapi_orders.schema import create_tables

ROOT = Path(__file__).resolve().parents[2]
"""Where the processes run: `examples` is imported from there."""
RELAY_CONFIG = Path(__file__).with_name("relay.toml")
SECRET_ENV = "ORDERS_WEBHOOK_SECRET"  # noqa: S105 (the name of a variable)
PORT_ENV, RECEIVER_PORT_ENV = "ORDERS_PORT", "ORDERS_RECEIVER_PORT"
HANDLER = "examples.fastapi_orders.worker:fulfil"


def new_secret() -> str:
    """A fresh Standard Webhooks signing secret."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


@dataclass(frozen=True)
class Plan:
    """Where the example runs: its two databases, its two ports and the webhook secret."""

    db_url: str
    receiver_db_url: str
    app_port: int = 8000
    receiver_port: int = 8001
    secret: str = field(default_factory=new_secret, repr=False)

    @classmethod
    def from_environment(cls) -> Plan:
        """The plan the ORDERS_* variables describe; a new secret unless one is given."""
        return cls(
            db_url=settings.database_url(),
            receiver_db_url=settings.receiver_database_url(),
            app_port=int(os.environ.get(PORT_ENV) or 8000),
            receiver_port=int(os.environ.get(RECEIVER_PORT_ENV) or 8001),
            secret=os.environ.get(SECRET_ENV) or new_secret(),
        )

    @property
    def app_base(self) -> str:
        """The orders API's base URL."""
        return f"http://127.0.0.1:{self.app_port}"

    @property
    def receiver_base(self) -> str:
        """The receiver's base URL."""
        return f"http://127.0.0.1:{self.receiver_port}"


def ensure_database(url: str) -> None:
    """Create the database `url` names, on its server, unless it exists."""
    parsed = sa.make_url(url)
    name = parsed.database or ""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,62}", name):
        raise ValueError(f"database name {name!r}: letters, digits and _ only")
    # The maintenance database, to create the other one from.
    admin = outbox.create_engine(parsed.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            found = conn.execute(
                sa.text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": name}
            ).first()
            if found is None:
                conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    finally:
        admin.dispose()


def prepare(plan: Plan) -> None:
    """Create both databases if missing, and bring their tables up to date."""
    ensure_database(plan.db_url)
    ensure_database(plan.receiver_db_url)
    outbox.upgrade(plan.db_url)
    create_tables(plan.db_url)
    receiver.upgrade(plan.receiver_db_url)


@dataclass(frozen=True)
class Service:
    """One process of the deployment: its command, what it adds to the environment, and
    the URL that answers 200 once it serves (None for those that serve nothing)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    health: str | None = None


def services(plan: Plan) -> dict[str, Service]:
    """The four processes, in the order they start."""
    command = [sys.executable, "-m", "outbox_cli"]
    service_db = {settings.DB_ENV: plan.db_url}
    listing = [
        Service(
            "receiver",
            [*command, "receiver", "--db", plan.receiver_db_url, "--port", str(plan.receiver_port)],
            # The receiver verifies with the secret the relay signs with.
            {"OUTBOX_RECEIVER_SECRETS": plan.secret},
            f"{plan.receiver_base}/healthz",
        ),
        Service(
            "relay",
            [*command, "relay", "--db", plan.db_url, "--config", str(RELAY_CONFIG)],
            {
                SECRET_ENV: plan.secret,
                "OUTBOX_DESTINATION_ORDERS_URL": f"{plan.receiver_base}/replies",
            },
        ),
        Service(
            "worker",
            [
                *command,
                *("worker", "--db", plan.db_url, "--handler", HANDLER),
                # Async handlers: 20 at once cost no threads. NOTIFY wakes it for new tasks.
                *("--reply-destination", settings.DESTINATION, "--concurrency", "20"),
            ],
            service_db,
        ),
        Service(
            "app",
            [
                *(sys.executable, "-m", "uvicorn", "examples.fastapi_orders.app:from_environment"),
                *("--factory", "--host", "127.0.0.1", "--port", str(plan.app_port)),
                "--no-access-log",
            ],
            service_db,
            f"{plan.app_base}/healthz",
        ),
    ]
    return {service.name: service for service in listing}
