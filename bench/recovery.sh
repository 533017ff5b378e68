#!/usr/bin/env bash
# bench/recovery.sh [BUILD_DIR]: how long a job takes from a failure to its
# first training step after resuming (issue 33), split into its parts. The
# demo (dtrain_train_mlp, Gloo) trains with a checkpoint every 10 steps and
# --sample-log; once its first checkpoint is committed, this script kills:
#
#   1 node x 4       one worker (SIGKILL); the agent restarts the workers
#                    (DTRAIN_MAX_RESTARTS=1) on the same node
#   2 nodes x 2      node 2's agent (SIGKILL), elastic (--nnodes 1:2): node 1
#                    goes on alone. On a simulated cluster (tests/cluster/
#                    cluster.sh: root and network namespaces; skipped without).
#                    The same with ZeRO stage 1 (--sharding 1): with the memory
#                    tier node 1's ranks gather the 4 ranks' shards (node 2's
#                    from node 1's agent) and re-cut them for 2
#   2 nodes x 2      the same as a fixed job with ZeRO stage 1 (--sharding 1:
#   replaced         each rank's shard of the optimizer state is its own):
#                    node 2's agent SIGKILLed and a new one started on node 2
#                    at once; with the memory tier its ranks take their
#                    copies back from their buddy, node 1's agent. And the
#                    same with node 1's agent (node 0: it serves the store)
#                    SIGKILLed and replaced: node 2's agent joins the new
#                    node 0's store, its ranks' copies held by node 2's agent;
#                    and that as an elastic job (--nnodes 1:2). And node 1's
#                    host powered off (frozen whole and cut off: no connection
#                    closed; DTRAIN_HEARTBEAT_TIMEOUT 2 s) and, once node 2
#                    says so, a new host given its name and address, where
#                    node 0's agent starts again
#
# each from the disk alone and with the memory tier every step (--memory-every 1),
# and times, from the agents' and workers' output lines (stamped as they
# arrive) and the sample log:
#   detection   kill -> the agent says the round ended (names the failure)
#   restart     -> the new workers are up: rendezvous, communicator, DDP
#                  (the demo's "training a ..." line)
#   load        -> the checkpoint is loaded ("dtrain checkpoint: resumed from")
#   first step  -> the first step of the new round is trained (its sample log)
# and the steps trained again: those the killed round trained and the new one
# trains again (from the sample logs, tests/scripts/sample_log.py). Median of
# RUNS runs (default 3), in milliseconds. Figures, not a test.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
build=$(cd "${1:-$root/build}" && pwd) || exit 2
demo=$build/examples/dtrain_train_mlp
[[ -x $demo ]] || { echo "recovery.sh: build dtrain_train_mlp first (needs Gloo)" >&2; exit 2; }
runs=${RUNS:-3}
model=(--epochs 6 --samples 8192 --features 64 --hidden 256 --batch-size 32 --checkpoint-every 10)
export DTRAIN_STORE_TOKEN=${DTRAIN_STORE_TOKEN:-recovery-bench-secret}
work=$(mktemp -d "${TMPDIR:-/tmp}/dtrain-recovery.XXXXXX")
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT

now_ms() { date +%s%3N; }
# Each line it reads, prefixed with the time it arrived (ms).
stamp() { while IFS= read -r line; do printf '%s %s\n' "$(now_ms)" "$line"; done; }
# first_after <log> <ms> <regex>: the time of the first line after <ms> that matches.
first_after() { awk -v t="$2" -v re="$3" '$1 >= t && $0 ~ re { print $1; exit }' "$1"; }
median() { printf '%s\n' "$@" | sort -g | sed -n "$((($# + 1) / 2))p"; }
# wait_until <seconds> <command...>
wait_until() {
  local deadline=$((SECONDS + $1))
  shift
  until "$@"; do
    ((SECONDS < deadline)) || return 1
    sleep 0.005
  done
}
# The time a sample log of a round not in <before> first has a line.
new_round_started() {  # <dir> <list of files before>
  local f
  for f in "$1"/round-*-rank-0.txt; do
    [[ " $2 " == *" $f "* ]] && continue
    [[ -s $f ]] && return 0
  done
  return 1
}

