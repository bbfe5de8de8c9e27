#!/usr/bin/env python3
"""Adds up Nsight Compute's per-launch kernel times (ncu --csv --metrics
gpu__time_duration.sum) by kernel and grid: launches, mean and total
microseconds, largest total first.  Reads the ncu output on stdin; the
second argument, if given, divides the totals (steps profiled).

  ncu --csv --metrics gpu__time_duration.sum ... | scripts/ncu-sum.py [STEPS]

With --last-two, the table is of the last two forward steps instead (a
step starts at each embed_kernel launch), side by side: the per-kernel
cost of bench_gpu --verify's K + 1-row step against its one-row step,
when the run ends with those two (--steps 1 --warmup 0).

  ncu --csv ... bench_gpu ... --verify 4 --steps 1 --warmup 0 | scripts/ncu-sum.py --last-two
"""
import csv
import sys


def launches(lines):
    """(kernel name, grid, microseconds) of every launch, in launch order."""
    rows = [line for line in lines if line.startswith('"')]
    out = []
    for r in csv.DictReader(rows):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = r["Kernel Name"].split("(")[0].split("<")[0].strip()
        if name.startswith("void "):
            name = name[5:]
        if "<" in r["Kernel Name"]:
            name += "<" + r["Kernel Name"].split("<", 1)[1].split(">")[0][:40] + ">"
        unit = r.get("Metric Unit", "ns")
        v = float(r["Metric Value"].replace(",", ""))
        us = v / 1000.0 if unit in ("ns", "nsecond") else v * 1000.0 if unit in ("ms", "msecond") else v
        out.append((name, r.get("Grid Size", ""), us))
    return out


def totals(ls):
    agg = {}
    for name, grid, us in ls:
        n, t = agg.get((name, grid), (0, 0.0))
        agg[(name, grid)] = (n + 1, t + us)
    return agg


def table(ls, steps):
    agg = totals(ls)
    total = sum(t for _, t in agg.values())
    print("%-64s %-16s %7s %9s %11s %6s" % ("kernel", "grid", "launch", "mean us", "us / step", "share"))
    for (name, grid), (n, t) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print("%-64s %-16s %7d %9.2f %11.1f %5.1f%%" % (name[:64], grid, n, t / n, t / steps, 100.0 * t / total))
    print("all kernels: %.1f us / step" % (total / steps))


def last_two(ls):
    starts = [i for i, (name, _, _) in enumerate(ls) if name.startswith("embed_kernel")]
    if len(starts) < 2:
        sys.exit("ncu-sum.py: fewer than two steps (embed_kernel launches) in the input")
    for title, part in (("next to last step", ls[starts[-2]:starts[-1]]), ("last step", ls[starts[-1]:])):
        print("== %s: %d launches, %.1f us" % (title, len(part), sum(us for _, _, us in part)))
        table(part, 1.0)


def main():
    args = sys.argv[1:]
    try:
        if args and args[0] == "--last-two":
            last_two(launches(sys.stdin))
        else:
            table(launches(sys.stdin), float(args[0]) if args else 1.0)
    except BrokenPipeError:  # a reader that took the head of the table
        sys.stderr.close()


if __name__ == "__main__":
    main()
