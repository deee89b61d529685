"""Rewrite the token-dim quantizers' defaults in this (device) copy of the tree from the sweep's JSON."""
import json
import re
import sys
from pathlib import Path

best = json.loads(Path(sys.argv[1]).read_text())
for path, key in (("fp8/grouped.py", "grouped"), ("fp8/quant.py", "dense")):
    p = Path(path)
    s = p.read_text()
    for name, value in best.get(key, {}).items():
        s, n = re.subn(rf"^(    {name}: \w+ = )\S+", rf"\g<1>{value!r}", s, count=1, flags=re.M)
        assert n == 1, (path, name)
    p.write_text(s)
    print(path, best.get(key))
