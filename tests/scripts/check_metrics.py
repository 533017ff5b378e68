#!/usr/bin/env python3
"""check_metrics.py DIR RANKS -- JOB...: runs JOB (a multi-rank job of
tests/ddp/ddp_straggler.cpp's case "metrics", with DTRAIN_METRICS_DIR=DIR),
then parses each rank's DIR/dtrain_rank<R>.prom with prometheus_client's
parser (the Prometheus text format that node-exporter's textfile collector
reads) and checks its values against what the rank printed:
"metrics: rank R step S gradient_bytes B"."""
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
    printed = {int(m[0]): (int(m[1]), int(m[2])) for m in
               re.findall(r"metrics: rank (\d+) step (\d+) gradient_bytes (\d+)", run.stdout)}
    if sorted(printed) != list(range(ranks)):
        sys.exit(f"check_metrics: ranks printed {sorted(printed)}, expected 0..{ranks - 1}")
    problems = []
    for rank in range(ranks):
        path = os.path.join(directory, f"dtrain_rank{rank}.prom")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.labels.get("rank") != str(rank) or not s.labels.get("node"):
                    problems.append(f"{path}: {s.name} has labels {s.labels}")
                samples[s.name] = (family.type, s.value)
        step, gradient_bytes = printed[rank]
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
        stamp = samples.get("dtrain_step_timestamp_seconds", ("", 0))[1]
        if abs(time.time() - stamp) > 120:
            problems.append(f"{path}: dtrain_step_timestamp_seconds {stamp} is not now")
        if not 0.005 < samples.get("dtrain_step_seconds", ("", 0))[1] < 5:
            problems.append(f"{path}: dtrain_step_seconds {samples.get('dtrain_step_seconds')}")
        if os.path.exists(path + ".tmp"):
            problems.append(f"{path}.tmp was left behind")
    if problems:
        sys.exit("check_metrics:\n  " + "\n  ".join(problems))
    print(f"check_metrics: {ranks} files parse (prometheus_client) and match the ranks' counts")


if __name__ == "__main__":
    main()
