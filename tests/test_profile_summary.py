"""The profile summary in docs/explanation/performance.md: py-spy's samples summed per function."""

from __future__ import annotations

from pathlib import Path

from benchmarks.profiles import summarize


def test_samples_add_up_per_function_and_torn_lines_are_left_out(tmp_path: Path) -> None:
    raw = tmp_path / "samples.txt"
    raw.write_text(
        "run (loop.py:10);claim (leases.py:5) 3\n"
        "run (loop.py:10);settle (leases.py:9) 1\n"
        # A frame name read while it changed: its line break tears the sample in two, and
        # only the head, which has no count, can be told apart.
        "run (loop.py:10);bro\n"
        "ken (x.py:1) 2\n"
    )
    summary = summarize(raw)
    lines = summary.splitlines()
    assert lines[0].startswith("6 samples")
    assert lines[0].endswith(", 1 torn lines left out")
    assert lines[1:] == [
        " 66.7%  run (loop.py)",
        " 50.0%  claim (leases.py)",
        " 33.3%  ken (x.py)",
        " 16.7%  settle (leases.py)",
    ]
