#!/usr/bin/env python3
"""Runs a DistributedDataParallel job with DTRAIN_TIMELINE set and checks the
Chrome traces it leaves, one per rank (DTRAIN_TIMELINE=<dir>/trace.json gives
<dir>/trace.rank<r>.json):

  - each file parses as JSON and names its process "rank <r>" and its threads
    "training" and "communication"; every event has pid <r>;
  - it holds steps, mark_ready spans, synchronize() spans with their waits,
    bucket reductions and bucket spans from launch to completion;
  - every step holds one mark_ready span per parameter (each index once, the
    same set in every step), and every wait sits inside a synchronize() that
    sits inside a step;
  - on every track the spans nest (no partial overlap; every B has its E),
    and every async bucket span ("b") has exactly one end ("e"), not before it;
  - every rank recorded the same number of steps.

usage: check_timeline.py <ranks> <trace dir> -- <command> [<arg>...]
Exit status 0 when every check passes; 1 (with what failed) otherwise.
"""
import json
import os
import subprocess
import sys
from collections import defaultdict

failures = []


def fail(rank, why):
    failures.append(f"rank {rank}: {why}")


def ns(value):
    """Microseconds as written (3 decimals) to integer nanoseconds: exact comparisons."""
    return round(float(value) * 1000)


def check_nesting(rank, events):
    """Complete ("X") and B/E spans of one track must nest."""
    spans = []
    open_b = []
    for e in events:
        if e["ph"] == "X":
            spans.append((ns(e["ts"]), ns(e["ts"]) + ns(e["dur"]), e["name"]))
        elif e["ph"] == "B":
            open_b.append(e)
        elif e["ph"] == "E":
            if not open_b:
                fail(rank, f"an E at {e['ts']} with no B open on tid {e['tid']}")
                continue
            b = open_b.pop()
            spans.append((ns(b["ts"]), ns(e["ts"]), b["name"]))
    for b in open_b:
        fail(rank, f"B '{b['name']}' at {b['ts']} on tid {b['tid']} has no E")
    # Parents first: earlier start, then the longer span.
    spans.sort(key=lambda s: (s[0], -(s[1] - s[0])))
    stack = []
    for start, end, name in spans:
        if end < start:
            fail(rank, f"'{name}' ends before it starts")
        while stack and stack[-1][1] <= start:
            stack.pop()
        if stack and end > stack[-1][1]:
            fail(rank, f"'{name}' [{start}, {end}] ns overlaps '{stack[-1][2]}' "
                       f"[{stack[-1][0]}, {stack[-1][1]}] ns without nesting in it")
            continue
        stack.append((start, end, name))
    return spans


def inside(inner, outer):
    return outer[0] <= inner[0] and inner[1] <= outer[1]


def check_rank(rank, path):
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        fail(rank, f"{path} does not parse: {e}")
        return None
    events = doc.get("traceEvents")
    if not isinstance(events, list) or not events:
        fail(rank, f"{path} has no traceEvents list")
        return None
    names = {(e["name"], e.get("tid")): e.get("args", {}).get("name")
             for e in events if e.get("ph") == "M"}
    if names.get(("process_name", 0)) != f"rank {rank}":
        fail(rank, f"process_name is {names.get(('process_name', 0))!r}, expected 'rank {rank}'")
    if names.get(("thread_name", 1)) != "training" or names.get(("thread_name", 2)) != "communication":
        fail(rank, "threads 1 and 2 are not named 'training' and 'communication'")
    if any(e.get("pid") != rank for e in events):
        fail(rank, f"an event with a pid other than {rank}")

    by_track = defaultdict(list)
    for e in events:
        if e["ph"] in ("X", "B", "E"):
            by_track[e["tid"]].append(e)
    for tid, track in sorted(by_track.items()):
        check_nesting(rank, track)

    def spans(cat, name=None, tid=None):
        return [(ns(e["ts"]), ns(e["ts"]) + ns(e["dur"]), e) for e in events
                if e["ph"] == "X" and e.get("cat") == cat and (name is None or e["name"] == name)
                and (tid is None or e["tid"] == tid)]

    steps = spans("step", tid=1)
    marks = spans("mark_ready", tid=1)
    syncs = spans("synchronize", "synchronize", tid=1)
    waits = spans("synchronize", "wait for buckets", tid=1)
    reductions = spans("bucket", tid=2)
    for what, found in (("step", steps), ("mark_ready", marks), ("synchronize", syncs),
                        ("wait for buckets", waits), ("bucket reduction", reductions)):
        if not found:
            fail(rank, f"no {what} spans")
    if failures:
        return None

    parameters = None
    for step in steps:
        indices = sorted(m[2]["args"]["index"] for m in marks if inside(m, step))
        if len(indices) != len(set(indices)):
            fail(rank, f"{step[2]['name']} marks a parameter twice: {indices}")
        if parameters is None:
            parameters = indices
        elif indices != parameters:
            fail(rank, f"{step[2]['name']} marks {indices}, the first step {parameters}")
    if parameters != list(range(len(parameters or []))):
        fail(rank, f"the steps mark parameters {parameters}, not 0..n-1 each once")
    for mark in marks:
        if not any(inside(mark, s) for s in steps):
            fail(rank, f"mark_ready '{mark[2]['name']}' outside every step")
    for wait in waits:
        sync = [s for s in syncs if inside(wait, s)]
        if not sync or not any(inside(sync[0], s) for s in steps):
            fail(rank, "a wait for buckets outside synchronize() inside a step")
    if len(syncs) != len(steps):
        fail(rank, f"{len(syncs)} synchronize() spans for {len(steps)} steps")

    async_spans = defaultdict(list)
    for e in events:
        if e["ph"] in ("b", "e"):
            async_spans[e["id"]].append(e)
    if not async_spans:
        fail(rank, "no bucket spans from launch to completion (async b/e)")
    for span_id, pair in async_spans.items():
        phases = sorted(e["ph"] for e in pair)
        if phases != ["b", "e"]:
            fail(rank, f"bucket span id {span_id} has phases {phases}, expected one b and one e")
        elif ns(next(e for e in pair if e["ph"] == "e")["ts"]) < ns(
                next(e for e in pair if e["ph"] == "b")["ts"]):
            fail(rank, f"bucket span id {span_id} ends before it starts")
    print(f"rank {rank}: {path}: {len(events)} events, {len(steps)} steps, "
          f"{len(parameters or [])} parameters marked per step, {len(reductions)} bucket "
          f"reductions, {len(async_spans)} bucket spans, {len(waits)} waits; spans nest")
    return len(steps)


def main(argv):
    if len(argv) < 5 or argv[3] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    ranks, directory, command = int(argv[1]), argv[2], argv[4:]
    os.makedirs(directory, exist_ok=True)
    trace = os.path.join(directory, "trace.json")
    files = [os.path.join(directory, f"trace.rank{r}.json") for r in range(ranks)]
    for f in files:
        if os.path.exists(f):
            os.remove(f)
    env = dict(os.environ, DTRAIN_TIMELINE=trace)
    job = subprocess.run(command, env=env, timeout=150)
    if job.returncode != 0:
        print(f"the job exited with status {job.returncode}", file=sys.stderr)
        return 1
    counts = [check_rank(r, f) for r, f in enumerate(files)]
    if not failures and len(set(counts)) != 1:
        failures.append(f"the ranks recorded different numbers of steps: {counts}")
    for f in failures:
        print(f"check_timeline: {f}", file=sys.stderr)
    if failures:
        return 1
    print(f"check_timeline: {ranks} traces parse, hold every kind of event, and their spans nest")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