# measure <log> <samples dir> <kill time> <files before> [<rank 0's log>]: prints
# "detect restart load first again"; the failure is detected in <log>, the
# workers' lines are rank 0's (in <log> unless given).
measure() {
  local log=$1 samples=$2 killed=$3 before=$4 rank0=${5:-$1} first
  wait_until 60 new_round_started "$samples" "$before" || { echo "no step after the kill" >&2; return 1; }
  first=$(now_ms)
  local detected started loaded tries
  # The logs' lines are stamped by a reader that may lag the sample log (a
  # process per line): wait for them a little.
  for ((tries = 0; tries < 500; ++tries)); do
    detected=$(first_after "$log" "$killed" "restarting every node|forming the next round|node 0's agent is gone, and with it the store|node 0's store at .* does not answer")
    started=$(first_after "$rank0" "${detected:-0}" "training a ")
    loaded=$(first_after "$rank0" "${started:-0}" "dtrain checkpoint: resumed from")
    [[ -n $detected && -n $started && -n $loaded ]] && break
    sleep 0.01
  done
  [[ -n $detected && -n $started && -n $loaded ]] || { echo "missing lines in $log / $rank0" >&2; return 1; }
  # The steps trained again (one change of round here: the killed round's
  # steps at or after the new round's first that it trained).
  local twice
  twice=$(python3 "$here/../tests/scripts/sample_log.py" twice "$samples") || return 1
  echo "$((detected - killed)) $((started - detected)) $((loaded - started)) $((first - loaded)) $twice"
}

declare -A results
record() {  # <setup> <detect restart load first>
  results[$1]+="$2;"
}

# kill_and_measure <victim> <log> <samples dir> <job to wait for> <setup>:
# SIGKILLs the victim, a pid (or with "host:N", freezes node N's every process
# and cuts its link: a host that lost its power; their pids in $frozen),
# measures the recovery, waits for the job to succeed. A 6th argument is a
# command run right after the kill (a replacement's start), a 7th the log
# where rank 0 prints after it (measure).
kill_and_measure() {
  local victim=$1 log=$2 samples=$3 job=$4 setup=$5 after=${6:-} rank0=${7:-} before killed row
  before=$(echo "$samples"/round-*-rank-0.txt)
  killed=$(now_ms)
  if [[ $victim == host:* ]]; then
    frozen=$(cluster_pids "node${victim#host:}" | xargs)
    kill -STOP $frozen
    cluster_cut_off "node${victim#host:}" || return 1
  else
    kill -KILL "$victim"
  fi
  [[ -z $after ]] || $after
  row=$(measure "$log" "$samples" "$killed" "$before" "$rank0") || return 1
  wait "$job" || { echo "the job failed after the kill (see $log)" >&2; return 1; }
  record "$setup" "$row"
}

# tier_flags <tier>: the demo's flags for "disk" (a checkpoint every 10 steps) or
# "memory" (and a memory copy every step).
tier_flags() { [[ $1 == memory ]] && echo "--memory-every 1"; }

