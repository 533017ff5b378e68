# Writes the single-header distribution of dtrain.
#
#   cmake -P tools/amalgamate.cmake                 -> single_include/dtrain/dtrain.hpp
#   cmake -DOUT=some/file.hpp -P tools/amalgamate.cmake
#
# Starting at include/dtrain/dtrain.hpp, every #include <dtrain/...> is replaced
# by that header's text, each header once (the first inclusion wins; later ones
# are dropped), `#pragma once` goes, and one guard wraps the whole. System
# includes stay as they are. The output depends only on the headers, so CI can
# regenerate it and compare byte for byte.
cmake_minimum_required(VERSION 3.21)

get_filename_component(root "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
if(NOT DEFINED OUT)
  set(OUT "${root}/single_include/dtrain/dtrain.hpp")
endif()

# CMake lists split on ';' and pair up '[' ']', so C++ text is walked line by
# line with those three characters hidden behind placeholders.
macro(hide var)
  string(REPLACE ";" "<dtrain:semicolon>" ${var} "${${var}}")
  string(REPLACE "[" "<dtrain:open>" ${var} "${${var}}")
  string(REPLACE "]" "<dtrain:close>" ${var} "${${var}}")
endmacro()
macro(unhide var)
  string(REPLACE "<dtrain:semicolon>" ";" ${var} "${${var}}")
  string(REPLACE "<dtrain:open>" "[" ${var} "${${var}}")
  string(REPLACE "<dtrain:close>" "]" ${var} "${${var}}")
endmacro()

# inline_header(<dtrain/x.hpp> <from> <out_var>): the header's text, with its
# dtrain includes inlined; empty when the header was inlined already.
function(inline_header name from out_var)
  get_property(done GLOBAL PROPERTY inlined_headers)
  if(name IN_LIST done)
    set(${out_var} "" PARENT_SCOPE)
    return()
  endif()
  set_property(GLOBAL APPEND PROPERTY inlined_headers "${name}")
  if(NOT EXISTS "${root}/include/${name}")
    message(FATAL_ERROR "${from} includes <${name}>, which is not in include/")
  endif()
  file(READ "${root}/include/${name}" text)
  hide(text)
  string(REGEX MATCHALL "[^\n]*\n|[^\n]+$" lines "${text}")

  set(result "// ---- begin ${name} ----\n")
  foreach(line IN LISTS lines)
    if(line MATCHES "^[ \t]*#[ \t]*include[ \t]*[<\"](dtrain/[^>\"]+)[>\"]")
      inline_header("${CMAKE_MATCH_1}" "${name}" inner)
      string(APPEND result "${inner}")
    elseif(NOT line MATCHES "^[ \t]*#[ \t]*pragma[ \t]+once")
      string(APPEND result "${line}")
    endif()
  endforeach()
  string(APPEND result "// ---- end ${name} ----\n")
  set(${out_var} "${result}" PARENT_SCOPE)
endfunction()

inline_header("dtrain/dtrain.hpp" "tools/amalgamate.cmake" body)
# dtrain/checkpoint.hpp, which dtrain.hpp leaves out (compile time), is part of the single header.
inline_header("dtrain/checkpoint.hpp" "tools/amalgamate.cmake" checkpoint_body)
string(APPEND body "${checkpoint_body}")
unhide(body)

set(banner [=[
// dtrain: header-only C++20 data-parallel distributed training.
// Single-header distribution, generated from include/dtrain/ by
// tools/amalgamate.cmake. Do not edit; run `cmake -P tools/amalgamate.cmake`.
// SPDX-License-Identifier: MIT
]=])
set(content "${banner}
#ifndef DTRAIN_SINGLE_INCLUDE_DTRAIN_HPP
#define DTRAIN_SINGLE_INCLUDE_DTRAIN_HPP

${body}
#endif  // DTRAIN_SINGLE_INCLUDE_DTRAIN_HPP
")

# Leave an unchanged file alone, so that builds using it are not redone.
set(old "")
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
endif()
if(content STREQUAL old)
  message(STATUS "dtrain: ${OUT} is up to date")
else()
  file(WRITE "${OUT}" "${content}")
  message(STATUS "dtrain: wrote ${OUT}")
endif()
