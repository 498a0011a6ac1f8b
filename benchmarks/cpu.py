"""CPU time spent while a benchmark runs: the whole machine's, and one server process's.

A drain's rate says how fast; CPU per message says where the two cores went,
which is what decides the rate on a machine the relays share with PostgreSQL
and the broker. Read from Linux's /proc (the benchmarks run on Linux).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent busy (user, nice, system, irq, softirq) since boot."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in fields[1:8])
    return (user + nice + system + irq + softirq) / TICKS_PER_SECOND


def _processes() -> Iterator[tuple[int, str, int, float]]:
    """(pid, name, parent pid, CPU seconds used so far) of every process now running."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # it ended while being listed
        # The command name in parentheses may hold spaces: the fields follow the last ")".
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        rest = stat[stat.rindex(")") + 2 :].split()
        cpu = (int(rest[11]) + int(rest[12])) / TICKS_PER_SECOND  # utime, stime: 14 and 15
        yield int(entry.name), name, int(rest[1]), cpu  # the parent pid: field 4


def process_cpu_seconds(command: str) -> dict[int, float]:
    """CPU seconds (user and system) used so far by each process named `command`, by pid."""
    return {pid: cpu for pid, name, _, cpu in _processes() if name == command}


def cpu_between(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two readings by the processes alive at both: one that
    started or ended meanwhile (a test's own server, say) would count its whole life."""
    return sum(after[pid] - before[pid] for pid in before.keys() & after.keys())


def _tree(pid: int, stats: dict[int, tuple[int, float]]) -> set[int]:
    """`pid` and its descendants among `stats` (pid -> (parent pid, CPU seconds))."""
    tree = {pid}
    grew = True
    while grew:
        grew = False
        for child, (parent, _) in stats.items():
            if parent in tree and child not in tree:
                tree.add(child)
                grew = True
    return tree


def process_tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user and system) used so far by process `pid` and its live descendants."""
    stats = {child: (parent, cpu) for child, _, parent, cpu in _processes()}
    return sum(stats[p][1] for p in _tree(pid, stats) if p in stats)


def _argv(pid: int) -> str:
    """A process's command line, arguments joined by spaces ('' once it has ended)."""
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def port_owners(pids: set[int]) -> dict[int, int]:
    """Local TCP port -> the pid among `pids` holding that socket."""
    inode_pid: dict[str, int] = {}
    for pid in pids:
        try:
            links = [os.readlink(fd) for fd in (Path("/proc") / str(pid) / "fd").iterdir()]
        except OSError:
            continue  # ended, or an fd closed while listed
        for link in links:
            if link.startswith("socket:["):
                inode_pid[link[8:-1]] = pid
    owners: dict[int, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            # local_address is HEXADDR:HEXPORT; the socket's inode is the tenth field.
            owner = inode_pid.get(fields[9])
            if owner is not None:
                owners[int(fields[1].rsplit(":", 1)[1], 16)] = owner
    return owners


PartSeconds = dict[int, tuple[str, float]]
"""A reading of part_cpu_seconds: pid -> (its part, CPU seconds it used so far)."""


def part_cpu_seconds(
    part_of: Callable[[str], str | None], backends: Iterable[tuple[int, int]]
) -> PartSeconds:
    """CPU seconds used so far by this process's descendants and by the database backends
    serving them, each with its part (parts_between sums two readings' difference).

    `part_of` names the part of a descendant from its command line (None: not counted);
    `backends` are the database's client backends as (backend pid, client port): a
    backend counts as part `<part>_db` of the descendant holding its client socket.
    """
    stats = {pid: (parent, cpu) for pid, _, parent, cpu in _processes()}
    parts = {pid: part_of(_argv(pid)) for pid in _tree(os.getpid(), stats) - {os.getpid()}}
    owners = port_owners({pid for pid, part in parts.items() if part is not None})
    reading: PartSeconds = {}
    for pid, part in parts.items():
        if part is not None and pid in stats:
            reading[pid] = (part, stats[pid][1])
    for backend, port in backends:
        owner = owners.get(port)
        part = parts.get(owner) if owner is not None else None
        if part is not None and backend in stats:
            reading[backend] = (f"{part}_db", stats[backend][1])
    return reading


def parts_between(before: PartSeconds, after: PartSeconds) -> dict[str, float]:
    """CPU seconds each part spent between two readings: a process in both counts its
    difference, one that started meanwhile its whole life, one that ended meanwhile
    nothing (its last figures are gone with it: an understatement, never a negative)."""
    spent: dict[str, float] = {}
    for pid, (part, seconds) in after.items():
        earlier = before.get(pid)
        start = earlier[1] if earlier is not None and earlier[0] == part else 0.0
        spent[part] = spent.get(part, 0.0) + seconds - start
    return spent
