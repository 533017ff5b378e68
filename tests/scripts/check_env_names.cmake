# Every DTRAIN_* environment variable is a constant in one header, and the
# reference's table is that list (issue 30):
#
#   cmake -DROOT=<source dir> [-DDOCS=<reference.md>] [-DHEADER=<names.hpp>] -P check_env_names.cmake
#
#   1. HEADER (include/dtrain/env/names.hpp) defines `<name>_variable =
#      "DTRAIN_..."` constants, and its detail::dtrain_variables lists each once;
#   2. DOCS (docs/reference.md) has one table row "| `DTRAIN_...` |" per constant,
#      and no other;
#   3. no source under ROOT/include, ROOT/src, ROOT/examples spells a variable
#      as a string literal of its own ("DTRAIN_X" or "DTRAIN_X="): it reads and
#      names it through the constant;
#   4. every DTRAIN_* word in those sources (prose in messages and comments
#      included) is a variable of HEADER or a macro (a #define of dtrain's, or a
#      compile definition or option of its CMake files): a renamed or removed
#      variable leaves no stale name behind.

cmake_minimum_required(VERSION 3.21)

if(NOT ROOT)
  message(FATAL_ERROR "check_env_names.cmake: give -DROOT=<dtrain's source directory>")
endif()
if(NOT DOCS)
  set(DOCS "${ROOT}/docs/reference.md")
endif()
if(NOT HEADER)
  set(HEADER "${ROOT}/include/dtrain/env/names.hpp")
endif()

set(failures "")

# 1. The header's constants and its list.
file(READ "${HEADER}" header)
string(REGEX MATCHALL "string_view [a-z0-9_]+_variable = \"DTRAIN_[A-Z0-9_]+\"" defs "${header}")
set(names "")
set(constants "")
foreach(def IN LISTS defs)
  string(REGEX REPLACE "string_view ([a-z0-9_]+_variable) = \"(DTRAIN_[A-Z0-9_]+)\"" "\\1;\\2" pair "${def}")
  list(GET pair 0 constant)
  list(GET pair 1 name)
  if(name IN_LIST names)
    string(APPEND failures "\n  ${HEADER}: ${name} is defined twice")
  endif()
  list(APPEND names "${name}")
  list(APPEND constants "${constant}")
endforeach()
list(LENGTH names count)
if(count EQUAL 0)
  message(FATAL_ERROR "no `<name>_variable = \"DTRAIN_...\"` constant found in ${HEADER}")
endif()
string(FIND "${header}" "dtrain_variables{" at)
if(at LESS 0)
  string(APPEND failures "\n  ${HEADER}: no detail::dtrain_variables list")
else()
  math(EXPR at "${at} + 17")  # past "dtrain_variables{"
  string(SUBSTRING "${header}" ${at} -1 list_text)
  string(FIND "${list_text}" "};" end)
  string(SUBSTRING "${list_text}" 0 ${end} list_text)
  string(REGEX MATCHALL "[a-z0-9_]+_variable" listed "${list_text}")
  foreach(constant IN LISTS constants)
    list(FIND listed "${constant}" found)
    if(found LESS 0)
      string(APPEND failures "\n  ${HEADER}: ${constant} is missing from detail::dtrain_variables")
    endif()
  endforeach()
  list(LENGTH listed listed_count)
  if(NOT listed_count EQUAL count)
    string(APPEND failures
           "\n  ${HEADER}: detail::dtrain_variables has ${listed_count} entries for ${count} constants")
  endif()
endif()

# 2. The reference's table.
file(READ "${DOCS}" docs)
string(REGEX MATCHALL "\n\\| `DTRAIN_[A-Z0-9_]+` \\|" rows "${docs}")
set(documented "")
foreach(row IN LISTS rows)
  string(REGEX REPLACE "\n\\| `(DTRAIN_[A-Z0-9_]+)` \\|" "\\1" name "${row}")
  if(name IN_LIST documented)
    string(APPEND failures "\n  ${DOCS}: ${name} has two rows")
  endif()
  list(APPEND documented "${name}")
endforeach()
foreach(name IN LISTS names)
  if(NOT name IN_LIST documented)
    string(APPEND failures "\n  ${DOCS}: no row for ${name} (a constant in ${HEADER})")
  endif()
endforeach()
foreach(name IN LISTS documented)
  if(NOT name IN_LIST names)
    string(APPEND failures "\n  ${DOCS}: a row for ${name}, which ${HEADER} does not define")
  endif()
endforeach()

# 3 and 4. The sources.
file(GLOB_RECURSE sources LIST_DIRECTORIES false
     "${ROOT}/include/*.hpp" "${ROOT}/include/*.h" "${ROOT}/src/*.cpp" "${ROOT}/src/*.cu"
     "${ROOT}/examples/*.cpp" "${ROOT}/examples/*.hpp" "${ROOT}/examples/*.cu")
set(macros "")
foreach(file IN LISTS sources)
  # Every DTRAIN_* word on a preprocessor line is a macro (defined, tested or
  # expected from the build: DTRAIN_WITH_CUDA, DTRAIN_SEPARATE_COMPILATION).
  file(READ "${file}" text)
  string(REGEX MATCHALL "\n[ \t]*#[^\n]*" directives "\n${text}")
  foreach(directive IN LISTS directives)
    string(REGEX MATCHALL "DTRAIN_[A-Z0-9_]+" words "${directive}")
    list(APPEND macros ${words})
  endforeach()
endforeach()
file(GLOB_RECURSE cmake_files LIST_DIRECTORIES false "${ROOT}/cmake/*" "${ROOT}/examples/CMakeLists.txt"
     "${ROOT}/src/CMakeLists.txt")
if(EXISTS "${ROOT}/CMakeLists.txt")
  list(APPEND cmake_files "${ROOT}/CMakeLists.txt")
endif()
foreach(file IN LISTS cmake_files)
  file(READ "${file}" text)
  string(REGEX MATCHALL "DTRAIN_[A-Z0-9_]+" words "${text}")
  list(APPEND macros ${words})
endforeach()
list(REMOVE_DUPLICATES macros)

foreach(file IN LISTS sources)
  if(file STREQUAL HEADER)
    continue()
  endif()
  file(READ "${file}" text)
  file(RELATIVE_PATH shown "${ROOT}" "${file}")
  string(REGEX MATCHALL "\"DTRAIN_[A-Z0-9_]+=?\"" literals "${text}")
  foreach(literal IN LISTS literals)
    string(APPEND failures
           "\n  ${shown}: the literal ${literal}: read and name the variable through its constant in env/names.hpp")
  endforeach()
  # A word ending in `_` is a family in prose (DTRAIN_WITH_<X>, DTRAIN_HAS_...).
  string(REGEX MATCHALL "DTRAIN_[A-Z0-9_]*[A-Z0-9]" words "${text}")
  list(REMOVE_DUPLICATES words)
  foreach(word IN LISTS words)
    if(NOT word IN_LIST names AND NOT word IN_LIST macros)
      string(APPEND failures
             "\n  ${shown}: ${word} is neither a variable of env/names.hpp nor a macro of dtrain's")
    endif()
  endforeach()
endforeach()

if(failures)
  message(FATAL_ERROR "environment variable names:${failures}")
endif()
message(STATUS "${count} DTRAIN_* variables: one constant each in ${HEADER}, one row each in ${DOCS}; "
               "no other spelling in include/, src/ or examples/")
