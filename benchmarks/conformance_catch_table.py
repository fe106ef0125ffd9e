"""The catch table of the planted kernel bugs (refmath.conformance.bugs): for each bug, how many of
the default sweep's applicable cases catch it, and the first catch's reason. The table on the
"For kernel engineers" documentation page is this script's output.

    python benchmarks/conformance_catch_table.py            # the default sweep, about a minute
    python benchmarks/conformance_catch_table.py --quick    # the quick sweep

Prints a Markdown table; exits 1 if some bug is caught by no case.
"""
from __future__ import annotations

import sys
import time

from refmath.conformance.bugs import catch_table


def main(quick: bool) -> int:
    start = time.perf_counter()
    rows = catch_table(quick=quick)
    print("| planted bug | adapter | caught by | first catch |")
    print("|---|---|---|---|")
    for row in rows:
        first = f"`{row['caught_by'][0]}`: {row['first_reason'][:80]}" if row["caught"] else "NOT CAUGHT"
        print(f"| {row['bug']} | {row['adapter']} | {row['caught']} of {row['ran']} | {first} |")
    missed = [row["bug"] for row in rows if not row["caught"]]
    print(f"\n{len(rows) - len(missed)} of {len(rows)} bugs caught by the "
          f"{'quick' if quick else 'default'} sweep in {time.perf_counter() - start:.0f} s")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main("--quick" in sys.argv[1:]))
