"""The slow suite's file order, derived from a recorded run (never hand-kept).

    scripts/test.sh 2>&1 | tee test.log
    .venv/bin/python scripts/slow_order.py test.log --run "21d045e, fresh-clone CI, 2026-11-28"

reads the last ``slowest N durations`` block of a pytest log (``scripts/test.sh`` runs the slow suite last, with
``--durations=40``), or every test case of a JUnit XML file (``--junitxml``), adds up each file's setup, call and
teardown seconds, and writes them, longest first, to ``tests/data/slow_durations.json``. ``tests/conftest.py`` runs
the slow files in that order so that the pytest-xdist workers end together; a file the run did not record goes
after them. A file named by its old path (before the tests moved into folders) is found by its name under
``tests/``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "slow_durations.json"
HEADER = re.compile(r"^=+ slowest (\d+ )?durations =+$")
LINE = re.compile(r"^(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S+?\.py)::")


def from_log(text: str) -> list[tuple[str, float]]:
    """``(file, seconds)`` of each line of the log's last durations block."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if HEADER.match(line.strip())]
    if not starts:
        raise SystemExit("no 'slowest durations' block in the log: run pytest with --durations=N")
    found = []
    for line in lines[starts[-1] + 1:]:
        if line.startswith("="):  # the next block: the summary
            break
        match = LINE.match(line.strip())
        if match:
            found.append((match.group(3), float(match.group(1))))
    return found


def from_junit(text: str) -> list[tuple[str, float]]:
    """``(file, seconds)`` of each test case of a JUnit XML report (its ``classname`` is the module's dotted path)."""
    cases = ET.fromstring(text).iter("testcase")
    return [(case.get("classname", "").replace(".", "/") + ".py", float(case.get("time", 0))) for case in cases]


def where(logged: str) -> str:
    """The file's path today, relative to the repository (an old flat path found by its name under tests/)."""
    if (ROOT / logged).is_file():
        return logged
    found = sorted((ROOT / "tests").rglob(Path(logged).name))
    if len(found) != 1:
        raise SystemExit(f"{logged}: {len(found)} files of that name under tests/; expected exactly one")
    return str(found[0].relative_to(ROOT))


def per_file(rows: list[tuple[str, float]]) -> dict[str, float]:
    """Each file's seconds added up, longest first (ties by path)."""
    total: dict[str, float] = defaultdict(float)
    for logged, seconds in rows:
        total[where(logged)] += seconds
    return {f: round(s, 2) for f, s in sorted(total.items(), key=lambda item: (-item[1], item[0]))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/slow_order.py", description=__doc__.split("\n\n")[0])
    p.add_argument("report", type=Path, help="a pytest log with --durations output, or a --junitxml file (.xml)")
    p.add_argument("--run", required=True, help="which run it was (commit, machine, date), kept in the file")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    text = args.report.read_text()
    rows = from_junit(text) if args.report.suffix == ".xml" else from_log(text)
    if not rows:
        raise SystemExit(f"{args.report}: no test durations in it")
    seconds = per_file(rows)
    args.out.write_text(json.dumps({"run": args.run, "seconds": seconds}, indent=1) + "\n")
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}: {len(seconds)} "
          f"files, longest {next(iter(seconds))} ({next(iter(seconds.values())):.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
