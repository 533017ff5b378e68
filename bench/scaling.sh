#!/usr/bin/env bash
# bench/scaling.sh [BUILD_DIR]: the scaling the Azure ML guide promises (a job
# of 100 s on one node takes 50 s on two and 25 s on four), measured on a
# simulated cluster (tests/cluster/cluster.sh): 4 nodes, each a network
# namespace with its own host name and address, joined at 1 Gbit/s, 2 workers
# per node (bench/scaling.cpp under its own node agent, Gloo).
#
# Prints three tables and writes OUT_DIR (default BUILD_DIR/bench/scaling-out):
#   - a 64 MiB allreduce, flat against hierarchical, on 2 and 4 nodes;
#   - strong scaling (a fixed global batch of 256) on 1, 2, 4 nodes;
#   - weak scaling (64 samples per rank) on 1, 2, 4 nodes;
#   each with topology::flat and topology::hierarchical: time per epoch,
#   speedup over one node, efficiency; results.jsonl (every raw result) and
#   scaling.png (speedup against nodes, with the ideal line; needs
#   python3-matplotlib, else it says so and writes no plot).
# The gradient is 24 MiB (6 layers of 1024 x 1024). Compute per sample is
# 6 ms of each rank's own "device" (see bench/scaling.cpp: the simulated
# nodes share this machine's cores). SCALING_ARGS adds flags to every
# training run (e.g. SCALING_ARGS="--sample-us 3000"). SCALING_REPORT_ONLY=1
# prints the tables and draws the plot again from OUT_DIR/results.jsonl.
# Needs root (namespaces); exits 77 saying why otherwise. Takes ~2 minutes.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
build=$(cd "${1:-$root/build}" && pwd) || exit 2
bin=$build/bench/scaling
out=${OUT_DIR:-$build/bench/scaling-out}
[[ -x $bin ]] || { echo "bench/scaling.sh: $bin is not built (cmake --build $build --target dtrain_bench_scaling)" >&2; exit 2; }
python=python3  # the one that has matplotlib, if any (Debian's, where another python3 comes first)
if ! python3 -c 'import matplotlib' 2>/dev/null && /usr/bin/python3 -c 'import matplotlib' 2>/dev/null; then
  python=/usr/bin/python3
fi
command -v "$python" >/dev/null || { echo "bench/scaling.sh: needs python3" >&2; exit 2; }
mkdir -p "$out"
results=$out/results.jsonl
if [[ ${SCALING_REPORT_ONLY:-} != 1 ]]; then
source "$root/tests/cluster/cluster.sh"
: >"$results"
cluster_up 4 1gbit
port=29600
read -r -a extra <<<"${SCALING_ARGS:-}"

# job NODES ARGS...: the program on node1..nodeNODES, 2 workers each; its JSON line goes to results.
job() {
  local nodes=$1 n pids=() status=0
  shift
  port=$((port + 1))
  for ((n = 1; n <= nodes; n++)); do
    cluster_run "node$n" env DTRAIN_NNODES="$nodes" DTRAIN_NODE_RANK=$((n - 1)) MASTER_ADDR=node1 \
      MASTER_PORT=$port timeout 600 "$bin" --nproc-per-node 2 "$@" >"$out/node$n.out" 2>"$out/node$n.err" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
  if ((status != 0)) || ! grep -q '^{' "$out/node1.out"; then
    echo "bench/scaling.sh: $nodes node(s), $*: failed (status $status)" >&2
    tail -n 20 "$out"/node*.err >&2
    return 1
  fi
  grep '^{' "$out/node1.out" | tee -a "$results"
}

for nodes in 2 4; do job "$nodes" --what allreduce --mib 64 --rounds 7 || exit 1; done
for mode in strong weak; do
  for topology in flat hierarchical; do
    for nodes in 1 2 4; do
      job "$nodes" --what train --mode "$mode" --topology "$topology" --epochs 2 --steps 6 \
        "${extra[@]}" || exit 1
    done
  done
done
fi

"$python" - "$results" "$out/scaling.png" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("\n64 MiB allreduce (float32, avg), 2 workers per node, 1 Gbit/s links; median of 7, slowest rank")
print(f"| {'nodes':>5} | {'ranks':>5} | {'flat s':>7} | {'hierarchical s':>14} | {'hierarchical / flat':>19} |")
print("|------:|------:|--------:|---------------:|--------------------:|")
for r in rows:
    if r["what"] == "allreduce":
        print(f"| {r['nodes']:>5} | {r['ranks']:>5} | {r['flat_s']:7.3f} | {r['hierarchical_s']:14.3f} | {r['ratio']:19.2f} |")
train = [r for r in rows if r["what"] == "train"]
curves = {}
for mode in ("strong", "weak"):
    sel = [r for r in train if r["mode"] == mode]
    if not sel:
        continue
    first = sel[0]
    what = (f"fixed global batch {first['global_batch']}" if mode == "strong"
            else f"fixed batch {first['per_rank_batch']} per rank")
    print(f"\n{mode} scaling ({what}), {first['grad_mib']:.0f} MiB gradient, {first['steps']} steps per epoch, "
          f"compute: {first['compute']}")
    print(f"| {'topology':<12} | {'nodes':>5} | {'ranks':>5} | {'epoch s':>8} | {'samples/s':>9} | {'speedup':>7} | {'efficiency':>10} | runs as")
    print("|:-------------|------:|------:|---------:|----------:|--------:|-----------:|:--------")
    for topology in ("flat", "hierarchical"):
        mine = sorted((r for r in sel if r["topology"] == topology), key=lambda r: r["nodes"])
        base = next((r for r in mine if r["nodes"] == 1), None)
        if base is None:
            continue
        points = []
        for r in mine:
            speedup = r["samples_per_s"] / base["samples_per_s"]
            efficiency = speedup / r["nodes"]
            points.append((r["nodes"], speedup))
            print(f"| {topology:<12} | {r['nodes']:>5} | {r['ranks']:>5} | {r['epoch_s']:8.2f} | {r['samples_per_s']:9.0f} | "
                  f"{speedup:7.2f} | {efficiency:9.0%} | {r['runs_as']}")
        curves[(mode, topology)] = points
print("\nspeedup: samples/s over samples/s on one node (strong: the same work, so also time on one node / time);"
      "\nefficiency: speedup / nodes")
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    print("no plot: python3-matplotlib is not installed (Debian: apt-get install python3-matplotlib)")
    sys.exit(0)
fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
for ax, mode in zip(axes, ("strong", "weak")):
    nodes = sorted({n for (m, _), pts in curves.items() if m == mode for n, _ in pts})
    if nodes:
        ax.plot(nodes, nodes, "k--", label="ideal")
    for topology, marker in (("flat", "o"), ("hierarchical", "s")):
        pts = curves.get((mode, topology))
        if pts:
            ax.plot([n for n, _ in pts], [s for _, s in pts], marker=marker, label=topology)
    ax.set_title(f"{mode} scaling, 2 workers per node, 1 Gbit/s")
    ax.set_xlabel("nodes")
    ax.set_ylabel("speedup over 1 node")
    ax.set_xticks(nodes or [1, 2, 4])
    ax.grid(True, alpha=0.3)
    ax.legend()
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=110)
print(f"plot: {sys.argv[2]}")
PY
echo "results: $results"
