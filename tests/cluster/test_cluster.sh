#!/usr/bin/env bash
# tests/cluster/test_cluster.sh CASE BIN_DIR [TESTS_DIR]: one multi-node test on a
# simulated cluster (cluster.sh): 2 nodes, each its own network namespace,
# host name and address, joined at 1 Gbit/s. BIN_DIR holds dtrun,
# dtrain_whoami, dtrain_doctor and dtrain_train_mlp; TESTS_DIR dtrain_ddp_peer.
# Exit 0 pass, 1 fail, 77 skip.
#
#   dtrun_2x2          dtrun on both nodes, 2 workers each: the world every rank
#                      completes at rendezvous (whoami --rendezvous)
#   mpirun_by_node     mpirun --map-by node -np 4 across the nodes: the same
#   mpirun_by_slot     mpirun --map-by slot -np 4
#   demo_2x2           the demo on 2 nodes x 2 workers ends with the weights of 1 node x 4
#                      (over TCP; through shared memory, with the same losses)
#   loopback_hostname  node1 maps its own name to 127.0.1.1 (Debian's default):
#                      the job works, or fails at once saying what to set
#   killed_worker      a worker killed on node2 ends the job on node1, naming the rank
#   hierarchical_gloo  DistributedDataParallel with topology::hierarchical under dtrun,
#                      2 nodes x 2 workers: exact means, and the group equals flat
#   hierarchical_mpi   the same under mpirun --map-by node (ranks not contiguous per node)
#   elastic_1_2        the demo under --nnodes 1:2 (2 nodes x 2, checkpoints on disk and in
#                      memory every step): node2's agent killed -> node1 knows at once (its
#                      lease) and goes on alone from its own memory copy (the demo's state is
#                      replicated: copies of 4 ranks serve a round of 2), with at most one
#                      step trained twice; node2 started again -> the job grows back to 2
#                      nodes, node2's new ranks get the memory copy from rank 0 (at most one
#                      step trained twice again), and finishes. Every sample of
#                      every epoch is trained exactly once across the changes (counted from
#                      the demo's --sample-log), and the accuracy is within a point of an
#                      uninterrupted run
#   elastic_1_2_zero1  the same with ZeRO stage 1: each change re-cuts the ranks' shards of
#                      the optimizer state from the memory copies (node1's, and node2's
#                      that node1's agent holds), gathered to every rank
#   replace_node       the demo as a fixed job of 2 nodes x 2 with ZeRO stage 1 (each rank's
#                      shard of the optimizer state is its own; memory copies every step):
#                      node2's agent SIGKILLed at a random step; node1 waits for an agent to
#                      take its place, one started again on node2 does, its ranks take their
#                      copies from their buddy (node1's agent), and the job ends with the
#                      uninterrupted run's checksum, with at most one step trained twice
#   replace_node0      the same with node1's agent SIGKILLed: node 0, which serves the store.
#                      Node2 finds the store gone at once, stops its workers and waits for an
#                      agent to take node 0's place; one started again on node1 serves a new
#                      store at the same address, node2's agent joins it, the job goes on
#                      with the next round (node1's new ranks take their copies from node2's
#                      agent) and ends with the uninterrupted run's checksum
#   replace_node0_elastic
#                      the same as an elastic job (--nnodes 1:2): node2's agent joins the new
#                      store and raises the newest round to the one it ran, and the new node 0
#                      forms the next of both nodes (the same size: the same checksum)
#   freeze_node        the same fixed job, node2 frozen whole at a random step (its agent,
#                      workers and all: SIGSTOP, its connections open): node1 finds it silent
#                      (DTRAIN_HEARTBEAT_TIMEOUT 2 s) and waits for an agent to take its place,
#                      one started on node2 does, the job resumes from memory; then node2's
#                      old processes wake (SIGCONT): its agent finds its place taken and exits
#                      1 (its workers, should they save once more, cannot name a copy at their
#                      buddy: a later round holds the list; unit test "a worker of an earlier
#                      round ..."), and the job ends with the uninterrupted run's checksum
#   power_off_node0    the same fixed job, node1 (node 0, the store's) frozen whole and cut
#                      off at a random step, as a host that lost its power (no connection
#                      closed): node2's calls to the store get no reply within its
#                      DTRAIN_HEARTBEAT_TIMEOUT (2 s); it finds nothing answering there, stops
#                      its workers and waits; a new host takes node1's name and address
#                      (cluster_cut_off, cluster_new_host), an agent started there serves a new store, and
#                      the job goes on from memory and ends with the uninterrupted run's
#                      checksum
#   freeze_node0       the same, node1 frozen whole (SIGSTOP) and woken (SIGCONT) once node2
#                      waits for an agent to take node 0's place: node 0's store answers
#                      again, node2's agent takes its own place back, and the job goes on
#                      from memory with the uninterrupted run's checksum
#   doctor             dtrain_doctor on a node whose name is on 127.0.1.1 names the
#                      trap and its fix; on a healthy node it finds none
#   metrics_endpoint   dtrun --metrics-port on node1, its 2 workers writing metrics files:
#                      on node1's own address with DTRAIN_METRICS_TOKEN, node2 gets 401
#                      without the token and both workers' samples, merged, with it; on the
#                      default address (loopback), node2 cannot connect and node1 can
set -uo pipefail
case_name=${1:?case}
bin=${2:?bin dir}
tests_bin=${3:-}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/cluster.sh"

