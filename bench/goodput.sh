#!/usr/bin/env bash
# bench/goodput.sh [BUILD_DIR]: how much of a job's time a lost node costs
# (issue 50). The demo (dtrain_train_mlp, Gloo) trains a fixed number of steps
# as a fixed-size job of 2 simulated nodes x 2 workers (tests/cluster/
# cluster.sh: root and network namespaces; "SKIPPED" and exit 77 without),
# with a disk checkpoint every 10 steps, from the disk alone, with the
# memory tier every step (--memory-every 1), or as often as a budget of 3% of
# the step allows (the "budget" row: --memory-every 100 --memory-budget
# 0.03). Each runs once without failures and once with a node lost every
# PERIOD seconds (default 20): every process
# on it SIGKILLed (its host lost: agent and workers) and a new agent started
# there at once, which takes the lost one's place (dtrun's replacement node,
# docs/launching.md). The lost nodes take turns: node 2, then node 1 (node 0,
# whose agent serves the store: the other agent waits for the new one's
# store), and so on (LOST="2 1"; LOST=2: node 2 only). No loss is injected in
# the last tenth of the failure-free time, so that every loss lands inside
# the job.
#
# Prints a table: the seconds of each run, the losses, the seconds each loss
# cost, the steps trained twice (from the sample logs, counted by
# tests/scripts/sample_log.py: a step was trained when the next one began),
# goodput (the tier's failure-free time over its time with losses: 1.0, a
# loss costs nothing) and the time with losses over the disk's failure-free
# time (what the memory tier's copies cost too). Goal (issue 50): with
# memory, the job with a loss every 20 s takes at most 1.2x the failure-free
# time. Figures, not a test.
#
# Knobs: PERIOD (s between losses), EPOCHS (15: about 40 s without losses on
# 2 cores), HIDDEN (512: the model's width; wider steps make the steps trained
# twice costlier).
#
# And PyTorch's torchrun (bench/goodput_torchrun.py: Debian's, mended for
# Python 3.11) running the demo's twin (bench/goodput_twin.py: vs_pytorch.py's
# model in DDP over Gloo, a checkpoint every 10 steps, resumed at start) as an
# elastic job (--nnodes 1:2, c10d rendezvous on node 1, --max-restarts 100),
# node 2 lost (every process on it SIGKILLed) and its torchrun started again:
# node 2 only, whatever LOST says, for the c10d store lives and dies with
# node 1's torchrun, and the job with it.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
build=$(cd "${1:-$root/build}" && pwd) || exit 2
demo=$build/examples/dtrain_train_mlp
[[ -x $demo ]] || { echo "goodput.sh: build dtrain_train_mlp first (needs Gloo)" >&2; exit 2; }
if [[ $(id -u) -ne 0 ]] || ! command -v ip >/dev/null; then
  echo "SKIPPED: goodput.sh needs root and ip (the simulated cluster)"
  exit 77
fi
period=${PERIOD:-20}
read -r -a lost_nodes <<<"${LOST:-2 1}"
for n in "${lost_nodes[@]}"; do
  [[ $n == 1 || $n == 2 ]] || { echo "goodput.sh: LOST names nodes 1 and 2, not '$n'" >&2; exit 2; }
done
model=(--epochs "${EPOCHS:-15}" --samples 16384 --features 64 --hidden "${HIDDEN:-512}"
       --batch-size 32 --nproc-per-node 2 --checkpoint-every 10)
twin_model=(--epochs "${EPOCHS:-15}" --samples 16384 --features 64 --hidden "${HIDDEN:-512}"
            --batch-size 32 --checkpoint-every 10)
export DTRAIN_STORE_TOKEN=${DTRAIN_STORE_TOKEN:-goodput-bench-secret}
work=$(mktemp -d "${TMPDIR:-/tmp}/dtrain-goodput.XXXXXX")
# shellcheck source=../tests/cluster/cluster.sh
source "$root/tests/cluster/cluster.sh"
cluster_exit_hook='kill $(jobs -p) 2>/dev/null; rm -rf "$work"'
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
cluster_up 2 1gbit
port=29600

# start_node N DIR SUFFIX FLAGS...: node N's agent of the job (the demo launches itself).
# torchrun: node N's torchrun agent, elastic 1:2 (c10d rendezvous at node1) with the twin.
start_node() {
  local n=$1 dir=$2 suffix=$3 kind=$4
  shift 4
  if [[ $kind == torchrun ]]; then
    cluster_run node"$n" env OMP_NUM_THREADS=1 /usr/bin/python3 "$here/goodput_torchrun.py" \
      --nnodes 1:2 --nproc_per_node 2 \
      --max_restarts 100 --rdzv_backend c10d --rdzv_endpoint "node1:$port" \
      --rdzv_id "goodput-$port" "$here/goodput_twin.py" "$@" \
      >"$dir/node$n$suffix.out" 2>"$dir/node$n$suffix.err" &
    return
  fi
  cluster_run node"$n" env DTRAIN_NNODES=2 DTRAIN_NODE_RANK=$((n - 1)) MASTER_ADDR=node1 \
    MASTER_PORT=$port DTRAIN_MAX_RESTARTS=100 DTRAIN_GRACE_PERIOD=1 \
    "$demo" "$@" >"$dir/node$n$suffix.out" 2>"$dir/node$n$suffix.err" &
}

