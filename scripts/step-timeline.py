#!/usr/bin/env python3
"""Where a step's time goes between the router and the stages of a pipeline.

Reads the run dirs of clusters whose router and workers logged at debug
level (llm-cluster up --log-level debug; bench_cluster --run-root DIR
--log-level debug keeps one dir a layout) and joins, by step id, the
router's line for the step ("pipeline P step S: ... sent A us, result B us")
with each stage's ("step S timeline: stage K, N tokens, received R us,
start T us, input +a, queued +b, done +c").  Every process of a host reads the same monotonic
clock, so the differences are real intervals:

  plan->s<K>       the plan's trip to stage K: the router's send to the
                   worker's io thread taking it (R)
  s<K> handoff     ... to the compute thread taking it (T)
  s<K> input       the stage's start to its input asked for (a GPU link's
                   receive queued; a ZeroMQ link's received)
  s<K> queued      ... to its forward pass queued (on a GPU: launched)
  s<K> done        ... to its output sent on, or the last stage's result sent
                   (after its GPU finished: sampling waits for it)
  result->router   the last stage's result sent to the router's receipt
  round trip       the router's send to its receipt
  router turn      a result's receipt to the router's next send on the same
                   pipeline, where that send came after it (at concurrency 1:
                   what the router does between two tokens of a stream)
  step interval    one send to the next on the same pipeline

Prints the median and the 90th percentile of each over the steps of a run
dir that carry exactly TOKENS tokens (default: all) and that every stage
and the router logged.

  scripts/step-timeline.py [--tokens N] RUN_DIR...
"""
import glob
import os
import re
import statistics
import sys

ROUTER = re.compile(r"pipeline (\d+) step (\d+): .* sent (-?\d+) us, result (-?\d+) us")
STAGE = re.compile(r"step (\d+) timeline: stage (\d+), (\d+) tokens, received (-?\d+) us, start (-?\d+) us, "
                   r"input \+(-?\d+), queued \+(-?\d+), done \+(-?\d+)")


def read(path, rx):
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            m = rx.search(line)
            if m:
                out.append(tuple(int(g) for g in m.groups()))
    return out


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(run_dir, tokens):
    routers = sorted(glob.glob(os.path.join(run_dir, "router*.log")))
    workers = sorted(glob.glob(os.path.join(run_dir, "worker-*.log")))
    if not routers or not workers:
        print(f"{run_dir}: no router*.log or worker-*.log")
        return 1
    sent = {}
    by_pipe = {}
    for path in routers:
        for pipe, step, s, r in read(path, ROUTER):
            sent[step] = (s, r)
            by_pipe.setdefault((path, pipe), []).append((s, r, step))
    stages = {}  # step -> {stage: (tokens, received, start, input, queued, done)}
    for path in workers:
        for step, k, n, rcv, t0, a, b, c in read(path, STAGE):
            stages.setdefault(step, {})[k] = (n, rcv, t0, a, b, c)
    n_stages = max((max(v) for v in stages.values()), default=-1) + 1
    rows = {}
    joined = 0
    for step, by_stage in stages.items():
        if step not in sent or len(by_stage) != n_stages:
            continue
        if tokens is not None and any(v[0] != tokens for v in by_stage.values()):
            continue
        s, r = sent[step]
        joined += 1
        for k in range(n_stages):
            _n, rcv, t0, a, b, c = by_stage[k]
            rows.setdefault(f"plan->s{k}", []).append(rcv - s)
            rows.setdefault(f"s{k} handoff", []).append(t0 - rcv)
            rows.setdefault(f"s{k} input", []).append(a)
            rows.setdefault(f"s{k} queued", []).append(b)
            rows.setdefault(f"s{k} done", []).append(c)
        _n, _rcv, t0, _a, _b, c = by_stage[n_stages - 1]
        rows.setdefault("result->router", []).append(r - (t0 + c))
        rows.setdefault("round trip", []).append(r - s)
    joined_steps = {step for step, v in stages.items() if step in sent and len(v) == n_stages and
                    (tokens is None or all(x[0] == tokens for x in v.values()))}
    for sends in by_pipe.values():
        sends.sort()
        for (s0, r0, st0), (s1, _r1, st1) in zip(sends, sends[1:]):
            if st0 not in joined_steps or st1 not in joined_steps:
                continue
            if s1 >= r0:
                rows.setdefault("router turn", []).append(s1 - r0)
            rows.setdefault("step interval", []).append(s1 - s0)
    what = f"steps of {tokens} tokens" if tokens is not None else "steps"
    print(f"{run_dir}: {n_stages} stage(s), {joined} {what} joined (router {len(sent)}, "
          f"stage 0 {sum(1 for v in stages.values() if 0 in v)})")
    if not joined:
        return 1
    print(f"  {'segment':<16} {'median us':>10} {'p90 us':>10}")
    for name, xs in rows.items():
        print(f"  {name:<16} {statistics.median(xs):>10.0f} {pct(xs, 0.9):>10.0f}")
    return 0


def main(argv):
    tokens = None
    if len(argv) >= 2 and argv[0] == "--tokens":
        tokens = int(argv[1])
        argv = argv[2:]
    if not argv:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    rc = 0
    for d in argv:
        rc |= summarize(d, tokens)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