for program in dtrun dtrain_whoami; do
  [[ -x $bin/$program ]] || { echo "SKIPPED: $bin/$program is not built"; exit 77; }
done
work=$(mktemp -d)
cluster_exit_hook='rm -rf "$work"'
trap 'rm -rf "$work"' EXIT  # cluster_up replaces it with one that also removes the cluster
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# A job over several hosts shares a store token, as a real cluster job must (README, "Security").
export DTRAIN_STORE_TOKEN=cluster-tests-secret
port=29500
limit=90  # seconds for any one job: a hang fails the test, with the output so far

fail() { cluster_fail "$@"; }

# check_world FILE EXPECTED: FILE holds whoami --rendezvous lines (one per
# rank, any order); EXPECTED is "rank:host:node_rank:local_rank ..." for a
# job of that many ranks on 2 nodes with 2 ranks each.
check_world() {
  python3 - "$1" "$2" <<'PY' || fail "the completed world is wrong"
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
expected = {int(r): (h, int(n), int(l)) for r, h, n, l in (e.split(":") for e in sys.argv[2].split())}
got = {w["rank"]: w for w in lines}
ok = len(lines) == len(expected) and set(got) == set(expected)
for rank, (host, node, local) in expected.items():
    w = got.get(rank)
    if w is None:
        print(f"rank {rank}: no line"); continue
    want = dict(world_size=len(expected), num_nodes=2, local_world_size=2, host=host,
                node_rank=node, local_rank=local)
    wrong = {k: (w.get(k), v) for k, v in want.items() if w.get(k) != v}
    print(f"rank {rank}: {json.dumps(w)}" + (f"  WRONG (got, want): {wrong}" if wrong else ""))
    ok = ok and not wrong
sys.exit(0 if ok else 1)
PY
}

# check_samples FOLDER SIZE EPOCHS: the demo's --sample-log files of a job of
# several rounds: every sample of every epoch trained exactly once (a round
# resumed at its checkpoint supersedes what an earlier round trained after
# it), and at most one step trained twice at each change of round
# (tests/scripts/sample_log.py check: it names the sample, step or round that fails).
check_samples() {
  python3 "$here/../scripts/sample_log.py" check "$1" --samples "$2" --epochs "$3" --most-twice 1 ||
    fail "the samples do not add up"
}

# wait_for WHAT COMMAND...: polls the command for up to 60 s.
wait_for() {
  local what=$1 deadline=$((SECONDS + 60))
  shift
  until "$@"; do
    ((SECONDS < deadline)) || fail "waited 60 s for $what"
    sleep 0.02
  done
}

# demo_node N NNODES MAX_RESTARTS SUFFIX COMMAND...: node N's agent (a program
# that launches itself) of a job whose store is on node1, in the background;
# its output in $work/nodeN<SUFFIX>.out and .err. Its heartbeat time-out is
# $heartbeat seconds (600 if unset: a silent node is never the point).
demo_node() {
  local n=$1 nnodes=$2 restarts=$3 suffix=$4
  shift 4
  cluster_run node"$n" env DTRAIN_NNODES="$nnodes" DTRAIN_NODE_RANK=$((n - 1)) MASTER_ADDR=node1 \
    MASTER_PORT=$port DTRAIN_MAX_RESTARTS="$restarts" DTRAIN_HEARTBEAT_TIMEOUT="${heartbeat:-600}" \
    DTRAIN_GRACE_PERIOD=1 timeout "$limit" "$@" >"$work/node$n$suffix.out" 2>"$work/node$n$suffix.err" &
}

# The demo's weight checksum (its last "hold identical weights" line) in FILE.
checksum_of() { sed -n 's/.*hold identical weights (checksum \([0-9a-f]*\)).*/\1/p' "$1" | tail -n 1; }

# dtrun_on NODE NODE_RANK ARGS...: dtrun for a 2-node job whose store is on node1.
dtrun_on() {
  local node=$1 rank=$2
  shift 2
  cluster_run "$node" timeout "$limit" "$bin/dtrun" --nnodes 2 --node-rank "$rank" \
    --nproc-per-node 2 --master-addr node1 --master-port "$port" -- "$@"
}

# two_nodes ARGS...: the same command under dtrun on both nodes; waits for both.
two_nodes() {
  dtrun_on node1 0 "$@" >"$work/node1.out" 2>"$work/node1.err" &
  local first=$!
  dtrun_on node2 1 "$@" >"$work/node2.out" 2>"$work/node2.err" &
  local second=$!
  wait "$first"
  status1=$?
  wait "$second"
  status2=$?
}

