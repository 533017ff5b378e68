#!/usr/bin/env python3
"""check_metrics.py DIR RANKS -- JOB...: runs JOB (a multi-rank job of
tests/ddp/ddp_straggler.cpp's case "metrics", with DTRAIN_METRICS_DIR=DIR),
then parses each rank's DIR/dtrain_rank<R>.prom with prometheus_client's
parser (the Prometheus text format that node-exporter's textfile collector
reads) and checks its values against what the rank printed:
"metrics: rank R step S gradient_bytes B checkpoint disk D memory M"; and
so its checkpoint's DIR/dtrain_checkpoint_rank<R>.prom (the disk's newest
step on rank 0 only, which commits it; 0: none)."""
import os
import re
import shutil
import subprocess
import sys
import time

from prometheus_client.parser import text_string_to_metric_families


def main():
    sep = sys.argv.index("--")
    directory, ranks = sys.argv[1], int(sys.argv[2])
    job = sys.argv[sep + 1:]
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    env = dict(os.environ, DTRAIN_METRICS_DIR=directory)
    run = subprocess.run(job, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=300, check=False)
    print(run.stdout)
    if run.returncode != 0:
        sys.exit(f"check_metrics: the job exited {run.returncode}")
    printed = {int(m[0]): tuple(int(x) for x in m[1:]) for m in
               re.findall(r"metrics: rank (\d+) step (\d+) gradient_bytes (\d+) "
                          r"checkpoint disk (\d+) memory (\d+)", run.stdout)}
    if sorted(printed) != list(range(ranks)):
        sys.exit(f"check_metrics: ranks printed {sorted(printed)}, expected 0..{ranks - 1}")
    problems = []

    def parse(path, rank):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.labels.get("rank") != str(rank) or not s.labels.get("node"):
                    problems.append(f"{path}: {s.name} has labels {s.labels}")
                samples[s.name] = (family.type, s.value)
        if os.path.exists(path + ".tmp"):
            problems.append(f"{path}.tmp was left behind")
        return samples

    def recent(path, samples, name):
        stamp = samples.get(name, ("", 0))[1]
        if abs(time.time() - stamp) > 120:
            problems.append(f"{path}: {name} {stamp} is not now")

    for rank in range(ranks):
        path = os.path.join(directory, f"dtrain_rank{rank}.prom")
        samples = parse(path, rank)
        step, gradient_bytes, disk, memory = printed[rank]
        want = {
            "dtrain_step": ("gauge", step),
            "dtrain_world_size": ("gauge", ranks),
            "dtrain_restarts": ("gauge", 0),
            "dtrain_gradient_bytes_total": ("counter", gradient_bytes),
            "dtrain_straggler_slow": ("gauge", 0),
            "dtrain_collectives_slow": ("gauge", 0),
        }
        for name, (kind, value) in want.items():
            if samples.get(name) != (kind, value):
                problems.append(f"{path}: {name} is {samples.get(name)}, expected {(kind, value)}")
        recent(path, samples, "dtrain_step_timestamp_seconds")
        if not 0.005 < samples.get("dtrain_step_seconds", ("", 0))[1] < 5:
            problems.append(f"{path}: dtrain_step_seconds {samples.get('dtrain_step_seconds')}")
        path = os.path.join(directory, f"dtrain_checkpoint_rank{rank}.prom")
        samples = parse(path, rank)
        for tier, newest in (("disk", disk), ("memory", memory)):
            name = f"dtrain_checkpoint_{tier}_step"
            if newest == 0:
                if name in samples:
                    problems.append(f"{path}: {name} is {samples[name]}, expected none")
                continue
            if samples.get(name) != ("gauge", newest):
                problems.append(f"{path}: {name} is {samples.get(name)}, expected {newest}")
            recent(path, samples, f"dtrain_checkpoint_{tier}_timestamp_seconds")
    if problems:
        sys.exit("check_metrics:\n  " + "\n  ".join(problems))
    print(f"check_metrics: {2 * ranks} files parse (prometheus_client) and match the ranks' "
          "counts and checkpoints")


if __name__ == "__main__":
    main()
