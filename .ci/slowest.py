"""Print the N slowest tests of pytest JUnit XML reports (CI's closing table)."""

import sys
import xml.etree.ElementTree as ET

n, files = int(sys.argv[1]), sys.argv[2:]
rows = []
for f in files:
    try:
        root = ET.parse(f).getroot()
    except (OSError, ET.ParseError) as e:
        print(f"slowest: cannot read {f}: {e}")
        continue
    for case in root.iter("testcase"):
        rows.append((float(case.get("time", 0)), f"{case.get('classname')}::{case.get('name')}"))
rows.sort(reverse=True)
print(f"The {min(n, len(rows))} slowest of {len(rows)} tests:")
for seconds, name in rows[:n]:
    print(f"{seconds:8.1f} s  {name}")
