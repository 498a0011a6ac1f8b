"""The drains compared with the bare relay deliver into a receiver that stores receipts only.

The bare receiver writes one row per reply and no effect; ours, in those drains,
must do the same work at the destination, or the comparison charges our relay
for the reference effect's second row.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from benchmarks.relay_bench import drain_backlog, prefill
from outbox.receiver_tables import effects, receipts

MESSAGES = 40


@pytest.mark.parametrize("reference_effect", [False, True], ids=["receipts-only", "effect"])
def test_the_receipts_only_receiver_stores_every_receipt_and_no_effect(
    pg_psycopg_url: str, reference_effect: bool
) -> None:
    # The drains compared with the bare relay run on PostgreSQL, on databases of their own.
    prefill(pg_psycopg_url, MESSAGES)
    result = drain_backlog(
        pg_psycopg_url, MESSAGES, "batch", 1, 1000, reference_effect=reference_effect
    )
    assert result["complete"], result
    engine = sa.create_engine(pg_psycopg_url)
    try:
        with engine.connect() as conn:
            stored = conn.execute(sa.select(sa.func.count()).select_from(receipts)).scalar_one()
            applied = conn.execute(sa.select(sa.func.count()).select_from(effects)).scalar_one()
    finally:
        engine.dispose()
    assert stored == MESSAGES
    assert applied == (MESSAGES if reference_effect else 0)
