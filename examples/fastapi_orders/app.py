"""The orders API: an order, its event and its fulfilment task commit together.

    ORDERS_DB=postgresql+asyncpg://app@db/orders \\
        uvicorn --factory examples.fastapi_orders.app:from_environment

``POST /orders`` answers 201 only after one transaction has stored the order, the
``order-<id>:created`` message (delivered by the relay) and the task that fulfils it
(run by ``outbox worker``): a crash leaves all three or none.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import sqlalchemy as sa
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

import outbox.asyncio
from examples.fastapi_orders import settings
from examples.fastapi_orders.schema import orders
from outbox import AuthContext, Envelope, TaskQueue


class NewOrder(BaseModel):
    """The body of POST /orders."""

    item: str = Field(min_length=1, max_length=200)
    quantity: int = Field(ge=1, le=1000)


class Order(BaseModel):
    """An order as the API shows it."""

    id: int
    item: str
    quantity: int
    status: str


def create_app(db_url: str) -> FastAPI:
    """The API on `db_url` (an async URL) once its outbox tables and orders table exist."""
    engine = create_async_engine(db_url, pool_size=5, max_overflow=5)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    # The queue holds the intake rules; receive_tx writes on the request's connection, so
    # its own pool stays idle. The app submits tasks only in its own name.
    queue = TaskQueue(
        db_url, allowed_sources=(settings.SOURCE,), reply_destination=settings.DESTINATION
    )
    itself = AuthContext(settings.SOURCE)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.dispose()
        queue.close()

    app = FastAPI(title="orders", lifespan=lifespan)

    @app.post("/orders", status_code=201)
    async def create_order(new: NewOrder) -> Order:
        """Store the order, publish order-<id>:created and submit its fulfilment, in one commit."""
        async with sessions() as session, session.begin():
            insert = sa.insert(orders).values(item=new.item, quantity=new.quantity)
            order_id = (await session.execute(insert.returning(orders.c.id))).scalar_one()
            await outbox.asyncio.publish(
                session,
                destination=settings.DESTINATION,
                reply_id=f"order-{order_id}:created",  # stable: a retry publishes nothing new
                body={"order_id": order_id, "item": new.item, "quantity": new.quantity},
            )
            fulfil = Envelope(
                message_id=f"order-{order_id}:fulfil",
                sender=settings.SOURCE,
                payload={"order_id": order_id},
                deadline=time.time() + settings.FULFIL_DEADLINE,
            )
            await outbox.asyncio.receive_tx(queue, session, itself, fulfil)
        return Order(id=order_id, item=new.item, quantity=new.quantity, status="created")

    @app.get("/orders/{order_id}")
    async def read_order(order_id: int) -> Order:
        """One order and its status: created, then fulfilled once its task is done."""
        async with sessions() as session:
            row = (await session.execute(sa.select(orders).where(orders.c.id == order_id))).first()
        if row is None:
            raise HTTPException(status_code=404, detail="no such order")
        return Order(id=row.id, item=row.item, quantity=row.quantity, status=row.status)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        """Up (the launcher waits for this before it says the stack is ready)."""
        return {"status": "ok"}

    return app


def from_environment() -> FastAPI:
    """The app for `uvicorn --factory`, on ORDERS_DB."""
    return create_app(settings.database_url())
