# dtrain_clean_launcher_env(): removes every launcher variable from this
# process's environment (and so from its children's). A test then sees only
# what its own case sets, not the shell that started CTest: a developer inside
# `salloc`, a torchrun job or an Azure ML node would otherwise change results.
function(dtrain_clean_launcher_env)
  set(launcher_vars
    "RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|NODE_RANK|GROUP_RANK|GROUP_WORLD_SIZE"
    "ROLE_RANK|ROLE_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|TF_CONFIG|AZ_BATCH_MASTER_NODE"
    "OMPI_COMM_WORLD_.*|OMPI_UNIVERSE_SIZE|PMI_.*|PMIX_RANK|MPI_LOCALRANKID|MPI_LOCALNRANKS"
    "MV2_COMM_WORLD_.*|SLURM_.*|HOROVOD_.*|TORCHELASTIC_.*")
  list(JOIN launcher_vars "|" launcher_vars)
  execute_process(COMMAND "${CMAKE_COMMAND}" -E environment OUTPUT_VARIABLE env)
  string(REGEX MATCHALL "(^|\n)[A-Za-z_][A-Za-z0-9_]*=" assignments "${env}")
  foreach(assignment IN LISTS assignments)
    string(REGEX REPLACE "^\n?(.*)=$" "\\1" var "${assignment}")
    if(var MATCHES "^(${launcher_vars})$")
      unset(ENV{${var}})
    endif()
  endforeach()
endfunction()
