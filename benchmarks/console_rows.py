"""The benchmark suite's console rows alone, for a change to the console between full runs.

Run: .venv/bin/python -m benchmarks.console_rows [--runs 3] [--large-runs 1] [--quick]

The same measurements and rows as the suite's (benchmarks.suite.console_rows), printed as
the suite prints its table, then each run's page medians.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import console_pages
from benchmarks.suite import console_rows, render, repeat


def main(argv: list[str] | None = None) -> int:
    """Measure the console's rows and print them."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.console_rows")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--large-runs", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    args = parser.parse_args(argv)
    pages = repeat("console pages", args.runs, lambda: console_pages.run(args.quick))
    large = repeat(
        "console overview, large", args.large_runs, lambda: console_pages.run_large(args.quick)
    )
    print(render(console_rows(pages, large, args.quick)))
    for run in pages:
        print({name: value for name, value in run.items() if name.endswith("_median_ms")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
