#!/usr/bin/env bash
# dtrain across nodes with Open MPI starting one dtrun per node from a hostfile
# (docs/clusters.md). Run it on the first node of the hostfile:
#   ./openmpi-dtrun.sh hosts           # hosts: one line per node, "gpu-node-1 slots=4"
# Each dtrun starts one worker per GPU; the program uses launch::per_process with
# backend::nccl (or gloo). Edit gpus_per_node and the program line; dtrun must be
# on every node's PATH and ./train on a shared file system.
set -euo pipefail
hostfile=${1:?usage: openmpi-dtrun.sh HOSTFILE}
gpus_per_node=4

nodes=$(grep -c '^[^#[:space:]]' "$hostfile")
master=$(awk '/^[^#[:space:]]/ { print $1; exit }' "$hostfile")
DTRAIN_STORE_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
export DTRAIN_STORE_TOKEN

# One process per node, each a dtrun: its node rank is OMPI_COMM_WORLD_RANK, the node
# count OMPI_COMM_WORLD_SIZE; node 0's agent serves the store at MASTER_ADDR:MASTER_PORT.
mpirun --hostfile "$hostfile" -np "$nodes" --map-by ppr:1:node --bind-to none \
  -x PATH -x DTRAIN_STORE_TOKEN -x MASTER_ADDR="$master" -x MASTER_PORT=29500 \
  dtrun --nproc-per-node "$gpus_per_node" -- ./train --epochs 10
