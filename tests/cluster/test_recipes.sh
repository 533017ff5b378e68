#!/usr/bin/env bash
# tests/cluster/test_recipes.sh CASE BIN_DIR: runs one recipe of examples/clusters/
# (docs/clusters.md), the file itself, on the simulated cluster (cluster.sh), with
# the environment its launcher or operator sets, and checks the world every rank
# completed at rendezvous. BIN_DIR holds dtrun and dtrain_whoami. The recipes' program
# (./train, or train on PATH) is dtrain_whoami --rendezvous. Exit 0 pass, 1 fail, 77 skip.
#
#   slurm_dtrun       slurm-dtrun.sbatch run as sbatch would (its #SBATCH lines, the batch
#                     step's SLURM_* on node1), with an srun stand-in on PATH that starts
#                     each task on its node with srun's SLURM_* (the compressed node list)
#   slurm_srun        slurm-srun.sbatch, the same way
#   openmpi_hostfile  openmpi-hostfile.sh HOSTFILE on node1: mpirun across the nodes
#   openmpi_dtrun     openmpi-dtrun.sh HOSTFILE on node1: one dtrun per node under mpirun
#   pytorchjob        pytorchjob.yaml: each pod's command on its node, with the env of the
#                     training operator (recipes.py), the service name resolving to node1
#   trainjob          trainjob.yaml: the same with Kubeflow Trainer's PET_* environment
#   mpijob            mpijob.yaml: the launcher's command on a third node with the
#                     operator's hostfile and OMPI_MCA_* (workers by service name)
#   azureml_pytorch   azureml-pytorch.yml: its command in every process Azure ML starts
#                     (PyTorch distribution: MASTER_ADDR, MASTER_PORT=6105, RANK, ...,
#                     and AZ_BATCH_MASTER_NODE=node1:6000, whose port is not used)
#   azureml_mpi       azureml-mpi.yml: its command under mpirun (MPI distribution:
#                     OMPI_COMM_WORLD_*, AZ_BATCH_MASTER_NODE=node1:6000, Batch's own port)
#
# What stands in for the cluster, and only that, is the test's: the ssh and srun
# stand-ins, Open MPI's interface and ssh settings (OMPI_MCA_*, as root), the names
# the cluster's DNS would resolve, and the secret a Kubernetes Secret would hold.
set -uo pipefail
case_name=${1:?case}
bin=$(cd "${2:?bin dir}" && pwd)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
recipes=$(cd "$here/../../examples/clusters" && pwd)
source "$here/cluster.sh"

for program in dtrun dtrain_whoami; do
  [[ -x $bin/$program ]] || { echo "SKIPPED: $bin/$program is not built"; exit 77; }
done
case $case_name in
  pytorchjob | trainjob | mpijob | azureml_*)
    python3 -c 'import yaml' 2>/dev/null ||
      { echo "SKIPPED: needs python3 with yaml (Debian: python3-yaml) to read the recipe"; exit 77; } ;;
esac
case $case_name in
  openmpi_* | mpijob | azureml_mpi)
    command -v mpirun >/dev/null || { echo "SKIPPED: mpirun not found"; exit 77; }
    mpirun --version 2>&1 | grep -q "Open MPI" || { echo "SKIPPED: needs Open MPI's mpirun"; exit 77; } ;;
esac
work=$(mktemp -d)
cluster_exit_hook='rm -rf "$work"'
trap 'rm -rf "$work"' EXIT  # cluster_up replaces it with one that also removes the cluster
limit=60  # seconds for the job: a hang fails the test, with the output so far

fail() { cluster_fail "$@"; }

# The program of every recipe: ./train in the job's directory, train on PATH.
mkdir -p "$work/job" "$work/path"
cat >"$work/job/train" <<EOF
#!/bin/sh
echo "\$*" >>"$work/args"
exec "$bin/dtrain_whoami" --rendezvous
EOF
chmod +x "$work/job/train"
ln -s "$work/job/train" "$work/path/train"
path="$work/path:$bin:/usr/local/bin:/usr/bin:/bin"
# A container's environment: what its image sets (here PATH), then the operator's.
container=(env -i "PATH=$path" HOME=/root ${LD_LIBRARY_PATH:+"LD_LIBRARY_PATH=$LD_LIBRARY_PATH"})

# "${in_dir[@]}" DIR CMD...: CMD in DIR (a command, for cluster_run and timeout to start).
in_dir=(bash -c 'cd "$0" && exec "$@"')

