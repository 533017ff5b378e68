# Checks that an object compiled in separate mode (linked to dtrain::dtrain)
# defines none of what dtrain's library holds: what a TU compiles is what it costs.
#
#   cmake -DOBJECTS=<object files, ;-separated> -DNM=<nm> [-DMORE=<pattern>]
#         -P check_thin_tu.cmake
#
# MORE: one more pattern, for symbols that another compiled part holds
# (dtrain::torch's, for a LibTorch user's TU).
cmake_minimum_required(VERSION 3.21)

# Symbols (as nm -C prints them) that only the library may define.
set(library_only
  "dtrain::context<[^\n]*>::context\\("
  "dtrain::context<[^\n]*>::~context\\("
  "dtrain::detail::run_process<"
  "dtrain::store_server::"
  "dtrain::node_agent::"
  "dtrain::gloo_communicator::"
  "dtrain::basic_ddp<"
  "dtrain::store_client::"
  "dtrain::store_channel<")
if(MORE)
  list(APPEND library_only "${MORE}")
endif()

foreach(object IN LISTS OBJECTS)
  execute_process(COMMAND "${NM}" -C --defined-only "${object}"
                  OUTPUT_VARIABLE symbols RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${NM} failed on ${object}")
  endif()
  if(NOT symbols MATCHES " T main\n")
    message(FATAL_ERROR "no main in ${object}: not the object of a program's TU?\n${symbols}")
  endif()
  foreach(pattern IN LISTS library_only)
    if(symbols MATCHES "[^\n]*${pattern}[^\n]*")
      message(FATAL_ERROR "${object} defines ${CMAKE_MATCH_0}: code that dtrain's library should "
                          "hold is compiled in the user's TU (a heavy member defined in the class, "
                          "or a policy missing from DTRAIN_FOR_EACH_COMPILED_POLICY?)")
    endif()
  endforeach()
  string(REGEX MATCHALL "\n[0-9a-f]+ [TW] " defined "\n${symbols}")
  list(LENGTH defined count)
  message("${object}: ${count} functions defined, none of them the library's")
endforeach()
