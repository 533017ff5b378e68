#pragma once
/// @file
/// The one header users include. It only includes; it has no code of its own.

#include <dtrain/config.hpp>
#include <dtrain/env/discover.hpp>
#include <dtrain/env/environment.hpp>
#include <dtrain/env/placement.hpp>
#include <dtrain/env/world.hpp>
#include <dtrain/error.hpp>
#include <dtrain/rendezvous/options.hpp>
#include <dtrain/rendezvous/server.hpp>
#include <dtrain/rendezvous/client.hpp>
#include <dtrain/rendezvous/store.hpp>
#include <dtrain/backend/types.hpp>
#include <dtrain/backend/work.hpp>
#include <dtrain/backend/communicator.hpp>
#include <dtrain/backend/mpi.hpp>
#include <dtrain/backend/gloo.hpp>
#include <dtrain/backend/cuda.hpp>
#include <dtrain/backend/nccl.hpp>
#include <dtrain/topology/flat.hpp>
#include <dtrain/policy.hpp>
#include <dtrain/launch/options.hpp>
#include <dtrain/launch/process.hpp>
#include <dtrain/launch/agent.hpp>
#include <dtrain/context.hpp>
#include <dtrain/run.hpp>
