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
from tests.conftest import upgrade_all

MESSAGES = 40


@pytest.mark.parametrize("reference_effect", [False, True], ids=["receipts-only", "effect"])
def test_the_receipts_only_receiver_stores_every_receipt_and_no_effect(
    pg_blank_url: str, reference_effect: bool
) -> None:
    # The drains compared with the bare relay run on PostgreSQL, on databases of their own.
    url = sa.make_url(pg_blank_url).set(drivername="postgresql+psycopg").render_as_string(False)
    upgrade_all(url)
    prefill(url, MESSAGES)
    result = drain_backlog(url, MESSAGES, "batch", 1, 1000, reference_effect=reference_effect)
    assert result["complete"], result
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            stored = conn.execute(sa.select(sa.func.count()).select_from(receipts)).scalar_one()
            applied = conn.execute(sa.select(sa.func.count()).select_from(effects)).scalar_one()
    finally:
        engine.dispose()
    assert stored == MESSAGES
    assert applied == (MESSAGES if reference_effect else 0)
