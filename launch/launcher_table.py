"""Print the launcher tests' result rows (one JSON object per line of FILE) as a Markdown table.

python launch/launcher_table.py FILE  (launcher_matrix.sh and multihost.sh, after their tests)
"""

import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print("| launcher | transport | dtype | ranks | largest loss difference | largest parameter difference |")
print("|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['launcher']} | {r['transport']} | {r['dtype']} | {r['ranks']} | {r['loss']:.2g} | {r['param']:.2g} |")
