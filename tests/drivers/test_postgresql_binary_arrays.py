"""Binary array parameters written whole (outbox.drivers.postgresql.binary_arrays) read back
as PostgreSQL's own arrays of their element type, every edge value and the empty array."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import sqlalchemy as sa

from outbox.drivers.postgresql.binary_arrays import (
    BigInts,
    Floats,
    Integers,
    Numbers,
    dumping_numbers,
)

CASES: list[tuple[type[Numbers], list[float], str]] = [
    (BigInts, [0, 1, -1, 2**63 - 1, -(2**63), 12_345_678_901], "bigint[]"),
    (Integers, [0, 1, -1, 2**31 - 1, -(2**31), 65_536], "integer[]"),
    (Floats, [0.0, -0.0, 0.1, -1.5, 1e300, 5e-324, float("inf"), float("-inf")], "float8[]"),
]


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
@pytest.mark.parametrize(("numbers", "values", "cast"), CASES)
def test_numbers_read_back_as_the_arrays_given(
    engine: sa.Engine, numbers: type[Numbers], values: list[float], cast: str
) -> None:
    many = [random.choice(values) for _ in range(1_000)]
    with engine.connect() as conn:
        dumping_numbers(conn)
        for given in (values, many, []):
            read = conn.exec_driver_sql(f"SELECT CAST(%(a)b AS {cast})", {"a": numbers(given)})
            assert read.scalar_one() == given


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_each_is_sent_as_its_element_types_array(engine: sa.Engine) -> None:
    given = {"b": BigInts([1]), "i": Integers([1]), "f": Floats([1.0])}
    with engine.connect() as conn:
        dumping_numbers(conn)
        typed = conn.exec_driver_sql(
            "SELECT pg_typeof(%(b)b)::text, pg_typeof(%(i)b)::text, pg_typeof(%(f)b)::text", given
        ).one()
    assert tuple(typed) == ("bigint[]", "integer[]", "double precision[]")


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_an_engine_made_before_the_import_dumps_them_once_prepared(db_url: str) -> None:
    # SQLAlchemy copies psycopg's adapters when it makes an engine: registered globally
    # after that, the settle's arrays could not be dumped on it.
    script = (
        "import sys, sqlalchemy as sa\n"
        "engine = sa.create_engine(sys.argv[1].replace('postgresql:', 'postgresql+psycopg:', 1))\n"
        "from outbox.drivers.postgresql.binary_arrays import BigInts, dumping_numbers\n"
        "with engine.connect() as conn:\n"
        "    dumping_numbers(conn)\n"
        "    print(conn.exec_driver_sql('SELECT CAST(%(a)b AS bigint[])', {'a': BigInts([7])})"
        ".scalar_one())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, db_url], capture_output=True, text=True, check=False
    )
    assert (done.returncode, done.stdout.strip()) == (0, "[7]"), done.stderr