one_node() {
  local run=$1 tier=$2
  local dir=$work/one-$tier-$run
  mkdir -p "$dir/samples"
  # shellcheck disable=SC2046
  DTRAIN_MAX_RESTARTS=1 "$demo" --nproc-per-node 4 "${model[@]}" $(tier_flags "$tier") \
    --checkpoint-dir "$dir/ckpt" --sample-log "$dir/samples" > >(stamp >"$dir/log") 2>&1 &
  local agent=$!
  wait_until 60 compgen -G "$dir/ckpt/step-*[0-9]" >/dev/null || { echo "no checkpoint" >&2; return 1; }
  local workers=() child
  for child in $(pgrep -P "$agent"); do
    tr '\0' '\n' <"/proc/$child/environ" 2>/dev/null | grep -q '^RANK=' && workers+=("$child")
  done
  ((${#workers[@]} > 0)) || { echo "no worker to kill" >&2; return 1; }
  kill_and_measure "${workers[$((RANDOM % ${#workers[@]}))]}" "$dir/log" "$dir/samples" "$agent" \
    "1 node x 4, a worker SIGKILLed, $tier"
}

two_nodes() {  # <run> <tier> [ZeRO stage]
  local run=$1 tier=$2 zero=${3:-0}
  local dir=$work/two-$tier-$zero-$run
  mkdir -p "$dir/samples"
  local n pids=()
  for n in 1 2; do
    # shellcheck disable=SC2046
    cluster_run node$n env DTRAIN_NNODES=1:2 DTRAIN_NODE_RANK=$((n - 1)) MASTER_ADDR=node1 \
      MASTER_PORT=29500 DTRAIN_MAX_RESTARTS=2 "$demo" --nproc-per-node 2 --sharding "$zero" \
      "${model[@]}" $(tier_flags "$tier") --checkpoint-dir "$dir/ckpt" --sample-log "$dir/samples" \
      > >(stamp >"$dir/node$n.log") 2>&1 &
    pids+=($!)
  done
  wait_until 60 compgen -G "$dir/ckpt/step-*[0-9]" >/dev/null || { echo "no checkpoint" >&2; return 1; }
  local agent2
  agent2=$(cluster_agent node2 "$demo")
  [[ -n $agent2 ]] || { echo "no agent on node2" >&2; return 1; }
  local setup="2 nodes x 2 (elastic 1:2), node 2's agent SIGKILLed"
  ((zero == 0)) || setup="2 nodes x 2 (elastic 1:2, ZeRO-1), node 2's agent SIGKILLed"
  kill_and_measure "$agent2" "$dir/node1.log" "$dir/samples" "${pids[0]}" "$setup, $tier"
}

# fixed_agent <dir> <n> <log suffix> <tier> [<nnodes>]: node n's agent (the demo)
# of a job of 2 nodes (fixed unless <nnodes> says 1:2) with ZeRO stage 1 on the
# simulated cluster; its heartbeat time-out $heartbeat s (default 10).
fixed_agent() {
  local dir=$1 n=$2 suffix=$3 tier=$4 nnodes=${5:-2}
  # shellcheck disable=SC2046
  cluster_run node$n env DTRAIN_NNODES="$nnodes" DTRAIN_NODE_RANK=$((n - 1)) MASTER_ADDR=node1 \
    MASTER_PORT=29500 DTRAIN_MAX_RESTARTS=1 DTRAIN_HEARTBEAT_TIMEOUT="${heartbeat:-10}" \
    "$demo" --nproc-per-node 2 --sharding 1 "${model[@]}" \
    $(tier_flags "$tier") --checkpoint-dir "$dir/ckpt" --sample-log "$dir/samples" \
    > >(stamp >"$dir/node$n$suffix.log") 2>&1 &
}

# replaced <run> <tier> <the node whose agent is killed: 2, or 1 (node 0, the store's)> [<nnodes>]
# [power]: with `power`, node <lost>'s host loses its power instead (kill_and_measure's
# host:N), and a new host takes its name and address before the replacement starts.
replaced() {
  local run=$1 tier=$2 lost=$3 nnodes=${4:-2} how=${5:-kill} kept=1 rank0= kind=fixed
  ((lost == 1)) && kept=2
  [[ $nnodes == 2 ]] || kind="elastic $nnodes"
  local dir=$work/replaced-$tier-$lost-$nnodes-$how-$run
  mkdir -p "$dir/samples"
  fixed_agent "$dir" $kept "" "$tier" "$nnodes"
  local survivor=$!
  fixed_agent "$dir" $lost "" "$tier" "$nnodes"
  local lost_pid=$!
  wait_until 60 compgen -G "$dir/ckpt/step-*[0-9]" >/dev/null || { echo "no checkpoint" >&2; return 1; }
  local victim what="agent SIGKILLed"
  victim=$(cluster_agent node$lost "$demo")
  [[ -n $victim ]] || { echo "no agent on node$lost" >&2; return 1; }
  [[ $how == power ]] && victim=host:$lost what="host powered off"
  # shellcheck disable=SC2317  # run by kill_and_measure, right after the kill
  replacement() {
    # A new host takes the name and address once node 2 found node 0's store
    # silent (were it there at once, its kernel would refuse node 2's next
    # packet, and the loss would be known as for a kill).
    if [[ $how == power ]]; then
      wait_until 60 grep -q "node 0's store at .* does not answer" "$dir/node$kept.log" &&
        cluster_new_host node$lost || return 1
    fi
    fixed_agent "$dir" $lost .replacement "$tier" "$nnodes"
    replacement_pid=$!
  }
  ((lost == 1)) && rank0=$dir/node1.replacement.log
  kill_and_measure "$victim" "$dir/node$kept.log" "$dir/samples" "$survivor" \
    "2 nodes x 2 ($kind, ZeRO-1), node $lost's $what and replaced, $tier" replacement \
    "$rank0" || return 1
  wait "$replacement_pid" ||
    { echo "the replacement failed (see $dir/node$lost.replacement.log)" >&2; return 1; }
  if [[ $how == power ]]; then
    kill -KILL $frozen 2>/dev/null
    wait "$lost_pid" 2>/dev/null || true  # killed: 137
  fi
}

echo "bench/recovery.sh: $(nproc) cores, median of $runs runs, milliseconds"
tiers=(disk memory)
for tier in "${tiers[@]}"; do
  for ((r = 0; r < runs; ++r)); do one_node "$r" "$tier" || exit 1; done
done
cluster=yes
if [[ $(id -u) -ne 0 ]] || ! command -v ip >/dev/null; then
  cluster="skipped (needs root and ip for the simulated cluster)"
else
  # shellcheck source=../tests/cluster/cluster.sh
  source "$root/tests/cluster/cluster.sh"
  cluster_exit_hook='rm -rf "$work"'
  cluster_up 2 1gbit
  for tier in "${tiers[@]}"; do
    for ((r = 0; r < runs; ++r)); do two_nodes "$r" "$tier" || exit 1; done
    for ((r = 0; r < runs; ++r)); do two_nodes "$r" "$tier" 1 || exit 1; done
    for ((r = 0; r < runs; ++r)); do replaced "$r" "$tier" 2 || exit 1; done
    for ((r = 0; r < runs; ++r)); do replaced "$r" "$tier" 1 || exit 1; done
    for ((r = 0; r < runs; ++r)); do replaced "$r" "$tier" 1 1:2 || exit 1; done
    for ((r = 0; r < runs; ++r)); do heartbeat=2 replaced "$r" "$tier" 1 2 power || exit 1; done
  done
fi

echo
echo "| setup | tier | detection | restart | load | first step | total | steps trained again |"
echo "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
for setup in "1 node x 4, a worker SIGKILLed" "2 nodes x 2 (elastic 1:2), node 2's agent SIGKILLed" \
  "2 nodes x 2 (elastic 1:2, ZeRO-1), node 2's agent SIGKILLed" \
  "2 nodes x 2 (fixed, ZeRO-1), node 2's agent SIGKILLed and replaced" \
  "2 nodes x 2 (fixed, ZeRO-1), node 1's agent SIGKILLed and replaced" \
  "2 nodes x 2 (elastic 1:2, ZeRO-1), node 1's agent SIGKILLed and replaced" \
  "2 nodes x 2 (fixed, ZeRO-1), node 1's host powered off and replaced"; do
  for tier in "${tiers[@]}"; do
    [[ -n ${results[$setup, $tier]:-} ]] || { echo "| $setup | $tier | $cluster | | | | | |"; continue; }
    IFS=';' read -r -a rows <<<"${results[$setup, $tier]}"
    cols=()
    for c in 0 1 2 3 5 4; do
      vals=()
      for row in "${rows[@]}"; do
        read -r -a f <<<"$row"
        if ((c == 5)); then vals+=($((f[0] + f[1] + f[2] + f[3]))); else vals+=("${f[$c]}"); fi
      done
      cols+=("$(median "${vals[@]}")")
    done
    echo "| $setup | $tier | ${cols[0]} | ${cols[1]} | ${cols[2]} | ${cols[3]} | ${cols[4]} | ${cols[5]} |"
  done
done
