#!/usr/bin/env python3
"""Adds up Nsight Compute's per-launch kernel times (ncu --csv --metrics
gpu__time_duration.sum) by kernel and grid: launches, mean and total
microseconds, largest total first.  Reads the ncu output on stdin; the
second argument, if given, divides the totals (steps profiled).

  ncu --csv --metrics gpu__time_duration.sum ... | scripts/ncu-sum.py [STEPS]
"""
import csv
import sys


def main():
    steps = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    rows = [line for line in sys.stdin if line.startswith('"')]
    agg = {}
    for r in csv.DictReader(rows):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = r["Kernel Name"].split("(")[0].split("<")[0].strip()
        if "<" in r["Kernel Name"]:
            name += "<" + r["Kernel Name"].split("<", 1)[1].split(">")[0][:40] + ">"
        unit = r.get("Metric Unit", "ns")
        v = float(r["Metric Value"].replace(",", ""))
        us = v / 1000.0 if unit in ("ns", "nsecond") else v * 1000.0 if unit in ("ms", "msecond") else v
        key = (name, r.get("Grid Size", ""))
        n, t = agg.get(key, (0, 0.0))
        agg[key] = (n + 1, t + us)
    total = sum(t for _, t in agg.values())
    print("%-64s %-16s %7s %9s %11s %6s" % ("kernel", "grid", "launch", "mean us", "us / step", "share"))
    try:
        for (name, grid), (n, t) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
            print("%-64s %-16s %7d %9.2f %11.1f %5.1f%%" % (name[:64], grid, n, t / n, t / steps, 100.0 * t / total))
        print("all kernels: %.1f us / step" % (total / steps))
    except BrokenPipeError:  # a reader that took the head of the table
        sys.stderr.close()


if __name__ == "__main__":
    main()
