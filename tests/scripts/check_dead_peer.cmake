# mpi.dead_peer: under mpirun, rank 1 exits before an allreduce. The job must
# end with a failure status within the time limit (Open MPI tears the others
# down), never hang and never report success.
execute_process(COMMAND "${MPIEXEC}" -n 2 ${FLAGS} "${PROGRAM}" --die
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 60)
if(rc MATCHES "timeout")
  message(FATAL_ERROR "the job hung after rank 1 died\n${out}\n${err}")
endif()
if(rc EQUAL 0)
  message(FATAL_ERROR "the job reported success although rank 1 died\n${out}\n${err}")
endif()
string(FIND "${err}" "rank 1 exiting on purpose" said)
if(said EQUAL -1)
  message(FATAL_ERROR "rank 1 did not reach the point where it dies\n${out}\n${err}")
endif()
string(FIND "${err}${out}" "finished without rank 1" wrong)
if(NOT wrong EQUAL -1)
  message(FATAL_ERROR "an allreduce completed without rank 1\n${out}\n${err}")
endif()
message(STATUS "the job ended with status ${rc} after rank 1 died")
