// Must NOT compile: a per-node agent forks its workers, but MPI processes must
// be started by mpirun. The test compile.fail.per_node_mpi expects the message.
#include <dtrain/dtrain.hpp>

using job = dtrain::policy<dtrain::launch::per_node, dtrain::backend::mpi, dtrain::topology::flat>;
job::communicator_type* unused = nullptr;
