# Includes point down (STYLE.md): every `#include <dtrain/...>` in a header
# under INCLUDE_DIR/dtrain names a header of the same layer or a lower one.
#
#   cmake -DINCLUDE_DIR=<dir with dtrain/> -P check_layers.cmake
#
# The layers, lowest first (a header may include its own layer and those before it):
#
#   0 base        config.hpp, error.hpp
#   1 detail      detail/        parsing, JSON, the wire format, sockets, system calls
#   2 env         env/           the environment snapshot and world discovery
#   3 rendezvous  rendezvous/    the store: concept, protocol, server, client
#   4 backend     backend/       the communicator concept, its work, memory spaces, types and
#                                watchdog; the engines over it in backend/nccl/, backend/gloo/,
#                                backend/mpi/; diagnostics/ (what every communicator records
#                                of its collectives, and the desync table made of it)
#   5 control     control/       the host control plane: metadata between ranks, verdicts
#   6 topology    topology/      flat and hierarchical collectives, the network
#   7 policy      policy.hpp     launch x backend x topology, and backend_traits
#   8 ddp         ddp/           DistributedDataParallel and its parts; checkpoint/ (saving
#                                and resuming one step's state: parameters, sampler, ...)
#   9 launch      launch/        the node agent, its protocol, the worker's end
#  10 runtime     runtime/       context, run and the compiled-mode entry; diagnostics.hpp
#                                (publishing and reading the rings at a stall); doctor/
#                                (dtrain_doctor's host inspection and checks)
#  11 all         dtrain.hpp     includes everything else; torch.hpp, torch/ (LibTorch, optional) build on it;
#                checkpoint.hpp (dtrain::checkpoint, which dtrain.hpp leaves out)
#
# A header's `-inl.hpp` (its non-template bodies, dtrain/config.hpp) is in its layer.
#
# A header that fits no layer fails the check too: place it here first.
#
# And what dtrain.hpp includes, directly or not, is what every user translation
# unit compiles: the headers matching `not_in_dtrain_hpp` (the doctor's host
# inspection, the LibTorch integration) must stay out of it.

cmake_minimum_required(VERSION 3.21)

if(NOT INCLUDE_DIR)
  message(FATAL_ERROR "check_layers.cmake: give -DINCLUDE_DIR=<directory that holds dtrain/>")
endif()
get_filename_component(INCLUDE_DIR "${INCLUDE_DIR}" ABSOLUTE)

set(layer_names base detail env rendezvous backend control topology policy ddp launch runtime all)
set(not_in_dtrain_hpp "^doctor/" "^torch(\\.hpp|/)" "^checkpoint(\\.hpp|/)")

# Edges that break the order today, each with why it is allowed. Drop one as
# soon as the change named next to it lands: the check then says it is unused.
set(allowed_exceptions)

# The layer index of header `path` (relative to dtrain/), in `out`.
function(layer_of path out)
  string(REGEX REPLACE "-inl\\.hpp$" ".hpp" path "${path}")  # a header's bodies: its layer
  if(path MATCHES "^(config|error)\\.hpp$")
    set(layer 0)
  elseif(path MATCHES "^detail/")
    set(layer 1)
  elseif(path MATCHES "^env/")
    set(layer 2)
  elseif(path MATCHES "^rendezvous/")
    set(layer 3)
  elseif(path MATCHES "^(backend|diagnostics)/")
    set(layer 4)
  elseif(path MATCHES "^control/")
    set(layer 5)
  elseif(path MATCHES "^topology/")
    set(layer 6)
  elseif(path STREQUAL "policy.hpp")
    set(layer 7)
  elseif(path MATCHES "^(ddp|checkpoint)/")
    set(layer 8)
  elseif(path MATCHES "^launch/")
    set(layer 9)
  elseif(path MATCHES "^runtime/" OR path STREQUAL "diagnostics.hpp" OR path MATCHES "^doctor/")
    set(layer 10)
  elseif(path MATCHES "^(dtrain|torch|checkpoint)\\.hpp$" OR path MATCHES "^torch/")
    set(layer 11)
  else()
    set(layer -1)
  endif()
  set(${out} ${layer} PARENT_SCOPE)
