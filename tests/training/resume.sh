#!/usr/bin/env bash
# training.resume.* (issue 33): the demo, killed and resumed from its
# checkpoints, ends with the weights of a run that never stopped, bit for bit.
#
#   resume.sh <case> <dtrain_train_mlp> [<dtrain_train_mlp_mpi> <mpiexec> <mpiexec args>...]
#
# cases:
#   kill_worker  4 Gloo workers under their node agent, one restart allowed;
#                a random worker SIGKILLed at a random moment after the first
#                checkpoint (seeded by DTRAIN_TEST_SEED, printed): the agent
#                restarts the workers, they resume, and the final checksum is
#                the uninterrupted run's. Then the newest checkpoint is
#                truncated and the run repeated: it resumes from the one before,
#                naming the file, and ends with the same checksum again.
#   kill_worker_stage3  kill_worker at ZeRO stage 3 (--sharding 3): the values
#                and the optimizer state saved as shards, each rank its own.
#   kill_worker_memory  kill_worker with the memory tier (--memory-every 1, the
#                disk every 20): the restarted workers resume from their node
#                agent's memory copy (nothing read from the checkpoint directory),
#                at most one step is trained twice (counted from --sample-log), the
#                checksum is the uninterrupted run's, and the agent's directory in
#                memory is gone after the job.
#   kill_worker_memory_beside  the same with --memory-beside-step: the copy
#                read beside the next step, until before_update(). A worker
#                killed then loses that copy: at most one step trained twice
#                still, but two when it waited in before_update() for its
#                reads (each rank reads its slice of the replicated part)
#                while the others finished the step. A kill during a disk
#                save, or in the step after it, resumes from memory too (that
#                step() writes the copy itself, first).
#   kill_worker_memory_budget  kill_worker_memory with --memory-every 30
#                --memory-budget 0.03: the ranks agree on the steps between
#                copies (rank 0 says how many, the demo's last line says it
#                again), the restarted workers resume from the newest copy, in
#                memory or (when it is older) on disk, at most 30 steps are
#                trained twice, and the checksum is the uninterrupted run's.
#   torch_kill_worker_memory  kill_worker_memory for the LibTorch example on 2
#                workers at ZeRO stage 3 (each rank's shard of the values and of
#                the momentum in its memory copy): resumed from memory,
#                bit-identical (it has no --sample-log: the steps trained twice
#                are not counted).
#   kill_in_save the same, with the kill as soon as a save is seen in progress
#                (a step-N.partial directory): that save is never used.
#   torch_kill_worker  kill_worker for the LibTorch example (dtrain_train_torch)
#                on 2 workers: module, optimizer and sampler through dtrain::torch.
#   torch_kill_worker_stage3  torch_kill_worker at ZeRO stage 3: the module's
#                values as shards (dtrain::torch::add_module(ckpt, ddp)).
#   mpi          2 MPI ranks: one killed after the first checkpoint ends the
#                mpirun job (it cannot restart a rank); the same command run
#                again resumes and ends with the uninterrupted run's checksum.
#   disk_full    the checkpoint directory on a 3 MiB tmpfs (needs root): the
#                second save finds no space, the job fails naming the path, and
#                the first checkpoint still resumes. Skipped (77) without mount.
#   memory_full  the memory tier (DTRAIN_MEMORY_CHECKPOINT_DIR) on a 4 MiB tmpfs
#                (needs root), a copy every step of a 2.4 MB state: the first
#                copy fits, the next find no room, which each rank says, by
#                path, once; no worker dies, and the job ends 0 with the
#                uninterrupted run's checksum. Skipped (77) without mount.
set -uo pipefail

