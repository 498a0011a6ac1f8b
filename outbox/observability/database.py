"""The `<process>_database_up` gauge: whether the database answered a scrape's read in time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


class DatabaseUp(Collector):
    """A gauge read at scrape time: 1 when `answered()` says the database answered, else 0."""

    def __init__(self, name: str, answered: Callable[[], object | None]) -> None:
        """`answered` is a Probe (or any read that gives None when the database is down)."""
        self.name = name
        self._answered = answered

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """The gauge, from a read with a deadline."""
        yield GaugeMetricFamily(
            self.name,
            "1 when the database answered this scrape's read in time, else 0.",
            value=0 if self._answered() is None else 1,
        )
