#!/usr/bin/env bash
# bench/failure_to_exit.sh [BUILD_DIR]: how long a job takes to end after one
# of its ranks fails, or after a node agent is SIGKILLed (issue 13). Jobs of 4
# ranks of tests/peers/run_peer.cpp on this machine; the survivors wait in a
# barrier or a collective. Prints one table row per way of running a job: the
# median and the worst of RUNS runs (default 3), in seconds, from the failure
# (the failing rank's own timestamp, or the kill) to the end of the job (the
# launcher exits, or for a killed single agent, its last worker is gone and
# reaped: `kill -0` sees a zombie until whoever adopted it reaps it).
# Figures, not a test: the machine is shared and noisy.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
build=$(cd "${1:-$root/build}" && pwd) || exit 2
peer=$build/tests/dtrain_run_peer
[[ -x $peer ]] || { echo "failure_to_exit.sh: build dtrain_run_peer first" >&2; exit 2; }
runs=${RUNS:-3}
# Two agents form a multi-node job: they share a store token, as on a cluster.
export DTRAIN_STORE_TOKEN=${DTRAIN_STORE_TOKEN:-failure-bench-secret}
work=$(mktemp -d "${TMPDIR:-/tmp}/dtrain-failure.XXXXXX")
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
mpi() { OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpiexec --oversubscribe "$@"; }
now_ms() { date +%s%3N; }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
failed_at() { sed -nE 's/.*peer rank [0-9]+ fails at ([0-9]+) ms.*/\1/p' "$1" | head -1; }
wait_files() { for _ in $(seq 600); do (($(ls "$1" | wc -l) >= $2)) && return 0; sleep 0.05; done; return 1; }
wait_gone() {
  while :; do
    local alive=0
    for f in "$1"/*.pid; do kill -0 "$(cat "$f")" 2>/dev/null && alive=1; done
    ((alive == 0)) && return 0
    sleep 0.01
  done
}

# One run of each scenario prints the seconds from the failure to the end of the job.
scenario() {
  local port
  port=$(free_port)
  rm -rf "$work/pids" && mkdir "$work/pids"
  case $1 in
  mpirun-mpi)
    (unset MASTER_ADDR MASTER_PORT; mpi -np 4 "$peer" process-mpi --fail-rank 1 >/dev/null 2>"$work/err")
    ;;
  mpirun-gloo)
    mpi -np 4 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT="$port" "$peer" process-gloo --fail-rank 1 >/dev/null 2>"$work/err"
    ;;
  agent)
    "$peer" node-gloo --nproc-per-node 4 --fail-rank 1 >/dev/null 2>"$work/err"
    ;;
  agents2)
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$peer" node-gloo --nproc-per-node 2 --nnodes 2 --node-rank 1 --fail-rank 3 >/dev/null 2>"$work/err1" &
    local n1=$!
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$peer" node-gloo --nproc-per-node 2 --nnodes 2 --node-rank 0 --fail-rank 3 >/dev/null 2>"$work/err"
    wait $n1
    cat "$work/err1" >>"$work/err"
    ;;
  agent-killed)
    "$peer" node-gloo --nproc-per-node 4 --hang "$work/pids" >/dev/null 2>"$work/err" &
    local agent=$!
    wait_files "$work/pids" 4
    local t0
    t0=$(now_ms)
    kill -KILL $agent
    wait $agent 2>/dev/null
    wait_gone "$work/pids"
    echo "scale=2; ($(now_ms) - $t0) / 1000" | bc
    return
    ;;
  agents2-killed)
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$peer" node-gloo --nproc-per-node 2 --nnodes 2 --node-rank 0 --hang "$work/pids" >/dev/null 2>"$work/err" &
    local n0=$!
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port "$peer" node-gloo --nproc-per-node 2 --nnodes 2 --node-rank 1 --hang "$work/pids" >/dev/null 2>/dev/null &
    local n1=$!
    wait_files "$work/pids" 4
    local t0
    t0=$(now_ms)
    kill -KILL $n1
    wait $n1 2>/dev/null
    wait $n0 2>/dev/null
    wait_gone "$work/pids"
    echo "scale=2; ($(now_ms) - $t0) / 1000" | bc
    return
    ;;
  esac
  local end t0
  end=$(now_ms)
  t0=$(failed_at "$work/err")
  [[ -n $t0 ]] || { echo "?"; return; }
  echo "scale=2; ($end - $t0) / 1000" | bc
}

printf '| job (4 ranks) | what fails | median s | worst s | runs |\n| --- | --- | --- | --- | --- |\n'
row() {  # row <scenario> <job> <what>
  local times=()
  for ((i = 0; i < runs; ++i)); do times+=("$(scenario "$1")"); done
  local sorted
  sorted=$(printf '%s\n' "${times[@]}" | sort -n)
  printf '| %s | %s | %s | %s | %s |\n' "$2" "$3" "$(sed -n "$(((runs + 1) / 2))p" <<<"$sorted")" \
    "$(tail -1 <<<"$sorted")" "$runs"
}
row mpirun-mpi "mpirun -np 4, backend::mpi" "rank 1 returns 3"
row mpirun-gloo "mpirun -np 4, backend::gloo" "rank 1 returns 3"
row agent "one agent, --nproc-per-node 4" "rank 1 returns 3"
row agents2 "2 agents (--nnodes 2) x 2" "rank 3 (node 1) returns 3"
row agent-killed "one agent, --nproc-per-node 4" "the agent is SIGKILLed (until its workers are gone)"
row agents2-killed "2 agents (--nnodes 2) x 2" "node 1's agent is SIGKILLed (until node 0 exits)"
