"""The fulfilment task's handler, for ``outbox worker`` (async: one event loop, no threads).

    ORDERS_DB=postgresql+asyncpg://app@db/orders outbox worker --db $ORDERS_DB \\
        --handler examples.fastapi_orders.worker:fulfil --reply-destination orders

The handler finishes its own task: the order's new status, the task's `done`, its
result and its reply commit in one transaction, so the order is fulfilled exactly
when the task is done, never one without the other.
"""

from __future__ import annotations

import asyncio
import functools

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

import outbox.asyncio
from examples.fastapi_orders import settings
from examples.fastapi_orders.schema import orders
from outbox import Claim, TaskQueue

SHIPPING_SECONDS = 0.05
"""How long the simulated call to the shipping provider takes."""


@functools.cache
def _sessions() -> async_sessionmaker[AsyncSession]:
    # Made on first use, inside the worker's event loop, which asyncpg binds to.
    engine = create_async_engine(settings.database_url(), pool_size=5, max_overflow=5)
    return async_sessionmaker(engine, expire_on_commit=False)


@functools.cache
def _queue() -> TaskQueue:
    # Opened once, on first use (its schema check blocks the loop that once). The worker's
    # own queue writes replies to --reply-destination; this one must agree.
    return TaskQueue(settings.database_url(), reply_destination=settings.DESTINATION)


async def ship(order_id: int) -> None:
    """The call to the shipping provider, simulated."""
    # A real one is idempotent by order id: an attempt that failed, or whose worker
    # died, runs again.
    await asyncio.sleep(SHIPPING_SECONDS)


async def fulfil(claim: Claim, stop: asyncio.Event) -> None:
    """Ship the order, then mark it fulfilled and finish the task in one transaction."""
    order_id = int(claim.payload["order_id"])
    await ship(order_id)
    # If the lease was lost meanwhile (`stop` is set), finish_tx raises Fenced and the
    # status update rolls back with it: the task's new holder fulfils the order instead.
    async with _sessions()() as session, session.begin():
        await session.execute(
            sa.update(orders).where(orders.c.id == order_id).values(status="fulfilled")
        )
        result = {"order_id": order_id, "status": "fulfilled"}
        await outbox.asyncio.finish_tx(_queue(), session, claim, result)
    # Done under this claim already: the worker counts it, so there is nothing to return.
