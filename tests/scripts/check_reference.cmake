# docs.reference: docs/reference.md lists every field of every options struct
# and every dtrun flag, and nothing that no longer exists (issue 32). The
# environment variables are docs.environment_reference's (check_env_names.cmake).
#
#   cmake -DROOT=<source dir> [-DDOCS=<reference.md>] [-DDTRUN=<dtrun>] -P check_reference.cmake
#
# Options: a struct at namespace level named *_options or *_limits under
# ROOT/include; its fields are the lines at two spaces of indentation that
# declare one name (`type name;`, `type name = ...;`, `type name{...};`), not
# static, using or functions. Each must have a row "| `struct::field` |", and
# every such row must name one. Flags: the lines "  --flag" of `DTRUN --help`
# against the rows "| `--flag` |" (skipped, saying so, without DTRUN).
cmake_minimum_required(VERSION 3.21)
if(NOT ROOT)
  message(FATAL_ERROR "check_reference.cmake: give -DROOT=<dtrain's source directory>")
endif()
if(NOT DOCS)
  set(DOCS "${ROOT}/docs/reference.md")
endif()
file(READ "${DOCS}" docs)
set(failures "")

# --- the fields of the options structs
file(GLOB_RECURSE headers "${ROOT}/include/*.hpp")
set(fields "")
foreach(header IN LISTS headers)
  file(STRINGS "${header}" lines)
  set(in "")
  foreach(line IN LISTS lines)
    if(in STREQUAL "")
      if(line MATCHES "^struct ([a-z_]*_(options|limits)) {")
        set(in "${CMAKE_MATCH_1}")
      endif()
      continue()
    endif()
    if(line MATCHES "^};")
      set(in "")
      continue()
    endif()
    string(REGEX REPLACE " *//.*$" "" code "${line}")
    if(NOT code MATCHES "^  [^ /]" OR code MATCHES "^  (static|using|friend|template|public|private|enum|struct|class|return|if|for)[ :(]"
       OR code MATCHES "^  \\[\\[")
      continue()
    endif()
    # A function: `...) const;` with no default value or braces.
    if(code MATCHES "\\)[a-z ]*;$" AND NOT code MATCHES " = |{")
      continue()
    endif()
    if(code MATCHES "([a-z_][a-z0-9_]*)( = [^;]*| ?{[^;]*})?;$")
      list(APPEND fields "${in}::${CMAKE_MATCH_1}")
    endif()
  endforeach()
endforeach()
list(LENGTH fields count)
if(count LESS 20)
  string(APPEND failures "\n  found only ${count} option fields under ${ROOT}/include: the parser is broken")
endif()
# rows_named(<regex of the name> <out>): the names of the reference's table
# rows "| `<name>` |".
function(rows_named name_regex out)
  string(REGEX MATCHALL "\n\\| `${name_regex}` \\|" rows "${docs}")
  list(TRANSFORM rows REPLACE "^\n\\| `(${name_regex})` \\|$" "\\1")
  set(${out} "${rows}" PARENT_SCOPE)
endfunction()
# compare(<what the code has> <what the rows name> <whose> <stale>): a failure
# for each name without a row ("no row for <whose><name>") and each row that
# names nothing ("a row for <name>, which <stale>").
macro(compare code_names row_names whose stale)
  foreach(name IN LISTS ${code_names})
    if(NOT name IN_LIST ${row_names})
      string(APPEND failures "\n  ${DOCS} has no row for ${whose}${name}")
    endif()
  endforeach()
  foreach(name IN LISTS ${row_names})
    if(NOT name IN_LIST ${code_names})
      string(APPEND failures "\n  ${DOCS} has a row for ${name}, which ${stale}")
    endif()
  endforeach()
endmacro()

rows_named("[a-z_]+::[a-z_0-9]+" documented)
compare(fields documented "" "no options struct has")

# --- dtrun's flags
set(flag_note "")
if(DTRUN)
  execute_process(COMMAND "${DTRUN}" --help OUTPUT_VARIABLE help ERROR_VARIABLE help RESULT_VARIABLE rc)
  string(REGEX MATCHALL "\n  --[a-z][a-z-]*" flags "${help}")
  list(TRANSFORM flags REPLACE "^\n  " "")
  list(APPEND flags --help)
  rows_named("--[a-z][a-z-]*" flag_rows)
  list(LENGTH flags flag_count)
  if(flag_count LESS 5)
    string(APPEND failures "\n  `${DTRUN} --help` lists only ${flag_count} flags (exit ${rc}): the parser is broken")
  endif()
  compare(flags flag_rows "dtrun's " "dtrun --help does not list")
  set(flag_note ", ${flag_count} dtrun flags")
else()
  set(flag_note " (dtrun's flags not checked: no DTRUN given)")
endif()

if(failures)
  message(FATAL_ERROR "docs/reference.md and the code disagree:${failures}")
endif()
message("docs.reference: ${count} option fields${flag_note}, all in ${DOCS} and nothing more")
