#!/usr/bin/env bash
# dtrain across nodes with Open MPI: one process per GPU, started by mpirun from a
# hostfile (docs/clusters.md). Run it on the first node of the hostfile:
#   ./openmpi-hostfile.sh hosts        # hosts: one line per node, "gpu-node-1 slots=4"
# The program uses launch::per_process with backend::mpi (or nccl, gloo). Edit
# gpus_per_node and the program line; ./train must be on a shared file system.
set -euo pipefail
hostfile=${1:?usage: openmpi-hostfile.sh HOSTFILE}
gpus_per_node=4

nodes=$(grep -c '^[^#[:space:]]' "$hostfile")
master=$(awk '/^[^#[:space:]]/ { print $1; exit }' "$hostfile")
# backend::mpi needs neither of these (rank 0 sends the store's address and its
# secret over MPI); nccl and gloo need both.
DTRAIN_STORE_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
export DTRAIN_STORE_TOKEN

# ppr:4:node: 4 processes on each node, ranks 0-3 on the first one.
mpirun --hostfile "$hostfile" -np $((nodes * gpus_per_node)) --map-by "ppr:$gpus_per_node:node" \
  --bind-to none -x DTRAIN_STORE_TOKEN -x MASTER_ADDR="$master" -x MASTER_PORT=29500 \
  ./train --epochs 10