# expect_world NODES PER_NODE SOURCE: every rank of NODES x PER_NODE printed its completed
# world ($work/*.out), and got the recipe's program arguments.
expect_world() {
  cat "$work"/*.out >"$work/world" 2>/dev/null
  python3 "$here/recipes.py" check "$work/world" "$@" || fail "the completed world is wrong"
  local size=$(($1 * $2)) got
  got=$(grep -cx -- "--epochs 10" "$work/args" 2>/dev/null)
  ((got == size)) && (($(wc -l <"$work/args") == size)) ||
    fail "expected $size starts of the program with '--epochs 10', got: $(sort "$work/args" | uniq -c | tr '\n' ';')"
}

# Open MPI on the simulated nodes: ssh is cluster_rsh, the links eth0; as root.
mpi_settings() {
  echo OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "OMPI_MCA_plm_rsh_agent=${1:-$(cluster_rsh)}" \
    OMPI_MCA_btl=tcp,self,vader OMPI_MCA_btl_tcp_if_include=eth0 OMPI_MCA_oob_tcp_if_include=eth0
}

# resolve NAME=NODE...: NAME resolves to NODE's address on every node (the cluster's DNS).
resolve() {
  local entry n
  for entry in "$@"; do
    for ((n = 1; n <= cluster_nodes; n++)); do
      echo "$(cluster_ip "node${entry#*=}") ${entry%=*}" >>"/etc/netns/$(cluster_ns "$cluster_id" "$n")/hosts"
    done
  done
}

# sbatch_run SCRIPT: what sbatch does with SCRIPT: its #SBATCH lines give the allocation,
# and it runs on the first node, in the submit directory, with the batch step's SLURM_*
# (no SLURM_STEP_ID) and the srun stand-in on PATH.
sbatch_run() {
  local script=$1 nodes tasks
  directive() { sed -n "s/^#SBATCH --$1=\([^ ]*\).*/\1/p" "$script" | tail -n 1; }
  nodes=$(directive nodes)
  tasks=$(directive ntasks-per-node)
  [[ $nodes == 2 ]] || fail "$(basename "$script") asks for --nodes=$nodes; the simulated cluster has 2"
  [[ $tasks =~ ^[0-9]+$ ]] || fail "$(basename "$script") has no #SBATCH --ntasks-per-node"
  cat >"$work/path/srun" <<EOF
#!/usr/bin/env bash
# srun stand-in: the step's tasks on the simulated nodes, block distribution, each with
# the SLURM_* srun gives a task; exits with the highest task status, as srun does.
source '$here/cluster.sh'
cluster_id=$cluster_id cluster_nodes=$cluster_nodes cluster_net=$cluster_net
per_node=\${SLURM_NTASKS_PER_NODE:-1}
while [[ \$# -gt 0 && \$1 == -* ]]; do
  case \$1 in
    --ntasks-per-node=*) per_node=\${1#*=} ;;
    *) echo "srun stand-in: \$1 is not modelled" >&2; exit 2 ;;
  esac
  shift
done
nodes=\$SLURM_JOB_NUM_NODES ntasks=\$((nodes * per_node)) pids=()
for ((n = 0; n < nodes; n++)); do
  for ((l = 0; l < per_node; l++)); do
    cluster_run "node\$((n + 1))" env SLURM_STEP_ID=0 SLURM_STEPID=0 SLURM_PROCID=\$((n * per_node + l)) \\
      SLURM_LOCALID=\$l SLURM_NODEID=\$n SLURMD_NODENAME=node\$((n + 1)) SLURM_NTASKS=\$ntasks \\
      SLURM_NPROCS=\$ntasks SLURM_STEP_NUM_TASKS=\$ntasks SLURM_NNODES=\$nodes SLURM_STEP_NUM_NODES=\$nodes \\
      SLURM_NTASKS_PER_NODE=\$per_node SLURM_TASKS_PER_NODE="\$per_node(x\$nodes)" \\
      SLURM_STEP_TASKS_PER_NODE="\$per_node(x\$nodes)" SLURM_STEP_NODELIST="\$SLURM_JOB_NODELIST" \\
      SLURM_NODELIST="\$SLURM_JOB_NODELIST" bash -c 'cd "\$0" && exec "\$@"' "\$PWD" "\$@" &
    pids+=(\$!)
  done
done
status=0
for pid in "\${pids[@]}"; do wait "\$pid" || { s=\$?; ((s > status)) && status=\$s; }; done
exit \$status
EOF
  chmod +x "$work/path/srun"
  cluster_run node1 env "PATH=$path" SLURM_JOB_ID=4242 SLURM_JOBID=4242 SLURM_JOB_NAME=dtrain \
    SLURM_JOB_NODELIST="node[1-2]" SLURM_NODELIST="node[1-2]" SLURM_JOB_NUM_NODES=2 SLURM_NNODES=2 \
    SLURM_NTASKS=$((2 * tasks)) SLURM_NPROCS=$((2 * tasks)) SLURM_NTASKS_PER_NODE="$tasks" \
    SLURM_TASKS_PER_NODE="$tasks(x2)" SLURM_SUBMIT_DIR="$work/job" SLURM_SUBMIT_HOST=node1 \
    SLURMD_NODENAME=node1 SLURM_NODEID=0 SLURM_PROCID=0 SLURM_LOCALID=0 \
    timeout "$limit" bash -c 'cd "$0" && exec bash "$1"' "$work/job" "$script" \
    >"$work/job.out" 2>"$work/job.err"
  status=$?
  ((status == 0)) || fail "sbatch $(basename "$script"): the script exited with $status"
}

# run_pods FILE: every pod (process) of the recipe FILE on its node, with the environment
# recipes.py models for its operator, its command as argv; waits for all.
run_pods() {
  local i pids=() status=0
  eval "$(python3 "$here/recipes.py" pods "$1" "$work/hostfile" $(cluster_ip node1) $(cluster_ip node2))" ||
    fail "recipes.py could not read $1"
  resolve "${names[@]}"
  for ((i = 0; i < pod_count; i++)); do
    local argv env node
    eval "argv=(\"\${pod_argv_$i[@]}\") env=(\"\${pod_env_$i[@]}\") node=\$pod_node_$i"
    cluster_run "node$node" "${container[@]}" "${env[@]}" timeout "$limit" "${in_dir[@]}" "$work/job" "${argv[@]}" \
      >"$work/pod$i.out" 2>"$work/pod$i.err" &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || { status=$?; echo "pod $i exited with $status"; }
  done
  ((status == 0)) || fail "a pod of $(basename "$1") failed"
}

case $case_name in
  slurm_dtrun)
    cluster_up 2
    sbatch_run "$recipes/slurm-dtrun.sbatch"
    expect_world 2 4 env
    ;;
  slurm_srun)
    cluster_up 2
    sbatch_run "$recipes/slurm-srun.sbatch"
    expect_world 2 4 slurm
    ;;
  openmpi_hostfile | openmpi_dtrun)
    cluster_up 2
    printf 'node1 slots=4\nnode2 slots=4\n' >"$work/job/hosts"
    script=$recipes/${case_name/_/-}.sh
    cluster_run node1 env "PATH=$path" $(mpi_settings) timeout "$limit" "${in_dir[@]}" "$work/job" bash "$script" hosts \
      >"$work/job.out" 2>"$work/job.err"
    status=$?
    ((status == 0)) || fail "$(basename "$script") hosts exited with $status"
    if [[ $case_name == openmpi_dtrun ]]; then expect_world 2 4 env; else expect_world 2 4 open_mpi; fi
    ;;
  pytorchjob | trainjob)
    cluster_up 2
    run_pods "$recipes/$case_name.yaml"
    expect_world 2 4 env
    ;;
  azureml_pytorch)
    cluster_up 2
    run_pods "$recipes/azureml-pytorch.yml"
    expect_world 2 4 env
    ;;
  mpijob)
    cluster_up 3  # node1, node2: the workers; node3: the launcher
    eval "$(python3 "$here/recipes.py" pods "$recipes/mpijob.yaml" "$work/hostfile")" ||
      fail "recipes.py could not read mpijob.yaml"
    printf '%s' "$hostfile" >"$work/hostfile"
    resolve "${names[@]}"
    # ssh to a worker's service name: the ssh stand-in to its node.
    {
      echo '#!/usr/bin/env bash'
      echo 'while [[ $1 == -* ]]; do [[ $1 == -o ]] && shift; shift; done'
      echo 'host=$1; shift; case $host in'
      for entry in "${names[@]}"; do echo "  ${entry%=*}) host=node${entry#*=} ;;"; done
      echo "esac; exec $(cluster_rsh) \"\$host\" \"\$@\""
    } >"$work/ssh"
    chmod +x "$work/ssh"
    cluster_run "node$pod_node_0" "${container[@]}" $(mpi_settings "$work/ssh") "${pod_env_0[@]}" \
      timeout "$limit" "${in_dir[@]}" "$work/job" "${pod_argv_0[@]}" >"$work/launcher.out" 2>"$work/launcher.err" ||
      fail "the launcher's mpirun exited with $?"
    expect_world 2 4 open_mpi
    ;;
  azureml_mpi)
    cluster_up 2
    eval "$(python3 "$here/recipes.py" pods "$recipes/azureml-mpi.yml" "$work/hostfile" \
      $(cluster_ip node1) $(cluster_ip node2))" || fail "recipes.py could not read azureml-mpi.yml"
    ((azure_mpi_nodes == 2)) || fail "azureml-mpi.yml asks for $azure_mpi_nodes nodes; the simulated cluster has 2"
    printf 'node1 slots=%s\nnode2 slots=%s\n' "$azure_mpi_per_node" "$azure_mpi_per_node" >"$work/hostfile"
    # Azure ML's own mpirun, which the job does not show: its processes on each node,
    # the job's variables and AZ_BATCH_MASTER_NODE exported.
    exports=()
    for entry in "${pod_env_0[@]}"; do exports+=(-x "${entry%%=*}"); done
    cluster_run node1 "${container[@]}" $(mpi_settings) "${pod_env_0[@]}" timeout "$limit" "${in_dir[@]}" "$work/job" \
      mpirun --hostfile "$work/hostfile" -np "$azure_mpi_np" --map-by "ppr:$azure_mpi_per_node:node" \
      --bind-to none -x PATH "${exports[@]}" "${pod_argv_0[@]}" >"$work/job.out" 2>"$work/job.err" ||
      fail "Azure ML's mpirun exited with $?"
    expect_world 2 4 env
    ;;
  *)
    echo "test_recipes.sh: unknown case '$case_name'" >&2
    exit 2
    ;;
esac
echo "cluster.recipe.$case_name: ok"
