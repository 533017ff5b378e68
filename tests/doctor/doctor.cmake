# dtrain_doctor (issue 12) on a captured sysfs tree (tests/doctor/sysfs-ib: two
# InfiniBand HCAs, one active; four NVIDIA GPUs): what it prints, its traps and
# its exit status. A 127.0.1.1 host name on a real (simulated) node: tests/cluster.
#
# The doctor's own headers (dtrain/doctor/) are not in dtrain.hpp, so neither in
# the single header: their unit tests (unit.network:*, unit.doctor:*) are part of
# dtrain_unit only.
target_sources(dtrain_unit PRIVATE "${CMAKE_CURRENT_LIST_DIR}/test_doctor.cpp")

set(doctor_dir "${CMAKE_CURRENT_SOURCE_DIR}/doctor")
if(TARGET dtrain_doctor)
  # Node 0 of a 2-node torchrun job with 8 workers per node, and every trap set.
  set(doctor_command "$<TARGET_FILE:dtrain_doctor>|--sysfs|${doctor_dir}/sysfs-ib")
  dtrain_add_test(doctor.traps
    COMMAND "${CMAKE_COMMAND}" "-DCOMMAND=${doctor_command}" -DEXPECT_STATUS=1
            "-DEXPECT_1=mlx5_0 port 1: ACTIVE, LinkUp, 200 Gb/sec [(]4X HDR[)], InfiniBand"
            "-DEXPECT_2=mlx5_1 port 1: DOWN, Disabled"
            "-DEXPECT_3=GPUs: 4 NVIDIA on the PCI bus [(][^)]*[)], driver 580.159.04"
            "-DEXPECT_4=! NCCL_IB_DISABLE=1 while RDMA ports are active [(]mlx5_0:1 [(]InfiniBand, 200 Gb/sec [(]4X HDR[)][)][)]"
            "-DEXPECT_5=! NCCL_SOCKET_IFNAME=eth9 names eth9, which this host does not have [(]interfaces: eth0, ib0, lo[)]"
            "-DEXPECT_6=! 8 ranks on this node but [0-9]+ visible GPUs?: NCCL needs a GPU of its own"
            "-DEXPECT_7=! MASTER_ADDR=127.0.0.1 resolves to 127.0.0.1 [(]loopback[)] in a job of several nodes"
            "-DEXPECT_8=nccl none: NCCL_SOCKET_IFNAME=eth9; data over TCP sockets [(]NCCL_IB_DISABLE=1[)]"
            "-DEXPECT_9=world: dtrain world from env: [^\n]*16"
            -P "${scripts}/check_job.cmake"
    ENVIRONMENT RANK=0 WORLD_SIZE=16 LOCAL_RANK=0 LOCAL_WORLD_SIZE=8 GROUP_RANK=0 GROUP_WORLD_SIZE=2
                MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=eth9
    TIMEOUT 60)
  # A single-node job on the same node, nothing set: no trap, exit 0, and NCCL
  # would take ib0 and the active HCA.
  dtrain_add_test(doctor.healthy
    COMMAND "${CMAKE_COMMAND}" "-DCOMMAND=${doctor_command}" -DEXPECT_STATUS=0
            "-DEXPECT_1=no known trap found"
            "-DEXPECT_2=nccl ib0: NCCL's default [^\n]*; data over RDMA [(]NET/IB[)] on mlx5_0:1"
            "-DEXPECT_3=mpi +eth0, ib0: Open MPI's default"
            -P "${scripts}/check_job.cmake"
    ENVIRONMENT RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2
    TIMEOUT 60)
else()
  foreach(case IN ITEMS traps healthy)
    dtrain_add_skipped_test(doctor.${case} "dtrain_doctor is not built (DTRAIN_BUILD_EXAMPLES=OFF)")
  endforeach()
endif()