case_name=$1
train=$2
shift 2
work=$(mktemp -d "${TMPDIR:-/tmp}/dtrain-resume.XXXXXX")
mounted=""
cleanup() {
  [[ -n $mounted ]] && umount "$mounted" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
seed=${DTRAIN_TEST_SEED:-$(((RANDOM << 15) | RANDOM))}
RANDOM=$seed
echo "resume.sh $case_name: seed $seed (DTRAIN_TEST_SEED=$seed repeats this run)"

fail() {
  echo "FAILED: $*" >&2
  exit 1
}
# A model large enough that a run lasts about two seconds and a save some milliseconds.
model=(--epochs 4 --samples 8192 --features 64 --hidden 256 --batch-size 32)
# Counts the demo's --sample-log: the steps trained twice across the restart.
sample_log="$(dirname "${BASH_SOURCE[0]}")/../scripts/sample_log.py"
checksum_of() { sed -n 's/.*hold identical weights (checksum \([0-9a-f]*\)).*/\1/p' "$1" | tail -n 1; }

# run_logged <log> <command>...: the command's output in <log>; its exit status.
run_logged() {
  local log=$1
  shift
  "$@" >"$log" 2>&1
}

# past_third: $dir (the checkpoints' directory) holds the checkpoint of step
# 3 x $every or a later one.
past_third() {
  local newest
  newest=$(compgen -G "$dir/step-*[0-9]" | sed 's/.*step-//' | sort -n | tail -n 1)
  ((${newest:-0} >= 3 * every))
}

# kill_worker_after <dir> <pid of the agent> <mode: random|in_save> <steps between saves>:
# kills one of the agent's workers once <dir> holds a committed checkpoint.
kill_worker_after() {
  local dir=$1 agent=$2 mode=$3 every=$4 deadline=$((SECONDS + 60))
  until compgen -G "$dir/step-*[0-9]" >/dev/null; do
    ((SECONDS < deadline)) || { cat "$work/killed.log"; fail "no checkpoint appeared in $dir within 60 s"; }
    kill -0 "$agent" 2>/dev/null || { cat "$work/killed.log"; fail "the job ended before its first checkpoint"; }
    sleep 0.01
  done
  local what="at a random moment"
  # Never later than the third checkpoint: a fast machine trains the whole
  # run in well under a second (CI's did), and then no worker is left to kill.
  if [[ $mode == in_save ]]; then
    # Catch a save in progress: its partial directory exists. Saves take
    # milliseconds, so look often; if none is seen in 3 s, kill anyway.
    local tries=0 partial
    what="(no save in progress was caught: killed between saves)"
    while ((tries++ < 3000)); do
      partial=$(compgen -G "$dir/step-*.partial" | head -n 1)
      if [[ -n $partial ]]; then  # read once: the save may commit meanwhile
        what="while $(basename "$partial") was being written"
        break
      fi
      past_third && break
      sleep 0.001
    done
  else
    # A random moment up to 0.4 s later.
    local until
    until=$(($(date +%s%3N) + RANDOM % 400))
    while (($(date +%s%3N) < until)) && ! past_third; do sleep 0.01; done
  fi
  # The agent's workers: its children with a RANK (not its warden, which has none).
  local workers=() victim child
  for child in $(pgrep -P "$agent"); do
    if tr '\0' '\n' <"/proc/$child/environ" 2>/dev/null | grep -q '^RANK='; then workers+=("$child"); fi
  done
  ((${#workers[@]} > 0)) || fail "the agent $agent has no workers left to kill"
  victim=${workers[$((RANDOM % ${#workers[@]}))]}
  kill -KILL "$victim" 2>/dev/null || fail "worker $victim was gone before it could be killed"
  echo "killed worker $victim of ${#workers[@]} $what"
}

# mount_small <dir> <size>: a tmpfs of <size> at <dir>, unmounted at the end;
# without root (mount), the case is skipped (exit 77).
mount_small() {
  mkdir -p "$1"
  if ! mount -t tmpfs -o "size=$2" tmpfs "$1" 2>/dev/null; then
    echo "SKIPPED: cannot mount a small tmpfs here (needs root and CAP_SYS_ADMIN)"
    exit 77
  fi
  mounted=$1
}

reference() {  # <log> <command>...: an uninterrupted run's checksum
  local log=$1
  shift
  # (on stderr: the caller takes this function's stdout as the checksum)
  local status=0
  run_logged "$log" "$@" || status=$?
  ((status == 0)) || { cat "$log" >&2; fail "the uninterrupted run failed (exit status $status)"; }
  local sum
  sum=$(checksum_of "$log")
  [[ -n $sum ]] || { cat "$log" >&2; fail "the uninterrupted run printed no checksum"; }
  echo "$sum"
}

case $case_name in
  kill_worker | kill_worker_stage3 | kill_in_save | torch_kill_worker | torch_kill_worker_stage3)
    cmd=("$train" --nproc-per-node 4 "${model[@]}")
    every=20
    [[ $case_name == kill_worker_stage3 ]] && cmd+=(--sharding 3)
    if [[ $case_name == torch_kill_worker* ]]; then
      cmd=("$train" --nproc-per-node 2 --epochs 4 --samples 2048)
      every=10
      [[ $case_name == torch_kill_worker_stage3 ]] && cmd+=(--sharding 3)
    fi
    want=$(reference "$work/reference.log" "${cmd[@]}") || exit 1
    echo "uninterrupted: checksum $want"
    dir="$work/ckpt"
    DTRAIN_MAX_RESTARTS=1 "${cmd[@]}" --checkpoint-dir "$dir" --checkpoint-every "$every" \
      >"$work/killed.log" 2>&1 &
    agent=$!
    mode=random
    [[ $case_name == kill_in_save ]] && mode=in_save
    kill_worker_after "$dir" "$agent" "$mode" "$every"
    wait "$agent"
    status=$?
    grep -E "restarting|resumed|no checkpoint|checksum|Error|error" "$work/killed.log"
    ((status == 0)) || { cat "$work/killed.log"; fail "the killed job exited $status"; }
    grep -q "resumed from $dir/step-" "$work/killed.log" || fail "the restarted workers did not resume"
    got=$(checksum_of "$work/killed.log")
    [[ $got == "$want" ]] || fail "resumed run's checksum $got, uninterrupted $want"
    echo "resumed after the kill: checksum $got, bit-identical"
    [[ -z $(compgen -G "$dir/*.partial") ]] || fail "a partial save was left in $dir: $(ls "$dir")"

    # The newest checkpoint damaged: the one before it is used, and named why.
    newest=$(ls -d "$dir"/step-* | sort -t- -k2 -n | tail -n 1)
    truncate -s -1 "$newest/replicated.dtck"
    run_logged "$work/damaged.log" "${cmd[@]}" --checkpoint-dir "$dir" --checkpoint-every "$every" ||
      { cat "$work/damaged.log"; fail "the run after the damage failed"; }
    grep -E "skipped|resumed" "$work/damaged.log"
    grep -q "$newest/replicated.dtck is truncated" "$work/damaged.log" ||
      fail "the damaged checkpoint was not named"
    grep -q "resumed from $dir/step-" "$work/damaged.log" || fail "no resume after the damage"
    got=$(checksum_of "$work/damaged.log")
    [[ $got == "$want" ]] || fail "after the damaged checkpoint: checksum $got, uninterrupted $want"
    echo "resumed past the damaged $newest: checksum $got, bit-identical"
    ;;

  kill_worker_memory | kill_worker_memory_beside | kill_worker_memory_budget | torch_kill_worker_memory)
    cmd=("$train" --nproc-per-node 4 "${model[@]}")
    samples=(--sample-log "$work/samples")
    if [[ $case_name == torch_* ]]; then
      cmd=("$train" --nproc-per-node 2 --epochs 4 --samples 2048 --sharding 3)
      samples=()
    fi
    want=$(reference "$work/reference.log" "${cmd[@]}") || exit 1
    echo "uninterrupted: checksum $want"
    dir="$work/ckpt"
    mkdir "$work/samples"
    memory=(--memory-every 1)
    [[ $case_name == kill_worker_memory_beside ]] && memory+=(--memory-beside-step)
    [[ $case_name == kill_worker_memory_budget ]] && memory=(--memory-every 30 --memory-budget 0.03)
    DTRAIN_MAX_RESTARTS=1 "${cmd[@]}" --checkpoint-dir "$dir" --checkpoint-every 20 "${memory[@]}" \
      "${samples[@]}" >"$work/killed.log" 2>&1 &
    agent=$!
    kill_worker_after "$dir" "$agent" random 20
    wait "$agent"
    status=$?
    grep -E "restarting|resumed|memory|checksum|Error|error" "$work/killed.log"
    ((status == 0)) || { cat "$work/killed.log"; fail "the killed job exited $status"; }
    if [[ $case_name == kill_worker_memory_budget ]]; then
      # The newest copy, wherever it is: one in memory older than the disk's is not used.
      grep -qE "resumed from (the memory copy of step [0-9]* in /.* \(nothing read from $dir\)|$dir/step-)" \
        "$work/killed.log" || fail "the restarted workers did not resume"
      grep -q "memory tier: a copy every [0-9]* steps* (a copy costs .*memory_budget" \
        "$work/killed.log" || fail "rank 0 did not say the steps between copies it agreed on"
      interval=$(sed -n 's/^memory copies every \([0-9]*\) steps at the end.*/\1/p' "$work/killed.log")
      echo "memory copies every ${interval:-?} steps at the end"
      ((${interval:-0} >= 1 && interval <= 30)) || fail "the steps between copies are '$interval', not 1 to 30"
    else
      grep -q "resumed from the memory copy of step [0-9]* in /.* (nothing read from $dir)" \
        "$work/killed.log" || fail "the restarted workers did not resume from their memory copy"
    fi
    got=$(checksum_of "$work/killed.log")
    [[ $got == "$want" ]] || fail "resumed run's checksum $got, uninterrupted $want"
    echo "resumed from memory after the kill: checksum $got, bit-identical"
    leftovers=$(compgen -G "/dev/shm/dtrain-memory-$agent-*")
    [[ -z $leftovers ]] || fail "the agent's memory directory is left: $leftovers"
    [[ $case_name == torch_* ]] && exit 0  # no --sample-log to count
    # Steps trained twice (one restart: round 0's steps at or after round 1's
    # first that round 0 trained; a line is written as a step begins, so a
    # step was trained when the next one began).
    again=$(python3 "$sample_log" twice "$work/samples") ||
      fail "could not count the steps trained twice in $work/samples"
    echo "steps trained twice: $again"
    allowed=1
    [[ $case_name == kill_worker_memory_budget ]] && allowed=30  # --memory-every: the most between copies
    if [[ $case_name == kill_worker_memory_beside ]]; then
      allowed=2  # the killed rank's copy, read beside the next step, may be lost (the comment at the top)
      echo "copies read beside the step: the killed rank's may be lost, 2 steps allowed"
    fi
    ((again <= allowed)) || fail "$again steps were trained twice (the memory tier allows $allowed)"
    ;;

  mpi)
    mpi_train=$1
    shift
    cmd=("$@" "$mpi_train" "${model[@]}")
    want=$(reference "$work/reference.log" "${cmd[@]}") || exit 1
    echo "uninterrupted (MPI): checksum $want"
    dir="$work/ckpt"
    "${cmd[@]}" --checkpoint-dir "$dir" --checkpoint-every 20 >"$work/killed.log" 2>&1 &
    launcher=$!
    deadline=$((SECONDS + 60))
    until compgen -G "$dir/step-*[0-9]" >/dev/null; do
      ((SECONDS < deadline)) || { cat "$work/killed.log"; fail "no checkpoint appeared within 60 s"; }
      kill -0 "$launcher" 2>/dev/null || { cat "$work/killed.log"; fail "the job ended before its first checkpoint"; }
      sleep 0.01
    done
    # A random moment up to 0.5 s later, but never after the third checkpoint:
    # the whole run takes about 0.6 s here, and a kill after its end finds no rank.
    every=20
    until=$(($(date +%s%3N) + RANDOM % 500))
    while (($(date +%s%3N) < until)) && ! past_third; do sleep 0.01; done
    victim=$(pgrep -f "^$mpi_train " | head -n 1)
    [[ -n $victim ]] || fail "no rank of $mpi_train to kill"
    kill -KILL "$victim"
    wait "$launcher"
    status=$?
    ((status != 0)) || echo "note: the job had ended before the kill landed"
    echo "killed rank process $victim; mpirun exited $status; running the same command again"
    run_logged "$work/rerun.log" "${cmd[@]}" --checkpoint-dir "$dir" --checkpoint-every 20 ||
      { cat "$work/rerun.log"; fail "the rerun failed"; }
    grep -q "resumed from $dir/step-" "$work/rerun.log" || fail "the rerun did not resume"
    got=$(checksum_of "$work/rerun.log")
    [[ $got == "$want" ]] || fail "rerun's checksum $got, uninterrupted $want"
    echo "the rerun resumed: checksum $got, bit-identical"
    ;;

  disk_full)
    dir="$work/small"
    mount_small "$dir" 3m
    cmd=("$train" --nproc-per-node 2 "${model[@]}" --hidden 512)
    run_logged "$work/full.log" "${cmd[@]}" --checkpoint-dir "$dir" --checkpoint-every 30
    status=$?
    grep -E "checkpoint" "$work/full.log" | head -n 5
    ((status != 0)) || fail "the job did not fail when its disk was full"
    grep -q "No space left on device" "$work/full.log" || fail "the error does not say the disk is full"
    grep -q "$dir/step-" "$work/full.log" || fail "the error does not name the path"
    run_logged "$work/after.log" "${cmd[@]}" --checkpoint-dir "$dir" --epochs 1 ||
      { cat "$work/after.log"; fail "the checkpoint before the full disk does not load"; }
    grep -q "resumed from $dir/step-30" "$work/after.log" ||
      { cat "$work/after.log"; fail "the checkpoint before the full disk was not used"; }
    echo "disk full: the job failed naming the path; step-30 still resumes"
    ;;

  memory_full)
    dir="$work/small-memory"
    mount_small "$dir" 4m
    # Rank 0 writes the replicated part: 1.2 MB of values and as much momentum.
    cmd=("$train" --nproc-per-node 2 "${model[@]}" --hidden 512)
    want=$(reference "$work/reference.log" "${cmd[@]}") || exit 1
    DTRAIN_MEMORY_CHECKPOINT_DIR=$dir run_logged "$work/full.log" "${cmd[@]}" \
      --checkpoint-dir "$work/ckpt" --memory-every 1
    status=$?
    grep -E "memory|checksum|restarting|signal" "$work/full.log" | head -n 5
    ((status == 0)) || { cat "$work/full.log"; fail "the job exited $status with its memory full"; }
    grep -q "its memory copy of step [0-9]* was not written (.*$dir/.*No space left on device" \
      "$work/full.log" || { cat "$work/full.log"; fail "the full memory was not said, by path"; }
    ! grep -q "restarting" "$work/full.log" || fail "a worker died"
    got=$(checksum_of "$work/full.log")
    [[ $got == "$want" ]] || fail "checksum $got, uninterrupted $want"
    echo "memory full: said by name, no worker died, checksum $got as uninterrupted"
    ;;

  *)
    fail "unknown case $case_name"
    ;;
esac
