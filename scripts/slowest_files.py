"""The test files that took longest, from pytest's JUnit XML (scripts/test.sh prints it after
each shard, so that the suite's wall time can be followed file by file).

    python scripts/slowest_files.py REPORT.xml [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    per_file: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter[str] = collections.Counter()
    for case in ET.parse(args.report).getroot().iter("testcase"):
        # classname: "tests.test_x" or "tests.test_x.TestClass": the file is the test_ part.
        parts = case.get("classname", "?").split(".")
        name = next((x for x in parts if x.startswith("test_")), parts[0])
        per_file[name] += float(case.get("time", 0) or 0)
        counts[name] += 1
    total = sum(per_file.values())
    print(f"slowest test files (of {len(per_file)}, {total:.0f} s in all):")
    for name, secs in sorted(per_file.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {secs:7.1f} s  {counts[name]:3d} tests  {name}.py")


if __name__ == "__main__":
    main()
