#!/usr/bin/env bash
# The launch tests (issue 5): node agents, dtrun and dtrain::run, driven as a
# user would drive them. One case per CTest test:
#   PEER=... DTRUN=... WHOAMI=... MPIEXEC=... bash cases.sh <case>
# PEER is dtrain_run_peer (tests/peers/run_peer.cpp). Every wait here is
# bounded; CTest's TIMEOUT bounds the whole case.
set -uo pipefail

case_name=${1:?usage: cases.sh <case>}
# Jobs of several nodes need a shared store token, as on a real cluster (README, "Security").
export DTRAIN_STORE_TOKEN=launch-tests-secret
work=$(mktemp -d "${TMPDIR:-/tmp}/dtrain-launch.XXXXXX")
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT

fail() {
  echo "FAIL: $*" >&2
  for f in "$work"/*.out "$work"/*.err; do
    [[ -s $f ]] && { echo "--- $f" >&2; cat "$f" >&2; }
  done
  exit 1
}
expect_status() {  # expect_status <want> <got> <what>
  [[ $2 == "$1" ]] || fail "$3 exited with status $2, expected $1"
}
expect_line() {  # expect_line <file> <extended regex> <what>
  grep -Eq -- "$2" "$1" || fail "$3: no line matching /$2/ in $1"
}
count_lines() { grep -Ec -- "$2" "$1" || true; }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
mpi() { OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "$MPIEXEC" --oversubscribe "$@"; }

# Waits (at most 60 s) until <dir> holds <n> pid files; prints nothing.
wait_for_pids() {
  for _ in $(seq 600); do
    (($(ls "$1" 2>/dev/null | wc -l) >= $2)) && return 0
    sleep 0.1
  done
  fail "only $(ls "$1" | wc -l) of $2 workers wrote their pid file"
}
# Fails when a process whose pid is in <dir> is still alive after 10 s.
expect_all_gone() {
  for _ in $(seq 100); do
    local alive=0
    for f in "$1"/*.pid; do
      kill -0 "$(cat "$f")" 2>/dev/null && alive=1
    done
    ((alive == 0)) && return 0
    sleep 0.1
  done
  fail "workers still alive: $(for f in "$1"/*.pid; do kill -0 "$(cat "$f")" 2>/dev/null && echo "$(basename "$f" .pid)"; done | xargs)"
}
# start_two_hanging_agents <heartbeat s>: node 0 (grace period 100 s, ended by `timeout` after 60 s)
# and node 1, one hanging worker each (their pids in $work/pids); sets n0 and n1.
start_two_hanging_agents() {
  mkdir "$work/pids"
  local port
  port=$(free_port)
  export MASTER_ADDR=127.0.0.1 MASTER_PORT=$port DTRAIN_HEARTBEAT_TIMEOUT=$1
  timeout 60 "$PEER" node-gloo --nproc-per-node 1 --nnodes 2 --node-rank 0 --grace-period 100 --hang "$work/pids" >"$work/n0.out" 2>"$work/n0.err" &
  n0=$!
  "$PEER" node-gloo --nproc-per-node 1 --nnodes 2 --node-rank 1 --hang "$work/pids" >"$work/n1.out" 2>"$work/n1.err" &
  n1=$!
  wait_for_pids "$work/pids" 2
}
# One `peer {...}` line per rank with the expected placement: check_world <file> <world size> <nproc>
check_world() {
  local file=$1 size=$2 nproc=$3
  for ((r = 0; r < size; ++r)); do
    expect_line "$file" "^peer \{\"rank\":$r,\"world_size\":$size,\"local_rank\":$((r % nproc)),\"local_world_size\":$nproc,\"node_rank\":$((r / nproc)),\"num_nodes\":$((size / nproc))," "rank $r's world"
    expect_line "$file" "^peer rank $r done sum=$((size * (size + 1) / 2))$" "rank $r's barrier and allreduce"
  done
}

# A job of agents on this host with a restart left, each running one shell worker that writes
# its pid to $work/pids/r<round>.<rank>.pid, hangs in round 0, and in a later round waits $1
# seconds and says "rank R done in round K of world W". Sets port; then
# `restart_job_agent <nnodes> <node rank> [VAR=value...]`, started with & (it execs: $! is
# dtrun's pid), starts one agent (--nnodes as given: N, or MIN:MAX), with those variables in
# its environment.
restart_job() {
  mkdir "$work/pids"
  port=$(free_port)
  export PIDS="$work/pids" ROUND_SLEEP=$1
}
restart_job_agent() {
  local nnodes=$1 rank=$2
  shift 2
  exec env "$@" "$DTRUN" --nnodes "$nnodes" --node-rank "$rank" --max-restarts 1 --grace-period 1 \
    --master-addr 127.0.0.1 --master-port "$port" -- sh -c 'echo $$ >"$PIDS/r$TORCHELASTIC_RESTART_COUNT.$RANK.pid"
if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then exec sleep 60; fi
sleep "$ROUND_SLEEP"; echo "rank $RANK done in round $TORCHELASTIC_RESTART_COUNT of world $WORLD_SIZE"'
}

# replace_node0 <nnodes> <agents> [VAR=value...]: a restart_job of <agents> agents (--nnodes as
# given); node 0's agent is SIGKILLed while every worker hangs in round 0, every other agent says
# that it waits for an agent in node 0's place (the job then going on with round 1), every round-0
# worker is gone, a new agent with --node-rank 0 comes (n0b), and every agent ends 0, each node's
# worker having said that it is done in round 1 of the whole world.
replace_node0() {
  local nnodes=$1 agents=$2 n
  shift 2
  restart_job 0
  local pids=()
  for ((n = 0; n < agents; ++n)); do
    restart_job_agent "$nnodes" $n "$@" >"$work/n$n.out" 2>"$work/n$n.err" &
    pids+=($!)
  done
  wait_for_pids "$work/pids" "$agents"
  kill -KILL "${pids[0]}"
  wait "${pids[0]}" 2>/dev/null
  for ((n = 1; n < agents; ++n)); do
    for _ in $(seq 300); do
      grep -q "waiting for an agent to take the place of node 0" "$work/n$n.err" && break
      sleep 0.1
    done
    expect_line "$work/n$n.err" "node 0's agent is gone, and with it the store at 127\.0\.0\.1:$port \(.*\): this node's workers are stopped; waiting for an agent to take the place of node 0 \(start one there or on another host with that address, with --node-rank 0\), at most the store timeout \(DTRAIN_STORE_TIMEOUT\); the job then goes on with round 1 \(restart 1 of 1\)" "node $n's call for a replacement of node 0"
  done
  # Round 0's workers are gone on every node (node 0's with its agent: its warden).
  expect_all_gone "$work/pids"
  restart_job_agent "$nnodes" 0 "$@" >"$work/n0b.out" 2>"$work/n0b.err" &
  wait $!
  expect_status 0 $? "the agent that took node 0's place"
  for ((n = 1; n < agents; ++n)); do
    wait "${pids[n]}"
    expect_status 0 $? "node $n's agent"
  done
  local want="" out
  for ((n = 0; n < agents; ++n)); do
    out=$work/n$n.out
    ((n == 0)) && out=$work/n0b.out
    expect_line "$out" "^rank $n done in round 1 of world $agents$" "node $n's worker in round 1"
    want+="r0.$n.pid "
  done
  for ((n = 0; n < agents; ++n)); do want+="r1.$n.pid "; done
  [[ "$(ls "$work/pids" | xargs) " == "$want" ]] ||
    fail "workers started: $(ls "$work/pids" | xargs), expected $want"
  expect_all_gone "$work/pids"
}

case $case_name in
two_nodes)
  # Two agents on this machine playing nodes 0 and 1 of one job, 2 workers each.
  port=$(free_port)
  export MASTER_ADDR=127.0.0.1 MASTER_PORT=$port
  "$PEER" node-gloo --nproc-per-node 2 --nnodes 2 --node-rank 1 >"$work/n1.out" 2>"$work/n1.err" &
  n1=$!
  "$PEER" node-gloo --nproc-per-node 2 --nnodes 2 --node-rank 0 >"$work/n0.out" 2>"$work/n0.err"
  expect_status 0 $? "node 0's agent"
  wait $n1
  expect_status 0 $? "node 1's agent"
  cat "$work/n0.out" "$work/n1.out" >"$work/all.out"
  check_world "$work/all.out" 4 2
  [[ $(count_lines "$work/n0.out" '^peer \{"rank":[01],') == 2 ]] || fail "node 0 did not run ranks 0 and 1"
  ;;

nproc_from_argv)
  # dtrain::run reads --nproc-per-node from argv when run_options leave it unset
  # (the peer's --nproc-from-argv); DTRAIN_NPROC_PER_NODE wins over both; a bad
  # value is a config error naming the flag. Workers see argv unchanged.
  "$PEER" node-gloo --nproc-from-argv --nproc-per-node 3 >"$work/a.out" 2>"$work/a.err"
  expect_status 0 $? "--nproc-per-node 3"
  check_world "$work/a.out" 3 3
  "$PEER" node-gloo --nproc-from-argv --nproc_per_node=2 >"$work/b.out" 2>"$work/b.err"
  expect_status 0 $? "--nproc_per_node=2"
  check_world "$work/b.out" 2 2
  DTRAIN_NPROC_PER_NODE=1 "$PEER" node-gloo --nproc-from-argv --nproc-per-node=3 >"$work/c.out" 2>"$work/c.err"
  expect_status 0 $? "DTRAIN_NPROC_PER_NODE=1 with --nproc-per-node=3"
  check_world "$work/c.out" 1 1
  # run_options (the peer's own --nproc-per-node 2) win over a later --nproc_per_node=3.
  "$PEER" node-gloo --nproc-per-node 2 --nproc_per_node=3 >"$work/e.out" 2>"$work/e.err"
  expect_status 0 $? "run_options 2 with --nproc_per_node=3"
  check_world "$work/e.out" 2 2
  "$PEER" node-gloo --nproc-from-argv --nproc-per-node=x >"$work/d.out" 2>"$work/d.err"
  expect_status 2 $? "--nproc-per-node=x"
  expect_line "$work/d.err" '^\[agent\] dtrain: --nproc-per-node=x on the command line is not a number of workers, gpu, cpu or auto$' "the bad flag's message"
  ;;

worker_fails)
  # Rank 1 exits 3; the others hang ignoring SIGTERM, so the agent must SIGKILL them after the grace period.
  mkdir "$work/pids"
  "$PEER" node-gloo --nproc-per-node 3 --fail-rank 1 --hang "$work/pids" --ignore-term --grace-period 1 \
    >"$work/agent.out" 2>"$work/agent.err"
  expect_status 3 $? "the agent"
  expect_line "$work/agent.err" '^\[dtrain agent node 0/1\] rank 1 \(node 0, local rank 1, pid [0-9]+\) exited with status 3; ending the job' "the agent's message"
  [[ $(ls "$work/pids" | wc -l) == 2 ]] || fail "expected ranks 0 and 2 to have started hanging"
  expect_all_gone "$work/pids"
  ;;

exited_early)
  # Rank 1 leaves after the barrier with status 0, one collective short (as a rank that skipped a
  # backward()); ranks 0 and 2 then fail in the allreduce it never joined. The agent names rank 1
  # first, not the rank that waited for it.
  DTRAIN_COLLECTIVE_TIMEOUT=5 DTRAIN_DIAGNOSTICS_WAIT=2 "$PEER" node-gloo --nproc-per-node 3 --skip-rank 1 \
    >"$work/agent.out" 2>"$work/agent.err"
  expect_status 1 $? "the agent"
  expect_line "$work/agent.out" '^peer rank 1 skips the allreduce$' "rank 1's early exit"
  expect_line "$work/agent.err" '^\[dtrain agent node 0/1\] rank 1 \(node 0, local rank 1, pid [0-9]+\) exited with status 0 after [0-9]+ collectives? while rank [02] waited in collective #[0-9]+; then rank [02] \(node 0, local rank [02], pid [0-9]+\) exited with status 1: .+; ending the job' "the agent's summary"
  ;;

program_flags)
  # A self-launching program reads dtrun's flags from its own command line (the peer's
  # --agent-flags-from-argv leaves them out of run_options): a bad value is an error naming it,
  # exit 2; --max-restarts and --master-port are obeyed; the program's own flags (--fail-rank ...)
  # pass through to the workers.
  "$PEER" node-gloo --agent-flags-from-argv --nproc-per-node 2 --master-port 70000 >"$work/bad.out" 2>"$work/bad.err"
  expect_status 2 $? "--master-port 70000"
  expect_line "$work/bad.err" '^\[agent\] dtrain: --master-port=70000 on the command line is outside the port range 1-65535$' "the bad flag's message"
  "$PEER" node-gloo --agent-flags-from-argv --nproc-per-node 2 --max-restarts 1 --fail-rank 1 --fail-restarts 1 \
    >"$work/restart.out" 2>"$work/restart.err"
  expect_status 0 $? "--nproc-per-node 2 --max-restarts 1"
  expect_line "$work/restart.err" 'rank 1 \(node 0, local rank 1, pid [0-9]+\) exited with status 3; restarting every node.s workers \(restart 1 of 1\)' "the restart"
  check_world "$work/restart.out" 2 2
  [[ $(count_lines "$work/restart.out" ' restart=1$') == 2 ]] || fail "the restart did not start 2 workers"
  port=$(free_port)
  "$PEER" node-gloo --agent-flags-from-argv --nproc_per_node=2 --master-port="$port" --tee >"$work/port.out" 2>"$work/port.err"
  expect_status 0 $? "--master-port=$port --tee"
  expect_line "$work/port.err" "^\[dtrain agent node 0/1\] node 0 of 1, 2 workers, store at 127\.0\.0\.1:$port$" "the store on --master-port"
  [[ $(count_lines "$work/port.out" '^\[rank [01]\] peer rank [01] done sum=3$') == 2 ]] || fail "--tee did not prefix the workers' lines"
  ;;

agent_failure_paths)
  # The agent's ways out other than the end of a round, under AddressSanitizer and UBSan
  # (DTRUN_ASAN: dtrun built with them). Each must end with its status and message, stop the
  # workers, and print the workers' output once and whole, before the agent's last line.
  export ASAN_OPTIONS=exitcode=86:detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:exitcode=86:print_stacktrace=1
  no_sanitizer_report() {
    ! grep -Eq 'AddressSanitizer|LeakSanitizer|runtime error:' "$1" || fail "a sanitizer report in $1"
  }
  # A round whose program cannot be started (the exception leaves run() through its catch).
  "$DTRUN_ASAN" --tee --nproc-per-node 2 -- /nonexistent/program >"$work/missing.out" 2>"$work/missing.err"
  expect_status 127 $? "dtrun -- /nonexistent/program"
  [[ $(count_lines "$work/missing.err" 'cannot run') == 1 ]] || fail "the missing program was not named once"
  no_sanitizer_report "$work/missing.err"
  # A failing round with --tee: a grandchild outside the workers' groups (setsid) holds their
  # output open, so only the round's end drains it. Every line once, the unfinished last one
  # too, and all before the agent's summary. Rank 1 fails once rank 0 has printed its lines.
  mkdir "$work/pids"
  export PIDS="$work/pids"
  "$DTRUN_ASAN" --tee --grace-period 1 --nproc-per-node 2 -- sh -c '
    setsid sleep 30 & echo $! >"$PIDS/setsid$RANK.pid"
    echo "first line of $RANK"; printf "last words of $RANK"
    [ "$RANK" = 0 ] && { touch "$PIDS/printed"; exec sleep 30; }
    for _ in $(seq 600); do [ -e "$PIDS/printed" ] && break; sleep 0.1; done
    exit 3' >"$work/tee.all" 2>&1
  expect_status 3 $? "dtrun whose workers exit 3"
  for f in "$work"/pids/setsid*.pid; do kill "$(cat "$f")" 2>/dev/null; done
  for r in 0 1; do
    [[ $(count_lines "$work/tee.all" "^\[rank $r\] first line of $r$") == 1 ]] || fail "rank $r's first line is not there once"
    [[ $(count_lines "$work/tee.all" "^\[rank $r\] last words of $r$") == 1 ]] || fail "rank $r's last words are not there once, whole"
  done
  summary=$(grep -n 'rank 1 .* exited with status 3; ending the job' "$work/tee.all" | cut -d: -f1)
  [[ -n $summary ]] || fail "no summary line"
  last=$(grep -n '^\[rank [01]\] ' "$work/tee.all" | tail -1 | cut -d: -f1)
  ((last < summary)) || fail "a worker's line came after the agent's summary"
  no_sanitizer_report "$work/tee.all"
  # A signal during a wait: node 1 of a 3-node job waits for node 2, which never comes.
  port=$(free_port)
  "$DTRUN" --nnodes 3 --node-rank 0 --master-addr 127.0.0.1 --master-port "$port" -- true >"$work/n0.out" 2>"$work/n0.err" &
  n0=$!
  "$DTRUN_ASAN" --nnodes 3 --node-rank 1 --master-addr 127.0.0.1 --master-port "$port" --tee -- true >"$work/n1.out" 2>"$work/n1.err" &
  n1=$!
  for _ in $(seq 600); do
    grep -q 'store at' "$work/n1.err" && break
    sleep 0.1
  done
  kill -TERM $n1  # its handler is in place once it has printed where the store is
  wait $n1
  expect_status 143 $? "node 1's dtrun after SIGTERM"
  expect_line "$work/n1.err" '^\[dtrain agent node 1/3\] received signal 15; stopped this node.s workers$' "node 1's message"
  no_sanitizer_report "$work/n1.err"
  kill -KILL $n0
  wait $n0 2>/dev/null
  # The store lost: node 0's agent is SIGKILLed while node 1's workers run.
  rm -f "$work"/pids/*
  port=$(free_port)
  # Node 1 finds nothing listening at the store's address and gives up at once (not after
  # DTRAIN_STORE_IO_TIMEOUT, long here: it would knock again only at a store that still listens);
  # with no restart left, it does not wait for an agent to take node 0's place (node0_replaced).
  "$DTRUN" --nnodes 2 --node-rank 0 --master-addr 127.0.0.1 --master-port "$port" -- sh -c 'echo $$ >"$PIDS/$RANK.pid"; exec sleep 60' \
    >"$work/s0.out" 2>"$work/s0.err" &
  s0=$!
  DTRAIN_STORE_IO_TIMEOUT=60 "$DTRUN_ASAN" --nnodes 2 --node-rank 1 --master-addr 127.0.0.1 --master-port "$port" -- sh -c 'echo $$ >"$PIDS/$RANK.pid"; exec sleep 60' \
    >"$work/s1.out" 2>"$work/s1.err" &
  s1=$!
  wait_for_pids "$work/pids" 2
  kill -KILL $s0
  wait $s0 2>/dev/null
  wait $s1
  expect_status 1 $? "node 1's dtrun after node 0's agent died"
  expect_line "$work/s1.err" '^\[dtrain agent node 1/2\] lost the rendezvous store \(node 0.s agent\) at 127\.0\.0\.1:[0-9]+: .*; no restart is left to wait for an agent to take node 0.s place \(restarts used: 0 of 0\)$' "node 1's message"
  expect_all_gone "$work/pids"
  no_sanitizer_report "$work/s1.err"
  ;;

worker_throws)
  # A dtrain worker records why it failed before it exits: the agent names it and its reason,
  # not the peer whose connection it closed.
  "$PEER" node-gloo --nproc-per-node 3 --throw-rank 2 >"$work/agent.out" 2>"$work/agent.err"
  expect_status 1 $? "the agent"
  expect_line "$work/agent.err" '^\[rank 2/3\] dtrain: peer failure on purpose$' "the worker's own line"
  expect_line "$work/agent.err" '^\[dtrain agent node 0/1\] rank 2 \(node 0, local rank 2, pid [0-9]+\) exited with status 1: peer failure on purpose; ending the job' "the agent's message"
  ;;

quiet_store)
  # A rank that exits while it waits on the store, as its diagnostics do when the agent ends the
  # job after a clean error on another rank, is no news: the store reports a connection that breaks,
  # not one closed in good order ("client ... disconnected while waiting for ..." was noise).
  for i in 1 2; do  # rank 1 throws; rank 0 is often ended while its diagnostics wait for rank 1
    "$PEER" node-gloo --nproc-per-node 2 --throw-rank 1 >"$work/throw$i.out" 2>"$work/throw$i.err"
    expect_status 1 $? "the agent of a job whose rank 1 throws"
    expect_line "$work/throw$i.err" '^\[rank 1/2\] dtrain: peer failure on purpose$' "the worker's own line"
  done
  # Always: rank 1 frozen, SIGUSR1 makes rank 0's diagnostics wait for rank 1's ring, the job ends.
  mkdir "$work/pids"
  DTRAIN_DIAGNOSTICS_WAIT=60 "$PEER" node-gloo --nproc-per-node 2 --hang "$work/pids" --grace-period 1 \
    >"$work/stop.out" 2>"$work/stop.err" &
  agent=$!
  wait_for_pids "$work/pids" 2
  kill -STOP "$(cat "$work/pids/1.pid")"
  kill -USR1 "$(cat "$work/pids/0.pid")"
  sleep 1  # rank 0's diagnostics thread opens a round and waits for rank 1's ring
  kill -TERM "$agent"
  wait $agent
  expect_status 143 $? "the agent after SIGTERM"
  expect_all_gone "$work/pids"
  if grep -h "disconnected while" "$work"/*.err; then
    fail "the store reported ranks that exited while they waited"
  fi
  ;;

remote_failure)
  # A worker of node 1 fails: node 0's agent notices, stops its own workers and exits with the same status.
  mkdir "$work/pids"
  port=$(free_port)
  export MASTER_ADDR=127.0.0.1 MASTER_PORT=$port
  "$PEER" node-gloo --nproc-per-node 2 --nnodes 2 --node-rank 0 --fail-rank 3 --fail-code 5 --hang "$work/pids" \
    >"$work/n0.out" 2>"$work/n0.err" &
  n0=$!
  "$PEER" node-gloo --nproc-per-node 2 --nnodes 2 --node-rank 1 --fail-rank 3 --fail-code 5 --hang "$work/pids" \
    >"$work/n1.out" 2>"$work/n1.err"
  expect_status 5 $? "node 1's agent"
  wait $n0
  expect_status 5 $? "node 0's agent"
  for n in 0 1; do
    expect_line "$work/n$n.err" "^\[dtrain agent node $n/2\] rank 3 \(node 1, local rank 1, pid [0-9]+\) exited with status 5; ending the job" "node $n's message"
  done
  expect_all_gone "$work/pids"
  ;;

restart)
  # Rank 1 fails on the first attempt only; max_restarts=1 completes the job, and the workers see restart=1.
  "$PEER" node-gloo --nproc-per-node 3 --fail-rank 1 --fail-restarts 1 --max-restarts 1 \
    >"$work/agent.out" 2>"$work/agent.err"
  expect_status 0 $? "the agent"
  expect_line "$work/agent.err" 'rank 1 \(node 0, local rank 1, pid [0-9]+\) exited with status 3; restarting every node.s workers \(restart 1 of 1\)' "the restart message"
  check_world "$work/agent.out" 3 3
  [[ $(count_lines "$work/agent.out" ' restart=0$') == 3 ]] || fail "the first attempt did not start 3 workers"
  [[ $(count_lines "$work/agent.out" ' restart=1$') == 3 ]] || fail "the restart did not start 3 workers"
  ;;

no_restarts_left)
  # The same failure on every attempt: after max_restarts=1 restart the agent gives up with the status.
  "$PEER" node-gloo --nproc-per-node 2 --fail-rank 0 --max-restarts 1 >"$work/agent.out" 2>"$work/agent.err"
  expect_status 3 $? "the agent"
  expect_line "$work/agent.err" 'rank 0 .* exited with status 3; ending the job \(restarts used: 1 of 1\)' "the final message"
  ;;

remote_agent_dies)
  # Node 1's agent is SIGKILLed while node 0's workers are busy: its lease on the store ends with
  # its connection, so node 0 knows at once (no heartbeat wait) and ends instead of waiting
  # forever. Node 0 does not wait for the lost agent to leave: with a grace period of 100 s it
  # would still be waiting when `timeout` ends it.
  start_two_hanging_agents 600
  kill -KILL $n1
  wait $n0
  expect_status 1 $? "node 0's agent"
  expect_line "$work/n0.err" "node 1's agent is gone: its connection to the store closed \(the agent was killed, or its host went away\); ending the job" "node 0's message"
  expect_all_gone "$work/pids"
  ;;

remote_agent_frozen)
  # Node 1's agent is frozen (SIGSTOP: its connection stays open, as a host that vanishes without
  # closing it): node 0 notices the missing heartbeat (DTRAIN_HEARTBEAT_TIMEOUT) and ends.
  start_two_hanging_agents 2
  kill -STOP $n1
  wait $n0
  status=$?
  kill -KILL $n1
  wait $n1 2>/dev/null
  expect_status 1 $status "node 0's agent"
  expect_line "$work/n0.err" "node 1's agent stopped responding: no heartbeat for 2 s \(DTRAIN_HEARTBEAT_TIMEOUT\); ending the job" "node 0's message"
  expect_all_gone "$work/pids"
  ;;

replaced_agent_wakes)
  # A fixed job of 3 nodes with a restart left. Node 1's agent is frozen (SIGSTOP, its connection
  # open): node 2 finds it silent (node 0's heartbeat timeout is long: it does not), and every
  # agent, node 0 among them, names node 1 as the one to replace; an agent started with
  # --node-rank 1 takes its place, and the next round runs with it. Then the frozen agent wakes
  # (SIGCONT): it must find its place taken, stop its worker and leave with status 1, touching
  # nothing of the job, which ends 0.
  restart_job 4
  agent() { restart_job_agent 3 "$1" DTRAIN_HEARTBEAT_TIMEOUT="$2"; }  # agent <node rank> <heartbeat timeout>
  agent 0 60 >"$work/n0.out" 2>"$work/n0.err" &
  n0=$!
  agent 1 2 >"$work/n1.out" 2>"$work/n1.err" &
  n1=$!
  agent 2 2 >"$work/n2.out" 2>"$work/n2.err" &
  n2=$!
  wait_for_pids "$work/pids" 3
  kill -STOP $n1
  for _ in $(seq 300); do
    grep -q "waiting for an agent to take the place of node 1" "$work/n0.err" && break
    sleep 0.1
  done
  expect_line "$work/n0.err" "node 1's agent stopped responding: no heartbeat for 2 s \(DTRAIN_HEARTBEAT_TIMEOUT\); restarting every node's workers \(restart 1 of 1\)" "node 0's message"
  # A silent node, too, is named as one to replace (its connection is open: its lease holds),
  # by node 0 as well, which did not find it silent itself.
  expect_line "$work/n0.err" "waiting for an agent to take the place of node 1 \(start one there or on another host, with --node-rank 1\)" "node 0's call for a replacement"
  agent 1 2 >"$work/n1b.out" 2>"$work/n1b.err" &
  n1b=$!
  wait_for_pids "$work/pids" 6  # round 1's workers: nodes 0 and 2's, and the replacement's
  expect_line "$work/n2.err" "waiting for an agent to take the place of node 1 " "node 2's call for a replacement"
  kill -CONT $n1
  wait $n1
  expect_status 1 $? "the frozen agent, once awake"
  expect_line "$work/n1.err" "node 1's place was taken by the agent [^ ]+ while this agent \([^)]+\) did not respond \(frozen, or cut off from the store\): the job goes on with that agent, and this one stops its workers and leaves" "the frozen agent's message"
  # Nothing else: it did not go on to the next round, nor start a worker there.
  [[ $(wc -l <"$work/n1.err") == 1 ]] || fail "the frozen agent said more than that once awake"
  [[ -s $work/n1.out ]] && fail "the frozen agent started workers after it woke: $(cat "$work/n1.out")"
  wait $n0
  expect_status 0 $? "node 0's agent"
  wait $n2
  expect_status 0 $? "node 2's agent"
  wait $n1b
  expect_status 0 $? "the replacement"
  expect_line "$work/n1b.err" "takes the place of node 1's agent, which is gone: waiting for round 0 to end" "the replacement's message"
  expect_line "$work/n0.out" "^rank 0 done in round 1 of world 3$" "node 0's worker"
  expect_line "$work/n1b.out" "^rank 1 done in round 1 of world 3$" "the replacement's worker"
  expect_line "$work/n2.out" "^rank 2 done in round 1 of world 3$" "node 2's worker"
  [[ $(ls "$work/pids" | wc -l) == 6 ]] || fail "workers started: $(ls "$work/pids" | xargs), expected r0.0-2 and r1.0-2"
  expect_all_gone "$work/pids"
  ;;

node0_replaced)
  # A fixed job of 3 nodes with a restart left. Node 0's agent, which serves the store, is
  # SIGKILLed while every node's worker runs: nodes 1 and 2 find the store gone at once (not
  # after DTRAIN_STORE_IO_TIMEOUT, 100 s here), stop their workers and wait for an agent to take
  # node 0's place. One started with --node-rank 0 at the same address serves a new store; the
  # others join it, and the job goes on with round 1 (its restart), which ends 0.
  replace_node0 3 3 DTRAIN_STORE_IO_TIMEOUT=100
  expect_line "$work/n0b.err" "takes the place of node 0's agent, which is gone \(with its store\): the other nodes' agents came back from round 0, and the job goes on with round 1 \(restart 1 of 1\)" "the new node 0's message"
  ;;

elastic_node0_replaced)
  # The same in an elastic job (--nnodes 1:2): node 1 joins the new store, raising the newest
  # round to the one it ran; the new node 0, which knew no round, passes round 0 over and forms
  # round 1 of both nodes.
  replace_node0 1:2 2
  expect_line "$work/n0b.err" "the other nodes' agents came back from round 0 \(node 0's agent, and its store, were replaced\): the rounds go on from there" "the new node 0's message"
  expect_line "$work/n0b.err" "round 1: nodes 0, 1 \(2 of at most 2\), 2 workers" "the new node 0's round"
  ;;

remote_agent_fails)
  # Node 1's agent cannot start its workers: node 0 ends with node 1's reason.
  port=$(free_port)
  "$DTRUN" --nnodes 2 --node-rank 0 --master-addr 127.0.0.1 --master-port "$port" -- sleep 60 >"$work/n0.out" 2>"$work/n0.err" &
  n0=$!
  "$DTRUN" --nnodes 2 --node-rank 1 --master-addr 127.0.0.1 --master-port "$port" -- /nonexistent/program >"$work/n1.out" 2>"$work/n1.err"
  expect_status 127 $? "node 1's dtrun"
  wait $n0
  expect_status 127 $? "node 0's dtrun"
  expect_line "$work/n0.err" "node 1's agent failed: cannot run \"/nonexistent/program\": no such file; ending the job" "node 0's message"
  ;;

grandchildren)
  # What a worker started dies with it: the agent stops each worker's process group.
  mkdir "$work/pids"
  export PIDS="$work/pids"
  "$DTRUN" --nproc-per-node 2 --grace-period 1 -- sh -c \
    'sleep 300 & echo $! >"$PIDS/$RANK.pid"; if [ "$RANK" = 1 ]; then sleep 0.5; exit 3; fi; wait' \
    >"$work/dtrun.out" 2>"$work/dtrun.err"
  expect_status 3 $? "dtrun"
  [[ $(ls "$work/pids" | wc -l) == 2 ]] || fail "the workers did not start their children"
  expect_all_gone "$work/pids"
  ;;

orphans)
  # Every worker starts `sleep 300`. After a job that succeeds, and after the agent is SIGKILLed
  # (PR_SET_PDEATHSIG reaches only the workers; the agent's warden reaches their process groups),
  # no sleep is left.
  mkdir "$work/ok" "$work/killed"
  "$PEER" node-gloo --nproc-per-node 2 --fork-child "$work/ok" >"$work/ok.out" 2>"$work/ok.err"
  expect_status 0 $? "the agent of a job whose workers leave children"
  [[ $(ls "$work/ok" | wc -l) == 2 ]] || fail "the workers did not start their children"
  expect_all_gone "$work/ok"
  "$PEER" node-gloo --nproc-per-node 2 --fork-child "$work/killed" --hang "$work/killed" >"$work/agent.out" 2>"$work/agent.err" &
  agent=$!
  wait_for_pids "$work/killed" 4
  kill -KILL "$agent"
  wait $agent
  expect_status 137 $? "the agent after SIGKILL"
  expect_all_gone "$work/killed"
  ;;

sigterm | sigkill)
  # SIGTERM is forwarded and ends the job with 143; after SIGKILL (137) PR_SET_PDEATHSIG ends the workers.
  mkdir "$work/pids"
  "$PEER" node-gloo --nproc-per-node 2 --hang "$work/pids" >"$work/agent.out" 2>"$work/agent.err" &
  agent=$!
  wait_for_pids "$work/pids" 2
  sig=$([[ $case_name == sigterm ]] && echo TERM || echo KILL)
  kill -"$sig" "$agent"
  wait $agent
  status=$?
  expect_status "$((128 + $(kill -l $sig)))" $status "the agent after SIG$sig"
  if [[ $sig == TERM ]]; then
    expect_line "$work/agent.err" "node 0's agent received signal 15" "the agent's message"
  fi
  expect_all_gone "$work/pids"
  ;;

dtrun_sigusr1)
  # SIGUSR1 to dtrun is forwarded to its workers and stops nothing: while rank 2
  # of dtrain_desync_peer (DESYNC) waits elsewhere and the others wait in a
  # bucket's allreduce, the workers print one desync table naming rank 2. The
  # job then ends as it would (the collective timeout, 8 s, is not reached before the signal).
  DTRAIN_COLLECTIVE_TIMEOUT=8 DTRAIN_DIAGNOSTICS_WAIT=3 "$DTRUN" --nproc-per-node 4 -- "$DESYNC" gloo skip \
    >"$work/dtrun.out" 2>"$work/dtrun.err" &
  agent=$!
  for _ in $(seq 600); do
    grep -q "skipped the last step" "$work/dtrun.err" && break
    sleep 0.1
  done
  expect_line "$work/dtrun.err" "skipped the last step" "rank 2 reaching its stall"
  kill -USR1 "$agent"
  wait $agent
  status=$?
  expect_status 1 $status "dtrun after SIGUSR1 and the timeout"
  expect_line "$work/dtrun.err" "forwarded SIGUSR1 to the workers" "the agent's message"
  expect_line "$work/dtrun.err" "collective diagnostics, round 1, after SIGUSR1 on rank [0-3]" "the table's header"
  expect_line "$work/dtrun.err" "^  rank 2 is at #[0-9]+ allreduce\(float32 .+ 262144, bucket 1\); ranks 0, 1, 3 wait in #[0-9]+ allreduce\(float32 .+ 65536, bucket 0\): rank 2 never started" "the table's finding"
  cat "$work/dtrun.err"
  ;;

dtrun_flight)
  # Rank 2 of dtrain_desync_peer (DESYNC) stops calling collectives (it sleeps past the timeout);
  # the others time out and print the live table. Under --log-dir every rank also writes its
  # flight record in logs/restart_0 (DTRAIN_DIAGNOSTICS_DIR); after the job, and its store, are
  # gone, dtrun --flight-records reads them and names the same rank, with the same summary.
  DTRAIN_COLLECTIVE_TIMEOUT=4 DTRAIN_DIAGNOSTICS_WAIT=3 "$DTRUN" --nproc-per-node 4 --log-dir "$work/logs" \
    -- "$DESYNC" gloo sleep >"$work/dtrun.out" 2>"$work/dtrun.err"
  expect_status 1 $? "dtrun"
  # The table is on the printing rank's stderr (and so in its log).
  live=$(cat "$work/dtrun.err" "$work"/logs/restart_0/rank_*.log |
    grep -E -A1 "collective diagnostics, round 1, after a (timeout|failed collective) on rank" | sed -n 2p)
  [[ $live == "  rank 2 is at #"*"rank 2 never started"* ]] || fail "the live table's summary: '$live'"
  records="$work/logs/restart_0"
  for r in 0 1 2 3; do
    [[ -s $records/dtrain_flight_rank$r.bin ]] || fail "no flight record of rank $r in $records"
  done
  "$DTRUN" --flight-records "$records" >"$work/flight.out" 2>"$work/flight.err"
  expect_status 0 $? "dtrun --flight-records"
  expect_line "$work/flight.out" "^dtrain: collective diagnostics from the flight records in $records, after a (timeout|failed collective) on rank [013][^(]*\(gloo, 4 ranks; records of ranks 0, 1, 2, 3, written " "the offline table's header"
  offline=$(sed -n 2p "$work/flight.out")
  [[ $offline == "$live" ]] || fail "the offline summary '$offline' is not the live one '$live'"
  # A record cut short is named and not used (exit 2); a directory without records is said so.
  truncate -s -5 "$records/dtrain_flight_rank2.bin"
  "$DTRUN" --flight-records "$records" >"$work/cut.out" 2>"$work/cut.err"
  expect_status 2 $? "dtrun --flight-records with a damaged record"
  expect_line "$work/cut.err" "^dtrun: $records/dtrain_flight_rank2.bin is not a whole dtrain flight record \([0-9]+ bytes\): .*; not used$" "the damaged record named"
  expect_line "$work/cut.out" "rank 2 did not answer" "the table without rank 2's record"
  mkdir "$work/empty"
  "$DTRUN" --flight-records "$work/empty" >"$work/empty.out" 2>"$work/empty.err"
  expect_status 2 $? "dtrun --flight-records on an empty directory"
  expect_line "$work/empty.err" "^dtrun: no flight record \(dtrain_flight_rank<R>.bin\) in $work/empty" "the empty directory named"
  cat "$work/flight.out"
  ;;

dtrun_exit)
  # Rank 2 of dtrain_desync_peer (DESYNC) skips the last step and returns 0, as a rank that skipped
  # a backward(); the others fail in the bucket's allreduce it never started. dtrun's summary
  # names rank 2 first, with how many collectives it issued, not the rank that waited for it.
  DTRAIN_COLLECTIVE_TIMEOUT=8 DTRAIN_DIAGNOSTICS_WAIT=3 "$DTRUN" --nproc-per-node 4 -- "$DESYNC" gloo exit \
    >"$work/dtrun.out" 2>"$work/dtrun.err"
  expect_status 1 $? "dtrun"
  expect_line "$work/dtrun.err" "skipped the last step; returning 0" "rank 2 leaving"
  expect_line "$work/dtrun.err" '^\[dtrain agent node 0/1\] rank 2 \(node 0, local rank 2, pid [0-9]+\) exited with status 0 after [0-9]+ collectives on communicator world/split 1 \(color 0\) while rank [013] waited in collective #[0-9]+; then rank [013] \(node 0, local rank [013], pid [0-9]+\) exited with status 1: ' "the agent's summary"
  ;;

local_rank_arg)
  # --pass-local-rank gives each worker --local_rank=N; whoami checks it against LOCAL_RANK (it exits 2 if they differ).
  "$DTRUN" --nproc-per-node 2 --pass-local-rank -- "$WHOAMI" >"$work/whoami.out" 2>"$work/whoami.err"
  expect_status 0 $? "dtrun running whoami"
  for r in 0 1; do
    expect_line "$work/whoami.out" "^\{\"rank\":$r,\"world_size\":2,\"local_rank\":$r,\"local_world_size\":2,\"node_rank\":0,\"num_nodes\":1,\"master_addr\":\"127.0.0.1\",\"master_port\":[0-9]+,\"source\":\"env\"\}$" "whoami of rank $r"
  done
  # A worker handed a --local_rank that contradicts LOCAL_RANK must refuse, naming both.
  LOCAL_RANK=1 RANK=1 WORLD_SIZE=2 "$WHOAMI" --local_rank=0 >"$work/bad.out" 2>"$work/bad.err"
  expect_status 2 $? "whoami with a contradicting --local_rank"
  expect_line "$work/bad.err" 'LOCAL_RANK=1' "the contradiction message"
  # The same through dtrain::run's agent (DTRAIN_LOCAL_RANK_ARG): the peers accept it and finish.
  DTRAIN_LOCAL_RANK_ARG=1 "$PEER" node-gloo --nproc-per-node 2 >"$work/peer.out" 2>"$work/peer.err"
  expect_status 0 $? "the agent with DTRAIN_LOCAL_RANK_ARG=1"
  check_world "$work/peer.out" 2 2
  ;;

tee_and_logs)
  "$DTRUN" --nproc-per-node 2 --tee --log-dir "$work/logs" -- "$PEER" process-gloo >"$work/dtrun.out" 2>"$work/dtrun.err"
  expect_status 0 $? "dtrun --tee --log-dir"
  for r in 0 1; do
    expect_line "$work/dtrun.out" "^\[rank $r\] peer rank $r done sum=3$" "rank $r's prefixed line"
    expect_line "$work/logs/restart_0/rank_$r.log" "^peer rank $r done sum=3$" "rank $r's log file"
  done
  [[ $(count_lines "$work/dtrun.out" '^\[rank [01]\] ') == $(wc -l <"$work/dtrun.out") ]] || fail "a line without a rank prefix"
  ;;

mpirun_per_node)
  # `mpirun --map-by ppr:1:node` on two nodes, simulated: two agents under mpirun, each told it is alone
  # on its node (and, as Open MPI 4 says on two hosts, that the job has 2 nodes). Node ranks come from
  # OMPI_COMM_WORLD_RANK.
  port=$(free_port)
  mpi -np 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=$port \
    sh -c 'OMPI_COMM_WORLD_LOCAL_SIZE=1 OMPI_COMM_WORLD_LOCAL_RANK=0 OMPI_MCA_orte_num_nodes=2 exec "$0" node-gloo --nproc-per-node 2' "$PEER" \
    >"$work/mpi.out" 2>"$work/mpi.err"
  expect_status 0 $? "mpirun of two agents"
  check_world "$work/mpi.out" 4 2
  ;;

process_mpi)
  # launch::per_process under mpirun without MASTER_ADDR: rank 0's store address travels over MPI.
  unset MASTER_ADDR MASTER_PORT
  mpi -np 3 "$PEER" process-mpi >"$work/mpi.out" 2>"$work/mpi.err"
  expect_status 0 $? "mpirun -np 3 of the MPI peer"
  check_world "$work/mpi.out" 3 3
  ;;

node_names)
  # Open MPI gives no node index: ranks are grouped by node name (here DTRAIN_NODE_NAME, as
  # `--map-by node` on two hosts would place them: even ranks on host a, odd ranks on host b; and
  # Open MPI 4 then says OMPI_MCA_orte_num_nodes=2).
  mpi -np 4 sh -c 'r=$OMPI_COMM_WORLD_RANK; DTRAIN_NODE_NAME=host$((r % 2)) OMPI_COMM_WORLD_LOCAL_RANK=$((r / 2)) OMPI_COMM_WORLD_LOCAL_SIZE=2 OMPI_MCA_orte_num_nodes=2 exec "$0" process-mpi' "$PEER" \
    >"$work/mpi.out" 2>"$work/mpi.err"
  expect_status 0 $? "mpirun of 4 ranks on two named nodes"
  for r in 0 1 2 3; do
    expect_line "$work/mpi.out" "^peer \{\"rank\":$r,\"world_size\":4,\"local_rank\":$((r / 2)),\"local_world_size\":2,\"node_rank\":$((r % 2)),\"num_nodes\":2," "rank $r's placement"
  done
  # Names that contradict the launcher (all on one node, but LOCAL_SIZE=2) are an error. Every rank
  # gets it, but mpirun aborts the job at the first non-zero exit, so not every rank may print it.
  mpi -np 4 sh -c 'r=$OMPI_COMM_WORLD_RANK; DTRAIN_NODE_NAME=same OMPI_COMM_WORLD_LOCAL_RANK=$((r / 2)) OMPI_COMM_WORLD_LOCAL_SIZE=2 OMPI_MCA_orte_num_nodes=2 exec "$0" process-mpi' "$PEER" \
    >"$work/bad.out" 2>"$work/bad.err"
  status=$?
  ((status != 0)) || fail "contradicting node names were accepted"
  expect_line "$work/bad.err" '^\[rank [0-3]/4\] dtrain: rank 0: OMPI_COMM_WORLD_LOCAL_SIZE=2 gives local world size 2, but grouping the ranks by node name \("same", the host name unless DTRAIN_NODE_NAME is set\) gives 4; give every node a distinct DTRAIN_NODE_NAME, or set NODE_RANK$' "the contradiction"
  ;;

bad_master_addr)
  # A master address that does not resolve fails at once (no retries for the store timeout),
  # naming the name and the resolver's reason: for an agent, and for a worker.
  export DTRAIN_STORE_TIMEOUT=120
  timeout 60 "$DTRUN" --nnodes 2 --node-rank 1 --master-addr no-such-host.invalid --master-port 29400 -- true \
    >"$work/dtrun.out" 2>"$work/dtrun.err"
  expect_status 2 $? "dtrun with an unresolvable --master-addr"
  expect_line "$work/dtrun.err" '^dtrun node 1: cannot resolve "no-such-host.invalid", the host of the store at no-such-host.invalid:29400: .+; check MASTER_ADDR' "dtrun's message"
  env MASTER_ADDR=no-such-host.invalid MASTER_PORT=29400 RANK=1 WORLD_SIZE=2 timeout 60 "$PEER" process-gloo \
    >"$work/peer.out" 2>"$work/peer.err"
  expect_status 2 $? "a worker with an unresolvable MASTER_ADDR"
  expect_line "$work/peer.err" '^\[rank 1/2\] dtrain: .*cannot resolve "no-such-host.invalid"' "the worker's message"
  ;;

missing_program)
  # Every way a program can be missing gives 127, as a shell's "command not found"; one that is
  # there but cannot be executed gives 126. dtrun says it once, naming the program.
  printf 'not a program\n' >"$work/plain.txt"
  check_missing() {  # check_missing <status> <program> <regex>
    "$DTRUN" --nproc-per-node 2 -- "$2" >"$work/m.out" 2>"$work/m.err"
    expect_status "$1" $? "dtrun -- $2"
    expect_line "$work/m.err" "$3" "dtrun -- $2"
    [[ $(count_lines "$work/m.err" 'cannot run') == 1 ]] || fail "dtrun -- $2 did not say it once: $(cat "$work/m.err")"
  }
  check_missing 127 dtrain-no-such-program '^dtrun node 0: cannot run "dtrain-no-such-program": not found on PATH='
  check_missing 127 /nonexistent/program '^dtrun node 0: cannot run "/nonexistent/program": no such file$'
  check_missing 126 "$work/plain.txt" "^dtrun node 0: cannot run \"$work/plain.txt\": it is not an executable file$"
  check_missing 126 "$work" "^dtrun node 0: cannot run \"$work\": it is not an executable file$"
  ;;

mpi_rank_fails)
  # A rank of an MPI job fails: it reports, then MPI_Abort ends every rank with its status, instead
  # of leaving it in MPI_Finalize while its peers wait out their timeout. `timeout` only turns a
  # hang into a failure with a message here.
  unset MASTER_ADDR MASTER_PORT
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 120 "$MPIEXEC" --oversubscribe -np 3 "$PEER" process-mpi --fail-rank 1 --fail-code 5 >"$work/fail.out" 2>"$work/fail.err"
  status=$?
  ((status != 124)) || fail "the MPI job was still running 120 s after rank 1 returned 5"
  expect_status 5 $status "mpirun after rank 1 returned 5"
  expect_line "$work/fail.err" '^\[rank 1/3\] dtrain: the training function returned 5; aborting the MPI job$' "rank 1's line"
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 120 "$MPIEXEC" --oversubscribe -np 3 "$PEER" process-mpi --throw-rank 2 >"$work/throw.out" 2>"$work/throw.err"
  status=$?
  ((status != 124)) || fail "the MPI job was still running 120 s after rank 2 threw"
  expect_status 1 $status "mpirun after rank 2 threw"
  expect_line "$work/throw.err" '^\[rank 2/3\] dtrain: peer failure on purpose$' "rank 2's line"
  # A rank that fails while joining, after MPI_Init (here: every rank is given its own store
  # token, so rank 1 is refused) does not block in MPI_Finalize while unwinding: it reports and
  # aborts the job.
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 120 "$MPIEXEC" --oversubscribe -np 2 \
    sh -c 'export DTRAIN_STORE_TOKEN=token-of-rank-$OMPI_COMM_WORLD_RANK; exec "$0" process-mpi' "$PEER" \
    >"$work/join.out" 2>"$work/join.err"
  status=$?
  ((status != 124)) || fail "the MPI job was still running 120 s after rank 1 failed to join"
  expect_status 1 $status "mpirun after rank 1 failed to join"
  expect_line "$work/join.err" "^\[rank 1/2\] dtrain: the store at .* rejected this client's token" "rank 1's line"
  ;;

peer_dies)
  # Rank 1 is SIGKILLed mid-collective. Over Gloo's TCP its peers write to its sockets: each
  # ends with an error (exit 1) that says Gloo failed, never silently by SIGPIPE (141). Whether
  # a write meets the closed socket is a race; broken_pipe below checks SIGPIPE
  # deterministically. Through shared memory (all ranks on this host) the peers see rank 1's
  # lock on the segment go, and name it.
  DTRAIN_GLOO_SHM=0 "$LAUNCH" --no-kill 3 "$PEER" process-gloo --die-rank 1 >"$work/die.out" 2>"$work/die.err"
  expect_status 137 $? "the job whose rank 1 was killed"
  expect_line "$work/die.err" '^dtrain_test_launch: rank 1 exited with status 137$' "rank 1's death"
  for r in 0 2; do
    expect_line "$work/die.err" "^dtrain_test_launch: rank $r exited with status 1$" "rank $r's exit status"
    expect_line "$work/die.err" "^\[rank $r/3\] dtrain: .*failed in Gloo" "rank $r's message"
  done
  DTRAIN_GLOO_SHM=1 "$LAUNCH" --no-kill 3 "$PEER" process-gloo --die-rank 1 >"$work/die_shm.out" 2>"$work/die_shm.err"
  expect_status 137 $? "the job whose rank 1 was killed (shared memory)"
  for r in 0 2; do
    expect_line "$work/die_shm.err" "^dtrain_test_launch: rank $r exited with status 1$" "rank $r's exit status (shared memory)"
    expect_line "$work/die_shm.err" "^\[rank $r/3\] dtrain: .*rank 1 exited or closed its communicator" "rank $r's message (shared memory)"
  done
  ;;

broken_pipe)
  # The agent starts its workers with SIGPIPE at its default (fatal); dtrain::run ignores it, so a
  # write to a closed pipe or socket is an error the worker sees (EPIPE), not a silent death.
  "$PEER" node-gloo --nproc-per-node 2 --broken-pipe >"$work/agent.out" 2>"$work/agent.err"
  expect_status 0 $? "the agent"
  for r in 0 1; do
    expect_line "$work/agent.out" "^peer rank $r: write to a closed pipe: Broken pipe$" "rank $r's write"
  done
  ;;

run_errors)
  # A bad environment: one line naming the variables, exit 2.
  env RANK=5 WORLD_SIZE=4 "$PEER" process-gloo >"$work/bad.out" 2>"$work/bad.err"
  expect_status 2 $? "a worker with RANK=5 WORLD_SIZE=4"
  expect_line "$work/bad.err" '^\[rank \?\] dtrain: RANK=5 is not below WORLD_SIZE=4$' "the config error"
  # An exception in the user's function: `[rank 1/2] dtrain: ...` and a non-zero exit of the job.
  "$LAUNCH" 2 "$PEER" process-gloo --throw-rank 1 >"$work/throw.out" 2>"$work/throw.err"
  status=$?
  ((status != 0)) || fail "a throwing rank ended with status 0"
  expect_line "$work/throw.err" '^\[rank 1/2\] dtrain: peer failure on purpose$' "the rank-prefixed message"
  # A Gloo job under mpirun without MASTER_ADDR: rank 1 cannot find rank 0's store. Say what to set.
  env -u MASTER_ADDR -u MASTER_PORT OMPI_COMM_WORLD_RANK=1 OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_LOCAL_RANK=1 \
    OMPI_COMM_WORLD_LOCAL_SIZE=2 "$PEER" process-gloo >"$work/nomaster.out" 2>"$work/nomaster.err"
  expect_status 2 $? "a Gloo rank under mpirun without MASTER_ADDR"
  expect_line "$work/nomaster.err" "^\[rank 1/2\] dtrain: rank 1 of 2 does not know where rank 0's rendezvous store is: set MASTER_ADDR \(and MASTER_PORT\)" "the message"
  # A per-node job of two nodes without MASTER_ADDR cannot start: say so, exit 2.
  env -u MASTER_ADDR "$PEER" node-gloo --nnodes 2 --node-rank 1 >"$work/agent.out" 2>"$work/agent.err"
  expect_status 2 $? "an agent of a 2-node job without MASTER_ADDR"
  expect_line "$work/agent.err" 'needs the address of node 0: set MASTER_ADDR or --master-addr' "the agent's message"
  ;;

rendezvous_progress)
  # One of two ranks never joins: it was given another MASTER_PORT. While they wait, rank 0 says
  # every second (DTRAIN_RENDEZVOUS_PROGRESS=1) who has joined and who has not, and rank 1 that
  # it is still trying to connect; at the store timeout rank 0 names rank 1 and the likely causes,
  # and rank 1 says what to check. Both exit 1, in the store timeout, not the default 300 s.
  port=$(free_port)
  wrong=$(free_port)
  while [[ $wrong == "$port" ]]; do wrong=$(free_port); done
  export DTRAIN_STORE_TIMEOUT=6 DTRAIN_RENDEZVOUS_PROGRESS=1
  env MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=0 WORLD_SIZE=2 timeout 60 "$PEER" process-gloo \
    >"$work/r0.out" 2>"$work/r0.err" &
  r0=$!
  env MASTER_ADDR=127.0.0.1 MASTER_PORT=$wrong RANK=1 WORLD_SIZE=2 timeout 60 "$PEER" process-gloo \
    >"$work/r1.out" 2>"$work/r1.err"
  expect_status 1 $? "rank 1, given another MASTER_PORT"
  wait $r0
  expect_status 1 $? "rank 0, waiting for rank 1"
  expect_line "$work/r0.err" "^\[rank 0/2\] dtrain: rendezvous at 127\.0\.0\.1:$port: 1 of 2 ranks joined; waiting for rank 1 \([0-9]+ s of 6 s\)$" "rank 0's progress"
  expect_line "$work/r0.err" "^\[rank 0/2\] dtrain: rendezvous at 127\.0\.0\.1:$port timed out after 6 s: 1 of 2 ranks joined; rank 1 never did\. Likely causes: MASTER_ADDR or MASTER_PORT differ between ranks \(this rank met at 127\.0\.0\.1:$port\), a firewall blocks that port, that rank never started or failed before joining \(see its output\), or the world size \(WORLD_SIZE=2\) is larger than the number of ranks started$" "rank 0's timeout"
  expect_line "$work/r1.err" "^\[rank 1/2\] dtrain: still trying to connect to the store at 127\.0\.0\.1:$wrong \([0-9]+ s of 6 s; last error: Connection refused\)$" "rank 1's progress"
  expect_line "$work/r1.err" "^\[rank 1/2\] dtrain: could not reach the store at 127\.0\.0\.1:$wrong within 6\.0 s \(last error: Connection refused\); check that the process hosting it \(rank 0, or the node-0 agent\) is running, that MASTER_ADDR and MASTER_PORT are the same on every rank, and that no firewall blocks the port$" "rank 1's timeout"
  ;;

store_token)
  # Two agents without a shared token cannot form a job: they say what to set, exit 2.
  env -u DTRAIN_STORE_TOKEN MASTER_ADDR=127.0.0.1 "$PEER" node-gloo --nnodes 2 --node-rank 0 \
    >"$work/agent.out" 2>"$work/agent.err"
  expect_status 2 $? "an agent of a 2-node job without DTRAIN_STORE_TOKEN"
  expect_line "$work/agent.err" 'a job of 2 nodes needs DTRAIN_STORE_TOKEN' "the agent's message"
  # A Gloo job of 2 ranks that may span hosts (a non-loopback MASTER_ADDR) without a token.
  addr=$(hostname -I 2>/dev/null | awk '{print $1}')
  if [[ -n $addr ]]; then
    env -u DTRAIN_STORE_TOKEN MASTER_ADDR="$addr" MASTER_PORT=$(free_port) RANK=1 WORLD_SIZE=2 \
      "$PEER" process-gloo >"$work/rank.out" 2>"$work/rank.err"
    expect_status 2 $? "a rank of a multi-host job without DTRAIN_STORE_TOKEN"
    expect_line "$work/rank.err" '^\[rank 1/2\] dtrain: rank 1 of 2: this job may span several hosts .* set DTRAIN_STORE_TOKEN' "the rank's message"
  fi
  # One node, no token set: the agent draws one; it is in no log and on no command line.
  env -u DTRAIN_STORE_TOKEN "$DTRUN" --nproc-per-node 2 -- sh -c \
    'test ${#DTRAIN_STORE_TOKEN} -eq 32 && ! tr "\0" " " </proc/$$/cmdline | grep -q "$DTRAIN_STORE_TOKEN" && echo "token ok $(echo $DTRAIN_STORE_TOKEN | md5sum | cut -c1-8)"' \
    >"$work/one.out" 2>"$work/one.err"
  expect_status 0 $? "dtrun of one node without DTRAIN_STORE_TOKEN"
  [[ $(count_lines "$work/one.out" '^(\[rank [01]\] )?token ok') == 2 ]] || fail "each worker should see a 32-digit token"
  [[ $(grep -o 'token ok [0-9a-f]*' "$work/one.out" | sort -u | wc -l) == 1 ]] || fail "the two workers saw different tokens"
  ;;

pet_variables)
  # dtrun in a Kubeflow Trainer TrainJob: the torch runtime sets torchrun's PET_* variables, not
  # dtrun's flags. Two agents play the TrainJob's two nodes (PET_NODE_RANK 0 and 1), two workers each.
  port=$(free_port)
  pids=()
  for n in 0 1; do
    PET_NNODES=2 PET_NPROC_PER_NODE=2 PET_NODE_RANK=$n PET_MASTER_ADDR=127.0.0.1 PET_MASTER_PORT=$port \
      "$DTRUN" -- "$PEER" process-gloo >"$work/n$n.out" 2>"$work/n$n.err" &
    pids+=($!)
  done
  for n in 0 1; do
    wait "${pids[n]}"
    expect_status 0 $? "dtrun of node $n under PET_*"
  done
  cat "$work/n0.out" "$work/n1.out" >"$work/all.out"
  check_world "$work/all.out" 4 2
  [[ $(count_lines "$work/n1.out" '^peer \{"rank":[23],') == 2 ]] || fail "PET_NODE_RANK=1's agent did not run ranks 2 and 3"
  # A flag wins over PET_*; a self-launching program reads PET_* too.
  PET_NPROC_PER_NODE=3 "$DTRUN" --nproc-per-node 2 -- "$PEER" process-gloo >"$work/flag.out" 2>"$work/flag.err"
  expect_status 0 $? "--nproc-per-node 2 over PET_NPROC_PER_NODE=3"
  check_world "$work/flag.out" 2 2
  PET_NPROC_PER_NODE=2 "$PEER" node-gloo --agent-flags-from-argv >"$work/self.out" 2>"$work/self.err"
  expect_status 0 $? "a self-launching program under PET_NPROC_PER_NODE=2"
  check_world "$work/self.out" 2 2
  # gpu|cpu|auto: the cores this process may use (taskset), no GPU where CUDA_VISIBLE_DEVICES hides them.
  CUDA_VISIBLE_DEVICES= PET_NPROC_PER_NODE=auto taskset -c 0 "$DTRUN" -- sh -c 'echo "world=$WORLD_SIZE"' \
    >"$work/auto.out" 2>"$work/auto.err"
  expect_status 0 $? "PET_NPROC_PER_NODE=auto on one core"
  [[ $(cat "$work/auto.out") == "world=1" ]] || fail "auto on one core without a GPU started $(wc -l <"$work/auto.out") workers"
  CUDA_VISIBLE_DEVICES= "$DTRUN" --nproc-per-node gpu -- true >"$work/gpu.out" 2>"$work/gpu.err"
  expect_status 2 $? "--nproc-per-node gpu without a visible GPU"
  expect_line "$work/gpu.err" '^dtrun: --nproc-per-node=gpu on the command line: this process sees no CUDA device' "the gpu message"
  # Sources that disagree, and a bad value: exit 2, naming both variables, or the one.
  PET_NNODES=2 DTRAIN_NNODES=3 "$DTRUN" -- true >"$work/both.out" 2>"$work/both.err"
  expect_status 2 $? "PET_NNODES=2 with DTRAIN_NNODES=3"
  expect_line "$work/both.err" '^dtrun: DTRAIN_NNODES=3 and PET_NNODES=2 disagree about the number of nodes$' "the conflict's message"
  PET_MASTER_ADDR=10.0.0.1 MASTER_ADDR=10.0.0.2 "$DTRUN" -- true >"$work/addr.out" 2>"$work/addr.err"
  expect_status 2 $? "PET_MASTER_ADDR with another MASTER_ADDR"
  expect_line "$work/addr.err" "^dtrun: PET_MASTER_ADDR=10\.0\.0\.1 and MASTER_ADDR=10\.0\.0\.2 disagree about node 0's address$" "the address conflict"
  PET_MASTER_PORT=70000 "$DTRUN" -- true >"$work/port.out" 2>"$work/port.err"
  expect_status 2 $? "PET_MASTER_PORT=70000"
  expect_line "$work/port.err" '^dtrun: PET_MASTER_PORT=70000 is outside the port range 1-65535$' "the bad port's message"
  ;;

torchrun_flags)
  # torchrun's rendezvous flags: a c10d endpoint is node 0's store, --rdzv-id reaches the workers as
  # TORCHELASTIC_RUN_ID and must be the same on every node; -m runs a Python module.
  port=$(free_port)
  pids=()
  for n in 0 1; do
    "$DTRUN" --nnodes 2 --node-rank $n --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$port" --rdzv-id job7 \
      -- sh -c 'echo "run_id=$TORCHELASTIC_RUN_ID rank=$RANK world=$WORLD_SIZE"' >"$work/n$n.out" 2>"$work/n$n.err" &
    pids+=($!)
  done
  for n in 0 1; do
    wait "${pids[n]}"
    expect_status 0 $? "dtrun of node $n with --rdzv-endpoint"
    expect_line "$work/n$n.out" "^run_id=job7 rank=$n world=2$" "node $n's worker"
  done
  # Node 0's agent serves the store, so it always sees the other node's id; node 1 may find the
  # store gone first, and then fails differently.
  port=$(free_port)
  "$DTRUN" --nnodes 2 --node-rank 1 --rdzv-endpoint "127.0.0.1:$port" --rdzv-id job8 -- true >"$work/m1.out" 2>"$work/m1.err" &
  other=$!
  "$DTRUN" --nnodes 2 --node-rank 0 --rdzv-endpoint "127.0.0.1:$port" --rdzv-id job7 -- true >"$work/m0.out" 2>"$work/m0.err"
  expect_status 2 $? "node 0 with another --rdzv-id than node 1"
  expect_line "$work/m0.err" '^dtrun node 0: node 1 \(.+\) has --rdzv-id job8, this node job7; every node of a job must give the same --rdzv-id' "the id mismatch"
  wait $other
  (($? != 0)) || fail "node 1 with another --rdzv-id succeeded"
  "$DTRUN" --rdzv-backend etcd --rdzv-endpoint "127.0.0.1:$port" -- true >"$work/etcd.out" 2>"$work/etcd.err"
  expect_status 2 $? "--rdzv-backend etcd"
  expect_line "$work/etcd.err" '^dtrun: --rdzv-backend=etcd on the command line: dtrun has no etcd rendezvous; .*--master-addr HOST --master-port PORT --node-rank N' "etcd's refusal"
  "$DTRUN" --rdzv-endpoint 127.0.0.1:1 --master-port 2 -- true >"$work/both.out" 2>"$work/both.err"
  expect_status 2 $? "--rdzv-endpoint with another --master-port"
  expect_line "$work/both.err" "^dtrun: --rdzv-endpoint=127\.0\.0\.1:1 on the command line and --master-port=2 on the command line disagree about node 0's port" "the flags' conflict"
  # -m pkg.module args: python3 -u -m, on every worker; --no-python refuses it.
  mkdir -p "$work/py/tinypkg"
  : >"$work/py/tinypkg/__init__.py"
  printf '%s\n' 'import os, sys' \
    'line = " ".join(["module", __name__, os.environ["RANK"], os.environ["WORLD_SIZE"]] + sys.argv[1:])' \
    'sys.stdout.write(line + "\n")  # one write: the two workers share the file (python -u)' \
    >"$work/py/tinypkg/hello.py"
  PYTHONPATH="$work/py" "$DTRUN" --nproc-per-node 2 -m tinypkg.hello --epochs 3 >"$work/py.out" 2>"$work/py.err"
  expect_status 0 $? "dtrun -m tinypkg.hello"
  for r in 0 1; do
    expect_line "$work/py.out" "^module __main__ $r 2 --epochs 3$" "rank $r of the module"
  done
  "$DTRUN" --no-python -m tinypkg.hello >"$work/nopy.out" 2>"$work/nopy.err"
  expect_status 2 $? "-m with --no-python"
  expect_line "$work/nopy.err" '^dtrun: -m \(--module\) and --no-python on the command line exclude each other' "the refusal"
  ;;

torch_env)
  # An unmodified PyTorch script (init_process_group(init_method="env://")) under dtrun, as under
  # torchrun: two nodes of two workers, so GROUP_RANK, ranks and the port dtrun picks all count.
  port=$(free_port)
  export MASTER_ADDR=127.0.0.1
  pids=()
  for n in 0 1; do
    "$DTRUN" --nnodes 2 --node-rank $n --master-port "$port" --nproc-per-node 2 -- \
      "$TORCH_PYTHON" "$SOURCE_DIR/tests/peers/torch_env_job.py" >"$work/n$n.out" 2>"$work/n$n.err" &
    pids+=($!)
  done
  for n in 0 1; do
    wait "${pids[n]}"
    expect_status 0 $? "dtrun of node $n"
  done
  cat "$work/n0.out" "$work/n1.out" >"$work/all.out"
  for r in 0 1 2 3; do
    expect_line "$work/all.out" "^torch_env_job rank=$r world_size=4 local_rank=$((r % 2)) sum=10 ok$" "PyTorch rank $r"
  done
  ;;

*)
  fail "unknown case $case_name"
  ;;
esac
echo "PASS: $case_name"
