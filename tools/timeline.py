#!/usr/bin/env python3
"""dtrain's DDP timeline files (DTRAIN_TIMELINE), outside a browser.

  tools/timeline.py merge trace.rank*.json -o trace.json
      one Chrome trace of every rank (ranks stay processes: pid = rank), for
      Perfetto (ui.perfetto.dev) or chrome://tracing, which open one file.
      The ranks' clocks line up on one host (steady clock); across hosts they
      are offset by the hosts' boot times.
  tools/timeline.py render trace.rank*.json -o docs/timeline.png [--steps A:B]
      a Perfetto-like picture with matplotlib: ranks as groups, the training
      and communication threads (and the device track, on CUDA streams) and
      the bucket spans as rows, spans as bars
      with their names; --steps picks the steps shown (default: the 3 after
      the first 2). Needs matplotlib (Debian: python3-matplotlib).
"""
import argparse
import json
import sys

COLOURS = {"step": "#c9d7ee", "mark_ready": "#f2a65a", "synchronize": "#9ccc65",
           "bucket": "#5c9bd6", "wait": "#e57373", "device": "#8e7cc3"}


def load(paths):
    events = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            events.extend(json.load(f)["traceEvents"])
    return events


def merge(args):
    out = {"displayTimeUnit": "ms", "otherData": {"generator": "dtrain tools/timeline.py merge",
                                                  "files": args.files},
           "traceEvents": load(args.files)}
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(out, f)
    print(f"{args.output}: {len(out['traceEvents'])} events from {len(args.files)} files")


def render(args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = load(args.files)
    steps = sorted((e for e in events if e.get("cat") == "step" and e["ph"] == "X"),
                   key=lambda e: e["ts"])
    first, last = (int(x) for x in args.steps.split(":"))
    chosen = [s for s in steps if first <= int(s["name"].split()[1]) <= last]
    if not chosen:
        sys.exit(f"timeline.py: no steps {args.steps} in the files")
    t0 = min(s["ts"] for s in chosen)
    t1 = max(s["ts"] + s["dur"] for s in chosen)
    pad = (t1 - t0) * 0.02
    t0, t1 = t0 - pad, t1 + pad

    ranks = sorted({e["pid"] for e in events})
    rows = []  # (label, [(start, duration, name, category, depth)])
    for rank in ranks:
        mine = [e for e in events if e["pid"] == rank]
        for tid, label in ((1, "training"), (2, "communication"), (3, "device")):
            if tid == 3 and not any(e.get("tid") == 3 for e in mine):
                continue  # device time: CUDA streams only
            spans = [e for e in mine if e["ph"] == "X" and e["tid"] == tid
                     and e["ts"] + e["dur"] >= t0 and e["ts"] <= t1]
            spans.sort(key=lambda e: (e["ts"], -e["dur"]))
            placed, stack = [], []
            for e in spans:
                while stack and stack[-1] <= e["ts"]:
                    stack.pop()
                cat = "wait" if e["name"] == "wait for buckets" else e["cat"]
                placed.append((e["ts"], e["dur"], e["name"], cat, len(stack)))
                stack.append(e["ts"] + e["dur"])
            rows.append((f"rank {rank}  {label}", placed))
        # Bucket spans from launch to completion (async b/e): overlapping, so one lane each.
        begins = {e["id"]: e for e in mine if e["ph"] == "b"}
        lanes, placed = [], []
        for e in sorted((e for e in mine if e["ph"] == "e"), key=lambda e: begins[e["id"]]["ts"]):
            b = begins.get(e["id"])
            if b is None or e["ts"] < t0 or b["ts"] > t1:
                continue
            lane = next((i for i, end in enumerate(lanes) if end <= b["ts"]), len(lanes))
            if lane == len(lanes):
                lanes.append(0)
            lanes[lane] = e["ts"]
            placed.append((b["ts"], e["ts"] - b["ts"], b["name"], "bucket", lane))
        rows.append((f"rank {rank}  buckets (launch to done)", placed))

    height = 0.22
    fig, ax = plt.subplots(figsize=(14, 0.9 + 0.62 * len(rows)))
    y = 0.0
    ticks = []
    for label, placed in rows:
        depth = max((p[4] for p in placed), default=0) + 1
        top = y
        for start, dur, name, cat, level in placed:
            x = (max(start, t0) - t0) / 1000.0
            w = (min(start + dur, t1) - max(start, t0)) / 1000.0
            yy = top + level * height
            ax.barh(yy, max(w, 0.004), height=height * 0.9, left=x, align="edge",
                    color=COLOURS.get(cat, "#bbbbbb"), edgecolor="#555555", linewidth=0.3)
            if w > (t1 - t0) / 1000.0 / 45:
                ax.text(x + w / 2, yy + height * 0.45, name, ha="center", va="center",
                        fontsize=6.5, clip_on=True)
        ticks.append((top + depth * height / 2, label))
        y = top + depth * height + 0.18
    ax.set_yticks([t for t, _ in ticks], [l for _, l in ticks], fontsize=8)
    ax.set_ylim(y, -0.1)
    ax.set_xlim(0, (t1 - t0) / 1000.0)
    ax.set_xlabel("milliseconds")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend(handles, ["step", "mark_ready", "synchronize", "bucket", "wait for buckets"],
              loc="lower right", fontsize=7, ncol=5)
    ax.set_title(args.title or f"dtrain DDP timeline, steps {first} to {last} "
                 "(a matplotlib rendering of the trace files)", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.output, dpi=args.dpi)
    print(f"{args.output}: {len(rows)} rows, steps {first} to {last}")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="one trace of every rank")
    m.add_argument("files", nargs="+")
    m.add_argument("-o", "--output", required=True)
    m.set_defaults(run=merge)
    r = sub.add_parser("render", help="a PNG of a few steps")
    r.add_argument("files", nargs="+")
    r.add_argument("-o", "--output", required=True)
    r.add_argument("--steps", default="2:4", help="first:last step shown (2:4)")
    r.add_argument("--title", default="")
    r.add_argument("--dpi", type=int, default=130)
    r.set_defaults(run=render)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
