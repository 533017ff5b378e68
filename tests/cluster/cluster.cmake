# cluster.*: multi-node tests on a simulated cluster (tests/cluster/cluster.sh):
# each node a network namespace with its own host name and address, 1 Gbit/s
# links. They need root (network and UTS namespaces) and skip without it.
# RUN_SERIAL: each starts 4+ processes that move real data over the links.
set(cluster_dir "${CMAKE_CURRENT_LIST_DIR}")
set(cluster_cases dtrun_2x2 mpirun_by_node mpirun_by_slot demo_2x2 loopback_hostname killed_worker
                  hierarchical_gloo hierarchical_mpi doctor elastic_1_2 elastic_1_2_zero1 replace_node
                  replace_node0 replace_node0_elastic
                  freeze_node freeze_node0 power_off_node0 metrics_endpoint)
if(TARGET dtrun AND TARGET dtrain_whoami)
  set(peer_dir "")
  if(TARGET dtrain_ddp_peer)
    set(peer_dir "$<TARGET_FILE_DIR:dtrain_ddp_peer>")
  endif()
  foreach(case IN LISTS cluster_cases)
    dtrain_add_test(cluster.${case}
      COMMAND bash "${cluster_dir}/test_cluster.sh" ${case} "$<TARGET_FILE_DIR:dtrun>" "${peer_dir}"
      TIMEOUT 150
      PROPERTIES RUN_SERIAL TRUE)
  endforeach()
else()
  foreach(case IN LISTS cluster_cases)
    dtrain_add_skipped_test(cluster.${case} "dtrun and dtrain_whoami are not built (DTRAIN_BUILD_EXAMPLES=OFF)")
  endforeach()
endif()

# cluster.recipe.*: each recipe of examples/clusters/ (docs/clusters.md), the file itself,
# run on the simulated cluster with the environment its launcher or operator sets
# (tests/cluster/test_recipes.sh; recipes.py models the operators); a few seconds each.
set(recipe_cases slurm_dtrun slurm_srun openmpi_hostfile openmpi_dtrun pytorchjob trainjob mpijob
                 azureml_pytorch azureml_mpi)
foreach(case IN LISTS recipe_cases)
  if(TARGET dtrun AND TARGET dtrain_whoami)
    dtrain_add_test(cluster.recipe.${case}
      COMMAND bash "${cluster_dir}/test_recipes.sh" ${case} "$<TARGET_FILE_DIR:dtrun>"
      TIMEOUT 120
      PROPERTIES RUN_SERIAL TRUE)
  else()
    dtrain_add_skipped_test(cluster.recipe.${case} "dtrun and dtrain_whoami are not built (DTRAIN_BUILD_EXAMPLES=OFF)")
  endif()
endforeach()