# lose_node N: every process on node N SIGKILLed (its host lost); whether there was any.
lose_node() {
  local pids
  pids=$(ip netns pids "$(cluster_ns "$cluster_id" "$1")")
  [[ -n $pids ]] || return 1
  # shellcheck disable=SC2086
  kill -KILL $pids 2>/dev/null
}

# since T: seconds from T ($EPOCHREALTIME) to now.
since() { awk -v now="$EPOCHREALTIME" -v then="$1" 'BEGIN { printf "%.3f", now - then }'; }

# twice DIR: the steps that a round trained and a later one trained again,
# summed over the changes of round (tests/scripts/sample_log.py).
twice() { python3 "$here/../tests/scripts/sample_log.py" twice "$1/samples"; }

# run NAME KIND LOSSES_UNTIL: one job (KIND: disk, memory or torchrun); a
# node lost every PERIOD s (the LOST nodes in turn; torchrun: node 2) while
# the job is younger than LOSSES_UNTIL s (0: never), and started again at
# once. Prints "seconds losses twice".
run() {
  local name=$1 kind=$2 until=$3 dir=$work/$1
  mkdir -p "$dir/samples" "$dir/ckpt"
  port=$((port + 1))
  local flags=("${model[@]}" --checkpoint-dir "$dir/ckpt" --sample-log "$dir/samples")
  [[ $kind == memory ]] && flags+=(--memory-every 1)
  [[ $kind == budget ]] && flags+=(--memory-every 100 --memory-budget 0.03)
  [[ $kind == torchrun ]] && flags=("${twin_model[@]}" --checkpoint-dir "$dir/ckpt" --sample-log "$dir/samples")
  local start=$EPOCHREALTIME
  start_node 1 "$dir" "" "$kind" "${flags[@]}"
  local first=$! first_log=$dir/node1.err  # node 1's agent now (the job ends with it)
  start_node 2 "$dir" "" "$kind" "${flags[@]}"
  local losses=0 next=$period turns=("${lost_nodes[@]}") lost
  [[ $kind == torchrun ]] && turns=(2)
  while kill -0 "$first" 2>/dev/null; do
    sleep 0.1
    if awk -v age="$(since "$start")" -v next_loss="$next" -v until="$until" \
      'BEGIN { exit !(age >= next_loss && age < until) }'; then
      lost=${turns[$((losses % ${#turns[@]}))]}
      if lose_node "$lost"; then
        losses=$((losses + 1))
        start_node "$lost" "$dir" ".$losses" "$kind" "${flags[@]}"
        if ((lost == 1)); then
          first=$!
          first_log=$dir/node1.$losses.err
        fi
      fi
      next=$((next + period))
    fi
  done
  wait "$first" ||
    { echo "goodput.sh: $name: node 1 exited with $? (see $dir)" >&2; tail -n 5 "$first_log" >&2; return 1; }
  wait
  local took again
  took=$(since "$start")
  again=$(twice "$dir") || return 1
  printf '%.2f %d %d\n' "$took" "$losses" "$again"
}

echo "bench/goodput.sh: $(nproc) cores, 2 simulated nodes x 2, a node lost every $period s" \
  "(in turn: node ${lost_nodes[*]}; torchrun: node 2)"
kinds=(disk memory budget)
if /usr/bin/python3 -c "import torch.distributed.run" 2>/dev/null; then
  kinds+=(torchrun)
else
  echo "(torchrun's row left out: /usr/bin/python3 has no torch.distributed.run: Debian's python3-torch)"
fi
declare -A result
for tier in "${kinds[@]}"; do
  result[$tier,free]=$(run "$tier-free" "$tier" 0) || exit 1
  read -r free _ <<<"${result[$tier,free]}"
  result[$tier,lossy]=$(run "$tier-lossy" "$tier" "$(awk -v f="$free" 'BEGIN { print f * 0.9 }')") ||
    exit 1
done
echo
echo "| tier | failure-free (s) | with losses (s) | losses | s lost per loss | steps trained twice | goodput | with losses / disk's failure-free |"
echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
read -r disk_free _ <<<"${result[disk,free]}"
for tier in "${kinds[@]}"; do
  read -r free _ _ <<<"${result[$tier,free]}"
  read -r lossy losses again <<<"${result[$tier,lossy]}"
  printf '| %s | %s | %s | %s | %s | %s | %.3f | %.3f |\n' "$tier" "$free" "$lossy" "$losses" \
    "$(awk -v f="$free" -v l="$lossy" -v n="$losses" 'BEGIN { if (n > 0) printf "%.2f", (l - f) / n; else print "-" }')" \
    "$again" "$(awk -v f="$free" -v l="$lossy" 'BEGIN { print f / l }')" \
    "$(awk -v d="$disk_free" -v l="$lossy" 'BEGIN { print l / d }')"
done