# mpirun_across MAPPING PROGRAM ARGS...: mpirun -np 4 over both nodes (default program: whoami --rendezvous).
mpirun_across() {
  local mapping=$1
  shift
  (($# > 0)) || set -- "$bin/dtrain_whoami" --rendezvous
  command -v mpirun >/dev/null || { echo "SKIPPED: mpirun not found"; exit 77; }
  mpirun --version 2>&1 | grep -q "Open MPI" || { echo "SKIPPED: needs Open MPI's mpirun"; exit 77; }
  printf 'node1 slots=2\nnode2 slots=2\n' >"$work/hosts"
  cluster_run node1 timeout "$limit" mpirun --hostfile "$work/hosts" -np 4 --map-by "$mapping" \
    --bind-to none --mca plm_rsh_agent "$(cluster_rsh)" --mca btl tcp,self,vader \
    --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 -x DTRAIN_STORE_TOKEN \
    "$@" >"$work/mpirun.out" 2>"$work/mpirun.err" ||
    fail "mpirun --map-by $mapping $* exited with $?"
  cat "$work/mpirun.out"
}

need_peer() {
  [[ -n $tests_bin && -x $tests_bin/dtrain_ddp_peer ]] ||
    { echo "SKIPPED: dtrain_ddp_peer is not built (DTRAIN_BUILD_TESTS with MPI or Gloo)"; exit 77; }
}

# expect_lines FILE COUNT TEXT: FILE has COUNT lines containing TEXT, and no FAILED.
expect_lines() {
  local got
  got=$(grep -c -- "$3" "$1")
  grep -h "FAILED" "$1" | head -5
  ((got == $2)) && ! grep -q FAILED "$1" || fail "expected $2 lines with '$3' in $(basename "$1"), got $got"
}

case $case_name in
  dtrun_2x2)
    cluster_up 2 1gbit
    two_nodes "$bin/dtrain_whoami" --rendezvous
    ((status1 == 0 && status2 == 0)) || fail "dtrun exited with $status1 on node1, $status2 on node2"
    cat "$work/node1.out" "$work/node2.out" >"$work/all.out"
    check_world "$work/all.out" "0:node1:0:0 1:node1:0:1 2:node2:1:0 3:node2:1:1"
    ;;
  mpirun_by_node)
    cluster_up 2 1gbit
    mpirun_across node >/dev/null
    check_world "$work/mpirun.out" "0:node1:0:0 1:node2:1:0 2:node1:0:1 3:node2:1:1"
    ;;
  mpirun_by_slot)
    cluster_up 2 1gbit
    mpirun_across slot >/dev/null
    check_world "$work/mpirun.out" "0:node1:0:0 1:node1:0:1 2:node2:1:0 3:node2:1:1"
    ;;
  demo_2x2)
    [[ -x $bin/dtrain_train_mlp ]] || { echo "SKIPPED: dtrain_train_mlp is not built (needs Gloo)"; exit 77; }
    demo=("$bin/dtrain_train_mlp" --epochs 2)
    # Bit for bit needs the same reduction order: on one host dtrain's Gloo
    # allreduces through shared memory (rank order), across hosts Gloo's TCP
    # ring. So the bitwise run uses TCP, and the shared-memory run must print
    # the same losses.
    DTRAIN_GLOO_SHM=0 timeout "$limit" "${demo[@]}" --nproc-per-node 4 >"$work/one_node.out" 2>&1 ||
      fail "the demo on one node x 4 (TCP) exited with $?"
    timeout "$limit" "${demo[@]}" --nproc-per-node 4 >"$work/one_node_shm.out" 2>&1 ||
      fail "the demo on one node x 4 (shared memory) exited with $?"
    cluster_up 2 1gbit
    pids=()
    for n in 1 2; do
      cluster_run node$n env DTRAIN_NNODES=2 DTRAIN_NODE_RANK=$((n - 1)) MASTER_ADDR=node1 \
        MASTER_PORT=$port timeout "$limit" "${demo[@]}" --nproc-per-node 2 \
        >"$work/node$n.out" 2>"$work/node$n.err" &
      pids+=($!)
    done
    wait "${pids[0]}"; status1=$?
    wait "${pids[1]}"; status2=$?
    ((status1 == 0 && status2 == 0)) || fail "the demo exited with $status1 on node1, $status2 on node2"
    one=$(grep -o 'all 4 ranks hold identical weights (checksum [0-9a-f]*)' "$work/one_node.out")
    two=$(grep -o 'all 4 ranks hold identical weights (checksum [0-9a-f]*)' "$work/node1.out")
    echo "1 node x 4:  $one"
    echo "2 nodes x 2: $two"
    [[ -n $one && $one == "$two" ]] || fail "the weights differ between 1 node x 4 and 2 nodes x 2"
    losses() { grep -o '^epoch [0-9/]*  loss [0-9.]*' "$1"; }
    [[ -n $(losses "$work/one_node_shm.out") && $(losses "$work/one_node_shm.out") == "$(losses "$work/node1.out")" ]] ||
      fail "the losses through shared memory differ from those over TCP"
    ;;
  elastic_1_2 | elastic_1_2_zero1)
    [[ -x $bin/dtrain_train_mlp ]] || { echo "SKIPPED: dtrain_train_mlp is not built (needs Gloo)"; exit 77; }
    demo=("$bin/dtrain_train_mlp" --epochs 4 --samples 8192 --features 64 --hidden 256 --batch-size 32)
    # ZeRO stage 1: each rank's shard of the optimizer state is its own, re-cut at each change.
    [[ $case_name == elastic_1_2_zero1 ]] && demo+=(--sharding 1)
    DTRAIN_GLOO_SHM=0 timeout "$limit" "${demo[@]}" --nproc-per-node 4 >"$work/reference.out" 2>&1 ||
      fail "the uninterrupted demo (1 node x 4) exited with $?"
    mkdir -p "$work/samples"
    elastic=("${demo[@]}" --nproc-per-node 2 --checkpoint-dir "$work/ckpt" --checkpoint-every 10
             --memory-every 1 --sample-log "$work/samples")
    # node N's agent (the demo launches itself) for an elastic job of 1 to 2 nodes.
    start_node() { demo_node "$1" 1:2 2 "$2" "${elastic[@]}"; }  # <n> <output suffix>
    cluster_up 2 1gbit
    start_node 1 ""
    first=$!
    start_node 2 ""
    wait_for "a checkpoint" compgen -G "$work/ckpt/step-*[0-9]"
    agent2=$(cluster_agent node2 "$bin/dtrain_train_mlp")
    [[ -n $agent2 ]] || fail "no agent found on node2"
    kill -KILL "$agent2"
    echo "killed node2's agent (pid $agent2) after $(ls -d "$work"/ckpt/step-*[0-9] | wc -l) checkpoint(s)"
    wait_for "node1 to go on alone" grep -q "nodes 0 (1 of at most 2)" "$work/node1.err"
    # Known at once from node2's lease on the store, and the next round formed without
    # waiting for node2 (no heartbeat time-out, no last call: DTRAIN_HEARTBEAT_TIMEOUT is 600 s).
    grep -q "node 1's agent is gone: its connection to the store closed" "$work/node1.err" ||
      fail "node1 did not learn from node2's lease that node2's agent is gone"
    grep -q "nodes 0 (1 of at most 2), 2 workers; formed without waiting for node 1 (agent gone)" \
      "$work/node1.err" || fail "node1 waited for node2's agent, which was gone"
    # Node1's memory copies were written by 4 ranks; the demo's state is all
    # replicated, so the round of 2 resumes from them, reading nothing on disk.
    # With ZeRO, node1's ranks gather the shards of the 4 ranks (2 on node1, 2 at
    # node1's agent, node2's buddy) and re-cut them.
    wait_for "node1's round to resume" grep -q "resumed from the memory copy of step" \
      "$work/node1.err"
    grep -h "resumed from\|gathered from" "$work/node1.err"
    if [[ $case_name == elastic_1_2_zero1 ]]; then
      grep -q "no rank had a copy for a job of 2 ranks: step [0-9]* of the job of 4 ranks gathered" \
        "$work/node1.err" || fail "node1's round of 2 did not gather the 4 ranks' shards"
    fi
    solo=$(grep -o "round [0-9]*: nodes 0 (1 of" "$work/node1.err" | tail -n 1 | awk '{print $2}')
    solo=${solo%:}
    wait_for "node1's round $solo to train" test -s "$work/samples/round-$solo-rank-0.txt"
    # Node1's workers are frozen until node2 is back, so that the job cannot
    # end before it: a slow model, as far as the agents can tell.
    frozen=$(cluster_workers node1)
    [[ -n $frozen ]] || fail "no worker of node1's round $solo to freeze"
    kill -STOP $frozen
    grep -h "round [0-9]*: nodes" "$work/node1.err"
    start_node 2 .again
    second=$!
    wait_for "node1's agent to take node2 back" grep -q "a node is ready to join" "$work/node1.err"
    kill -CONT $frozen 2>/dev/null  # stopped by their agent meanwhile (SIGTERM, then SIGKILL)
    wait "$first"
    status1=$?
    wait "$second"
    status2=$?
    grep -h "dtrain agent\|resumed" "$work/node1.err" "$work/node1.out" | head -20
    ((status1 == 0 && status2 == 0)) || fail "node1 exited with $status1, node2 (again) with $status2"
    grep -q "nodes 0, 1 (2 of at most 2)" "$work/node2.again.err" ||
      fail "node2 did not rejoin the job"
    # Node2 came back without copies: rank 0 sent its ranks the replicated
    # part (with ZeRO: every rank the 2 ranks' parts, re-cut for 4), and that
    # round resumed from memory too.
    if [[ $case_name == elastic_1_2_zero1 ]]; then
      grep -q "no rank had a copy for a job of 4 ranks: step [0-9]* of the job of 2 ranks gathered" \
        "$work/node1.err" || fail "the round of 4 did not gather the 2 ranks' shards"
      grep -h "gathered from" "$work/node1.err"
    else
      grep -q "memory tier: rank(s) 2, 3 had no copy of step [0-9]* (their node is new, or came back): rank 0 sent them its replicated part" \
        "$work/node1.err" || fail "node2's ranks did not get the memory copy from rank 0"
      grep -h "sent them its replicated part" "$work/node1.err"
    fi
    (($(grep -c "resumed from the memory copy of step" "$work/node1.err") >= 2)) ||
      fail "the round with node2 back did not resume from memory"
    # Every epoch's samples exactly once across the rounds: a round resumed at
    # its checkpoint supersedes what an earlier round trained after it.
    check_samples "$work/samples" 8192 4
    accuracy() { grep -o 'test accuracy *[0-9.]*' "$1" | tail -n 1 | grep -o '[0-9.]*$'; }
    want=$(accuracy "$work/reference.out")
    got=$(accuracy "$work/node1.out")
    echo "final test accuracy: $got % (uninterrupted: $want %)"
    [[ -n $want && -n $got ]] || fail "no accuracy printed"
    python3 -c "import sys; sys.exit(0 if abs($got - $want) <= 1.0 else 1)" ||
      fail "the accuracy $got % is not within a point of $want %"
    ;;
  replace_node | replace_node0 | replace_node0_elastic | freeze_node | power_off_node0 | freeze_node0)
    [[ -x $bin/dtrain_train_mlp ]] || { echo "SKIPPED: dtrain_train_mlp is not built (needs Gloo)"; exit 77; }
    # ZeRO stage 1: a lost node's shards of the optimizer state are on no other node's disk
    # or memory but its buddy's.
    demo=("$bin/dtrain_train_mlp" --epochs 3 --samples 8192 --features 64 --hidden 256
          --batch-size 32 --nproc-per-node 2 --sharding 1)
    nnodes=2  # a fixed job of 2 nodes; an elastic one (1:2) in replace_node0_elastic
    [[ $case_name == replace_node0_elastic ]] && nnodes=1:2
    # node N's agent (the demo launches itself) of that job: start_node N SUFFIX ARGS...
    start_node() {  # <n> <output suffix> <the demo's flags...>
      local n=$1 suffix=$2
      shift 2
      demo_node "$n" "$nnodes" 1 "$suffix" "${demo[@]}" "$@"
    }
    cluster_up 2 1gbit
    start_node 1 .reference
    a=$!
    start_node 2 .reference
    b=$!
    wait "$a"; s1=$?; wait "$b"; s2=$?
    ((s1 == 0 && s2 == 0)) || fail "the uninterrupted job exited with $s1 / $s2"
    want=$(checksum_of "$work/node1.reference.out")
    [[ -n $want ]] || fail "the uninterrupted job printed no checksum"
    # The same job with a memory copy every step and the disk every 10; the lost
    # node's agent (node2's; node1's, node 0 that serves the store, in replace_node0)
    # is SIGKILLed at a random step past the first checkpoint, and an agent
    # started again there takes its place.
    # rank0: where rank 0 prints, once the job is over; new_ranks: the lost node's.
    lost=2 kept=1 rank0=node1 new_ranks="2, 3"
    [[ $case_name == *_node0* ]] && lost=1 kept=2 rank0=node1.replacement new_ranks="0, 1"
    port=$((port + 1))
    mkdir -p "$work/samples"
    job=(--checkpoint-dir "$work/ckpt" --checkpoint-every 10 --memory-every 1
         --sample-log "$work/samples")
    # freezes: the lost node's host is frozen whole (its agent found silent), not its agent killed.
    freezes=no
    [[ $case_name == freeze_node* || $case_name == power_off_node0 ]] && freezes=yes heartbeat=2
    # ended_whole OUTPUT WHEN WHAT: the job resumed from memory (rank 0 prints in
    # $work/OUTPUT.err and .out), every sample trained once, at most one step twice,
    # and it ended with the uninterrupted run's checksum.
    ended_whole() {
      grep -q "resumed from the memory copy of step" "$work/$1.err" ||
        fail "the job did not resume from memory"
      check_samples "$work/samples" 8192 3
      got=$(checksum_of "$work/$1.out")
      [[ $got == "$want" ]] || fail "checksum $got $2, $want uninterrupted"
      echo "$3: checksum $got, the uninterrupted run's"
    }
    # Node 0's store fell silent, and node2 said so (its heartbeat time-out: 2 s).
    store_silent() {
      grep -q "node 0's store at node1:$port does not answer (.*no reply from the store at node1:$port in time.*(DTRAIN_HEARTBEAT_TIMEOUT 2 s)): node 0's agent is frozen, or its host is gone" \
        "$work/node2.err" || fail "node2 did not say that node 0's store fell silent"
    }
    start_node $kept "" "${job[@]}"
    first=$!
    start_node $lost "" "${job[@]}"
    old=$!
    wait_for "a checkpoint" compgen -G "$work/ckpt/step-*[0-9]"
    at=$((10 + RANDOM % 40))
    logged() { (($(cat "$work"/samples/round-0-rank-0.txt 2>/dev/null | wc -l) >= $1)); }
    wait_for "step $at in the sample log" logged "$at"
    agent=$(cluster_agent node$lost "$bin/dtrain_train_mlp")
    [[ -n $agent ]] || fail "no agent found on node$lost"
    if [[ $freezes == yes ]]; then
      frozen=$(cluster_pids node$lost | xargs)
      kill -STOP $frozen
      echo "froze node$lost (pids $frozen) at step $(wc -l <"$work/samples/round-0-rank-0.txt")"
      # power_off_node0: its host lost its power: nothing of it answers, no
      # connection is closed (a new host takes its name and address below).
      if [[ $case_name == power_off_node0 ]]; then
        cluster_cut_off node$lost || fail "could not cut node$lost off"
      fi
    else
      kill -KILL "$agent"
      echo "killed node$lost's agent (pid $agent) at step $(wc -l <"$work/samples/round-0-rank-0.txt")"
    fi
    wait_for "node$kept to wait for a replacement" \
      grep -q "waiting for an agent to take the place of node $((lost - 1))" "$work/node$kept.err"
    if [[ $case_name == power_off_node0 ]]; then
      cluster_new_host node$lost || fail "could not give node$lost's name and address to a new host"
    fi
    if [[ $case_name == freeze_node0 ]]; then
      # Node 0 wakes: its agent finds node 2 gone (its connection closed) and waits
      # for an agent to take its place, node 2's, back from waiting, takes its own
      # place again, and the job goes on from memory with no new host.
      kill -CONT $frozen
      echo "woke node1"
      wait "$old"; status1=$?
      wait "$first"; status2=$?
      grep -h "dtrain agent\|resumed" "$work/node1.err" "$work/node2.err"
      ((status1 == 0 && status2 == 0)) || fail "node1 exited with $status1, node2 with $status2"
      store_silent
      ended_whole node1 "after node 0 woke" "node 0 woke and the job went on from memory"
      exit 0
    fi
    start_node $lost .replacement "${job[@]}"
    second=$!
    if [[ $case_name == freeze_node ]]; then
      grep -q "node 1's agent stopped responding: no heartbeat for 2 s" "$work/node1.err" ||
        fail "node1 did not find node2 silent"
      # The replacement's round trains, then the old node2 wakes in the middle of it.
      resumed() { (($(cat "$work"/samples/round-1-rank-2.txt 2>/dev/null | wc -l) >= 5)); }
      wait_for "the replacement's round to train" resumed
      kill -CONT $frozen 2>/dev/null
      wait "$old"
      status=$?
      ((status == 1)) || fail "node2's old agent exited with $status once awake, not 1"
      grep -q "node 1's place was taken by the agent [^ ]* while this agent ([^)]*) did not respond" \
        "$work/node2.err" || fail "node2's old agent did not say that its place was taken"
      grep -h "place was taken\|later worker's" "$work/node2.err"
    fi
    wait "$first"; status1=$?
    wait "$second"; status2=$?
    grep -h "dtrain agent\|resumed\|memory tier" "$work/node$kept.err" "$work/node$lost.replacement.err" |
      grep -v "^dtrain checkpoint: saved" | head -20
    ((status1 == 0 && status2 == 0)) ||
      fail "node$kept exited with $status1, the replacement with $status2"
    if [[ $case_name == replace_node0_elastic ]]; then
      grep -q "the other nodes' agents came back from round 0 (node 0's agent, and its store, were replaced)" \
        "$work/node1.replacement.err" || fail "the replacement did not say that the rounds go on"
      grep -q "round 1: nodes 0, 1 (2 of at most 2), 4 workers" "$work/node1.replacement.err" ||
        fail "the replacement did not form round 1 of both nodes"
    elif [[ $case_name == replace_node0 || $case_name == power_off_node0 ]]; then
      grep -q "takes the place of node 0's agent, which is gone (with its store)" \
        "$work/node1.replacement.err" || fail "the replacement did not say whose place it took"
      if [[ $case_name == power_off_node0 ]]; then
        store_silent
        kill -KILL $frozen 2>/dev/null
        wait "$old"
      else
        grep -q "node 0's agent is gone, and with it the store at node1:$port" "$work/node2.err" ||
          fail "node2 did not say that node 0's agent and its store were gone"
      fi
    else
      grep -q "takes the place of node 1's agent, which is gone" "$work/node2.replacement.err" ||
        fail "the replacement did not say whose place it took"
    fi
    # The new node's ranks had no copies: each took its own from its buddy (the
    # next node's agent), and every rank resumed from memory (nothing read from the disk).
    grep -q "memory tier: rank(s) $new_ranks had no copy of their newest step on their node.*from its buddy" \
      "$work/$rank0.err" || fail "the replacement's ranks did not take their copies from their buddy"
    ended_whole "$rank0" "after the replacement" "replaced node$lost and resumed from memory"
    ;;
  loopback_hostname)
    cluster_up 2 1gbit
    cluster_hosts_loopback node1
    start=$(date +%s)
    two_nodes "$bin/dtrain_whoami" --rendezvous
    took=$(($(date +%s) - start))
    cat "$work/node1.out" "$work/node2.out" >"$work/all.out"
    if ((status1 == 0 && status2 == 0)); then
      check_world "$work/all.out" "0:node1:0:0 1:node1:0:1 2:node2:1:0 3:node2:1:1"
      echo "works with node1 on 127.0.1.1 (${took} s)"
    else
      ((took < limit - 5)) || fail "the job ran into the test's limit (a hang) instead of failing at once"
      grep -q "127.0.1.1" "$work/node1.err" "$work/node2.err" ||
        fail "the job failed without naming 127.0.1.1 (exit $status1 / $status2)"
      echo "failed at once (${took} s), saying:"; grep -h "127.0.1.1" "$work"/*.err | head -3
    fi
    # Per-process launch (torchrun's environment set by hand): rank 0 hosts the store.
    pids=()
    for r in 0 1 2 3; do
      cluster_run "node$((r / 2 + 1))" env RANK=$r WORLD_SIZE=4 MASTER_ADDR=node1 MASTER_PORT=$((port + 1)) \
        timeout "$limit" "$bin/dtrain_whoami" --rendezvous >"$work/rank$r.out" 2>"$work/rank$r.err" &
      pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || fail "a per-process rank exited with $?"; done
    cat "$work"/rank?.out >"$work/per_process.out"
    check_world "$work/per_process.out" "0:node1:0:0 1:node1:0:1 2:node2:1:0 3:node2:1:1"
    echo "per-process launch works with node1 on 127.0.1.1"
    ;;
  metrics_endpoint)
    cluster_up 2 1gbit
    # Each worker writes a metrics file where the agent says (DTRAIN_METRICS_DIR), then waits.
    worker=(bash -c 'printf "# HELP dtrain_step The last step.\n# TYPE dtrain_step gauge\ndtrain_step{rank=\"%s\"} 7\n" "$RANK" >"$DTRAIN_METRICS_DIR/dtrain_rank$RANK.prom"; exec sleep 60')
    ip1=$(cluster_ip node1)
    # get NODE URL [TOKEN]: prints the HTTP status of a GET from NODE ("000": no connection);
    # the body in $work/body.
    get() {
      cluster_run "$1" python3 - "$2" "${3:-}" "$work/body" <<'PY'
import sys, urllib.error, urllib.request
url, token, body = sys.argv[1:4]
request = urllib.request.Request(url, headers={"Authorization": "Bearer " + token} if token else {})
try:
    with urllib.request.urlopen(request, timeout=5) as r:
        status, data = r.status, r.read()
except urllib.error.HTTPError as e:
    status, data = e.code, e.read()
except OSError:
    status, data = 0, b""
open(body, "wb").write(data)
print(f"{status:03d}")
PY
    }
    # wait_served URL: waits until both workers' samples are served on node1 (with the token).
    wait_served() {
      for _ in $(seq 300); do
        [[ $(get node1 "$1" "${2:-}") == 200 ]] && (($(grep -c '^dtrain_step{' "$work/body") == 2)) && return 0
        sleep 0.1
      done
      fail "the endpoint $1 never served both workers' samples"
    }
    cluster_run node1 env DTRAIN_METRICS_BIND="$ip1" DTRAIN_METRICS_TOKEN=metrics-secret \
      timeout "$limit" "$bin/dtrun" --nproc-per-node 2 --metrics-port 9400 -- "${worker[@]}" \
      >"$work/guarded.out" 2>"$work/guarded.err" &
    guarded=$!
    url=http://$ip1:9400/metrics
    wait_served "$url" metrics-secret
    grep -q "node 0's workers' metrics at http://$ip1:9400/metrics (a token is needed)" "$work/guarded.err" ||
      fail "dtrun did not say where the metrics are"
    [[ $(get node2 "$url") == 401 ]] || fail "node2 without the token was not refused (401)"
    [[ $(get node2 "$url" wrong-secret) == 401 ]] || fail "node2 with a wrong token was not refused"
    [[ $(get node2 "$url" metrics-secret) == 200 ]] || fail "node2 with the token was refused"
    [[ $(grep -c '^# TYPE dtrain_step gauge$' "$work/body") == 1 ]] || fail "the family is not declared once"
    grep -q '^dtrain_step{rank="0"} 7$' "$work/body" && grep -q '^dtrain_step{rank="1"} 7$' "$work/body" ||
      fail "node2 did not get both workers' samples: $(cat "$work/body")"
    kill -TERM "$guarded"
    wait "$guarded"
    # The default: loopback only, without a token.
    cluster_run node1 timeout "$limit" "$bin/dtrun" --nproc-per-node 2 --metrics-port 9401 -- "${worker[@]}" \
      >"$work/loopback.out" 2>"$work/loopback.err" &
    loopback=$!
    wait_served http://127.0.0.1:9401/metrics
    [[ $(get node2 "http://$ip1:9401/metrics") == 000 ]] || fail "node2 reached the loopback-only endpoint"
    kill -TERM "$loopback"
    wait "$loopback"
    # Off loopback without a token: refused at the start, named.
    cluster_run node1 env DTRAIN_METRICS_BIND="$ip1" timeout "$limit" "$bin/dtrun" --nproc-per-node 1 \
      --metrics-port 9402 -- true >"$work/open.out" 2>"$work/open.err"
    status=$?
    ((status == 2)) || fail "dtrun with DTRAIN_METRICS_BIND off loopback and no token exited with $status, not 2"
    grep -q "DTRAIN_METRICS_BIND=$ip1: the metrics endpoint listens on another address than loopback only with a token" "$work/open.err" ||
      fail "the refusal does not name DTRAIN_METRICS_BIND"
    echo "node2: 401 without the token, 200 with it (2 workers' samples, one family); loopback-only by default"
    ;;
  killed_worker)
    cluster_up 2 1gbit
    worker=(bash -c 'echo "rank $RANK on $(hostname): $$"; exec sleep 60')
    dtrun_on node1 0 "${worker[@]}" >"$work/node1.out" 2>"$work/node1.err" &
    first=$!
    dtrun_on node2 1 "${worker[@]}" >"$work/node2.out" 2>"$work/node2.err" &
    second=$!
    victim=""
    for _ in $(seq 100); do  # the workers of node2 start within seconds
      victim=$(grep -ho 'rank [0-9]* on node2: [0-9]*' "$work/node2.out" 2>/dev/null | head -n 1)
      [[ -n $victim ]] && break
      sleep 0.1
    done
    [[ -n $victim ]] || fail "no worker started on node2"
    rank=$(awk '{print $2}' <<<"$victim")
    pid=$(awk '{print $5}' <<<"$victim")
    start=$(date +%s)
    kill -9 "$pid"
    wait "$first"
    status1=$?
    took=$(($(date +%s) - start))
    wait "$second"
    echo "killed rank $rank (pid $pid) on node2; node1's dtrun exited with $status1 after ${took} s"
    ((status1 != 0)) || fail "node1's dtrun exited with 0 after a worker of node2 was killed"
    ((took < limit - 5)) || fail "node1's dtrun did not end before the test's limit"
    grep -q "rank $rank" "$work/node1.err" || fail "node1's dtrun did not name rank $rank"
    grep -h "rank $rank" "$work/node1.err" | head -3
    ;;
  hierarchical_gloo)
    need_peer
    cluster_up 2 1gbit
    for case in topology mean; do
      two_nodes env DTRAIN_COLLECTIVE_TIMEOUT=60 "$tests_bin/dtrain_ddp_peer" --engine=gloo --topology=hierarchical --test-case="$case"
      ((status1 == 0 && status2 == 0)) || fail "the $case case exited with $status1 on node1, $status2 on node2"
      cat "$work/node1.out" "$work/node2.out" >"$work/$case.out"
    done
    expect_lines "$work/topology.out" 4 "topology group: hierarchical (gloo): 2 nodes x 2 ranks"
    expect_lines "$work/mean.out" 28 "gradients equal the mean"
    grep -h "rank 0:" "$work/topology.out" "$work/mean.out" | head -4
    ;;
  hierarchical_mpi)
    need_peer
    cluster_up 2 1gbit
    for case in topology mean; do
      mpirun_across node -x DTRAIN_COLLECTIVE_TIMEOUT=60 "$tests_bin/dtrain_ddp_peer" --engine=mpi --topology=hierarchical --test-case="$case" \
        >"$work/$case.out"
    done
    expect_lines "$work/topology.out" 4 "topology group: hierarchical (mpi): 2 nodes x 2 ranks"
    expect_lines "$work/mean.out" 28 "gradients equal the mean"
    grep -h "rank 0:" "$work/topology.out" "$work/mean.out" | head -4
    ;;
  doctor)
    [[ -x $bin/dtrain_doctor ]] || { echo "SKIPPED: dtrain_doctor is not built"; exit 77; }
    cluster_up 2 1gbit
    cluster_hosts_loopback node1
    cluster_run node1 env MASTER_ADDR=node2 "$bin/dtrain_doctor" >"$work/node1.out" 2>&1
    status1=$?
    cluster_run node2 env MASTER_ADDR=node1 "$bin/dtrain_doctor" >"$work/node2.out" 2>&1
    status2=$?
    cat "$work/node1.out"
    ((status1 == 1)) || fail "the doctor on node1 (named on 127.0.1.1) exited with $status1, expected 1"
    grep -q "! the host name node1 resolves to 127.0.1.1" "$work/node1.out" ||
      fail "the doctor on node1 did not name the 127.0.1.1 host name"
    grep -q "fix: map node1 to this node's routable address in /etc/hosts" "$work/node1.out" ||
      fail "the doctor on node1 gave no fix for the 127.0.1.1 host name"
    grep -q "gloo eth0: the interface whose address reaches MASTER_ADDR=node1" "$work/node2.out" ||
      fail "the doctor on node2 did not find the interface towards node1"
    grep -q "127.0.1.1" "$work/node2.out" && fail "the doctor on node2 reported node1's trap"
    echo "--- node2 (exit $status2):"
    grep -E "eth0|gloo" "$work/node2.out"
    ;;
  *)
    echo "test_cluster.sh: unknown case '$case_name'" >&2
    exit 2
    ;;
esac
echo "cluster.$case_name: ok"
