#!/usr/bin/env python3
"""The second stage's cost to one stream from gpu-session.sh's c1spin runs.

Each c1spin_<spin>_<round>.json holds one 1x1 and one 1x2 run at c=1, in
turn (spin -1 is --spin-us auto, printed as "auto").  Per round the cost
is 1 - tok/s(1x2) / tok/s(1x1), and again by ITL p50 (ITL(1x2) / ITL(1x1)
- 1); printed per round and as the median over the rounds of each
--spin-us, since a single run of a few thousand tokens swings by several
percent when the host disturbs it.

  scripts/c1-cost.py OUT_DIR
"""
import glob
import json
import os
import re
import statistics
import sys


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    by_spin = {}
    for path in sorted(glob.glob(os.path.join(sys.argv[1], "c1spin_*_*.json"))):
        m = re.search(r"c1spin_(-1|\d+)_(\d+)\.json$", path)
        if not m:
            continue
        try:
            with open(path) as f:
                rows = {r["layout"]: r for r in json.load(f).get("rows", []) if r.get("ran")}
        except (OSError, ValueError) as e:
            print("%s: %s" % (path, e), file=sys.stderr)
            continue
        one, two = rows.get("1x1"), rows.get("1x2")
        if not one or not two or not one.get("tok_s") or not one.get("itl_p50_ms"):
            print("%s: no 1x1 and 1x2 pair" % path, file=sys.stderr)
            continue
        tok = 100.0 * (1.0 - two["tok_s"] / one["tok_s"])
        itl = 100.0 * (two["itl_p50_ms"] / one["itl_p50_ms"] - 1.0)
        by_spin.setdefault(int(m.group(1)), []).append((int(m.group(2)), one, two, tok, itl))
    if not by_spin:
        print("no c1spin runs in %s" % sys.argv[1], file=sys.stderr)
        return 1
    for spin in sorted(by_spin):
        rounds = sorted(by_spin[spin], key=lambda r: r[0])
        name = "auto" if spin < 0 else str(spin)
        for n, one, two, tok, itl in rounds:
            print("--spin-us %-5s round %d: 1x1 %.1f tok/s (ITL p50 %.2f ms), 1x2 %.1f (%.2f): cost %.1f%% by tok/s, "
                  "%.1f%% by ITL p50" % (name, n, one["tok_s"], one["itl_p50_ms"], two["tok_s"], two["itl_p50_ms"],
                                         tok, itl))
        print("--spin-us %-5s median of %d rounds: %.1f%% by tok/s, %.1f%% by ITL p50" %
              (name, len(rounds), statistics.median(r[3] for r in rounds), statistics.median(r[4] for r in rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
