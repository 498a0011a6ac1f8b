"""`python -m examples.fastapi_orders`: the orders service with its worker, its relay
sidecar and the reference receiver, on the local PostgreSQL, until Ctrl-C or SIGTERM."""

from __future__ import annotations

import signal
import sys
import threading

import sqlalchemy as sa

from examples.fastapi_orders import settings
from examples.fastapi_orders.deployment import HANDLER, Plan, prepare
from examples.fastapi_orders.processes import Stack, StartFailed


def shown(url: str) -> str:
    """A database URL without its password."""
    return sa.make_url(url).render_as_string(hide_password=True)


def describe(plan: Plan, stack: Stack) -> str:
    """Where each process listens, or what it does, with its pid."""
    pid = {name: process.pid for name, process in stack.processes.items()}
    return "\n".join(
        [
            f"orders API  {plan.app_base}  POST /orders, GET /orders/ID  (pid {pid['app']})",
            f"receiver    {plan.receiver_base}  POST /replies/batch  (pid {pid['receiver']})",
            f"relay       delivers '{settings.DESTINATION}' to the receiver  (pid {pid['relay']})",
            f"worker      runs {HANDLER}  (pid {pid['worker']})",
            f"databases   {shown(plan.db_url)}, {shown(plan.receiver_db_url)}",
            f"try:  curl -X POST {plan.app_base}/orders -H 'content-type: application/json' "
            """-d '{"item": "book", "quantity": 2}'""",
        ]
    )


def main() -> int:
    """Prepare the databases, run the four processes, and stop them on a signal."""
    plan = Plan.from_environment()
    stopping = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopping.set())
    try:
        prepare(plan)
    except sa.exc.OperationalError as exc:
        print(
            f"cannot prepare {shown(plan.db_url)}: {exc.orig}\n"
            f"(is PostgreSQL running? {settings.DB_ENV} names the database)",
            file=sys.stderr,
        )
        return 2
    try:
        with Stack(plan) as stack:
            print(describe(plan, stack))
            print("Ctrl-C stops them all.", flush=True)
            while not stopping.wait(0.5):
                gone = stack.exited()
                if gone is not None:
                    code = stack.processes[gone].returncode
                    print(f"{gone} exited with status {code}: stopping the others", file=sys.stderr)
                    return 1
    except StartFailed as exc:
        print(f"could not start: {exc}", file=sys.stderr)
        return 1
    print("stopped: " + ", ".join(f"{n} {c}" for n, c in stack.exit_codes.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
