"""Arrays of fixed-width numbers as binary parameters, written whole rather than item by item.

psycopg's list dumper writes each element of a binary array in Python: about a quarter
of a millisecond per 1,000 numbers, and the relay's settle sends four such arrays per
turn. PostgreSQL's binary array is a header, then each element as its length and its
big-endian bytes: from the numbers' machine bytes that is a byte swap and a few strided
copies, all in C. A statement takes one as `CAST(%(name)b AS bigint[])` and the like, on
a connection dumping_numbers() has prepared.
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Iterable, Iterator
from typing import ClassVar

from psycopg import postgres
from psycopg.adapt import Dumper
from psycopg.pq import Format
from sqlalchemy.engine import Connection

_HEAD = struct.Struct(">iiI")  # dimensions, has nulls, element type
_DIMENSION = struct.Struct(">ii")  # length, lower bound


class Numbers:
    """Numbers sent as one binary array parameter of the subclass's element type."""

    typecode: ClassVar[str]
    """The `array` module's type code, whose item size is the element type's."""
    element: ClassVar[str]
    """PostgreSQL's element type."""
    __slots__ = ("values",)

    def __init__(self, values: Iterable[float]) -> None:
        """The numbers, in order (each must fit the element type)."""
        self.values = array.array(self.typecode, values)

    def __iter__(self) -> Iterator[float]:
        """The numbers, in order."""
        return iter(self.values)


class BigInts(Numbers):
    """A bigint[] parameter."""

    typecode = "q"
    element = "int8"


class Integers(Numbers):
    """An integer[] parameter."""

    typecode = "i"
    element = "int4"


class Floats(Numbers):
    """A float8[] parameter."""

    typecode = "d"
    element = "float8"


def binary_array(values: array.array[int] | array.array[float], element_oid: int) -> bytes:
    """`values` in PostgreSQL's binary array format, one dimension, no nulls."""
    count = len(values)
    if not count:
        return _HEAD.pack(0, 0, element_oid)
    width = values.itemsize
    swapped = array.array(values.typecode, values)
    if sys.byteorder == "little":
        swapped.byteswap()
    data = swapped.tobytes()
    step = 4 + width
    elements = bytearray(step * count)
    # Each element's length is `width`, whose three high bytes are zero.
    elements[3::step] = bytes((width,)) * count
    for byte in range(width):
        elements[4 + byte :: step] = data[byte::width]
    return _HEAD.pack(1, 0, element_oid) + _DIMENSION.pack(count, 1) + bytes(elements)


def _dumper(numbers: type[Numbers]) -> type[Dumper]:
    """A binary dumper of `numbers` as an array of its element type."""
    info = postgres.types[numbers.element]

    class NumbersDumper(Dumper):
        format = Format.BINARY
        oid = info.array_oid

        def dump(self, obj: Numbers) -> bytes:
            return binary_array(obj.values, info.oid)

    return NumbersDumper


_DUMPERS = [(numbers, _dumper(numbers)) for numbers in (BigInts, Integers, Floats)]
_REGISTERED = "outbox.binary_arrays"
"""Key in a pooled connection's info once the dumpers are on its psycopg connection."""


def dumping_numbers(conn: Connection) -> None:
    """Let `conn`'s psycopg connection dump Numbers: an engine made before this module was
    imported copied psycopg's global adapters without them, so they go on each connection."""
    info = conn.connection.info
    if not info.get(_REGISTERED):
        adapters = conn.connection.dbapi_connection.adapters  # type: ignore[union-attr]
        for numbers, dumper in _DUMPERS:
            adapters.register_dumper(numbers, dumper)
        info[_REGISTERED] = True