endfunction()

file(GLOB_RECURSE headers RELATIVE "${INCLUDE_DIR}/dtrain" "${INCLUDE_DIR}/dtrain/*.hpp")
list(SORT headers)
if(NOT headers)
  message(FATAL_ERROR "check_layers.cmake: no headers under ${INCLUDE_DIR}/dtrain")
endif()

set(violations "")
set(used_exceptions "")
set(edges 0)
set(includes_of_dtrain_hpp "")
foreach(header IN LISTS headers)
  layer_of("${header}" from)
  if(from EQUAL -1)
    string(APPEND violations "\n  ${header} belongs to no layer (add it to tests/scripts/check_layers.cmake)")
    continue()
  endif()
  file(STRINGS "${INCLUDE_DIR}/dtrain/${header}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*<dtrain/")
  foreach(line IN LISTS lines)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*<dtrain/([^>]+)>.*$" "\\1" target "${line}")
    math(EXPR edges "${edges} + 1")
    string(MAKE_C_IDENTIFIER "${header}" from_id)
    list(APPEND includes_${from_id} "${target}")
    layer_of("${target}" to)
    set(edge "${header} -> ${target}")
    if(to EQUAL -1)
      string(APPEND violations "\n  ${edge}: ${target} belongs to no layer")
    elseif(to GREATER from)
      if(edge IN_LIST allowed_exceptions)
        list(APPEND used_exceptions "${edge}")
      else()
        list(GET layer_names ${from} from_name)
        list(GET layer_names ${to} to_name)
        string(APPEND violations
               "\n  ${edge}: layer ${from} (${from_name}) includes layer ${to} (${to_name})")
      endif()
    endif()
  endforeach()
endforeach()

# The closure of dtrain.hpp, and what of it must not be there (with the path that brings it).
if(EXISTS "${INCLUDE_DIR}/dtrain/dtrain.hpp")
  set(reached dtrain.hpp)
  set(outside "")
  set(via_dtrain_hpp "dtrain.hpp")
  set(queue dtrain.hpp)
  while(queue)
    list(POP_FRONT queue current)
    string(MAKE_C_IDENTIFIER "${current}" current_id)
    foreach(next IN LISTS includes_${current_id})
      if(NOT next IN_LIST reached)
        list(APPEND reached "${next}")
        list(APPEND queue "${next}")
        string(MAKE_C_IDENTIFIER "${next}" next_id)
        set(via_${next_id} "${via_${current_id}} -> ${next}")
        foreach(pattern IN LISTS not_in_dtrain_hpp)
          if(next MATCHES "${pattern}")
            string(APPEND outside "\n  ${via_${next_id}}: ${next} must stay out of what dtrain.hpp "
                                  "includes (every user translation unit would compile it)")
          endif()
        endforeach()
      endif()
    endforeach()
  endwhile()
endif()

foreach(exception IN LISTS allowed_exceptions)
  if(NOT exception IN_LIST used_exceptions)
    message(WARNING "check_layers.cmake: the allowed exception \"${exception}\" is no longer "
                    "used: remove it from allowed_exceptions")
  endif()
endforeach()

list(LENGTH headers header_count)
if(violations)
  message(FATAL_ERROR "Includes must point down (tests/scripts/check_layers.cmake lists the "
                      "layers); these point up:${violations}")
endif()
if(outside)
  message(FATAL_ERROR "dtrain.hpp includes what only some programs need:${outside}")
endif()
list(LENGTH reached reached_count)
message(STATUS "layering: ${header_count} headers, ${edges} dtrain includes, all pointing down "
               "(allowed for now: ${used_exceptions}); dtrain.hpp reaches ${reached_count} of "
               "them, none of the doctor's or LibTorch's")
