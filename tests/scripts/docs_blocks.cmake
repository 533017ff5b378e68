# docs.blocks: every C++ block of README.md and docs/*.md is compiled, or tied
# to a file, or says why it is neither. What the line just before a ```cpp
# (or ```c++) fence says decides:
#   <!-- file: <path> -->        the block is that file (docs.code_blocks checks it)
#   (nothing)                    whole declarations, at namespace scope
#   <!-- compile: statements --> statements, in a function that has the names of
#                                tests/docs/reader.hpp's host_scope (ctx, model, ddp, ...)
#   <!-- compile: torch -->      declarations that need LibTorch (dtrain/torch.hpp)
#   <!-- compile: torch statements --> statements, with torch_scope's names
#   <!-- not compiled: <why> --> neither (pseudocode); the reason is required
# Each compiled block goes into one generated translation unit (one for the
# host, one for LibTorch) in a namespace of its own, behind `#line <n> "<page>"`,
# so a compiler error names the page and line. Its #include lines are hoisted
# to the top of the unit. The names a page leaves to the reader (Model,
# forward(), n_samples, ...) are tests/docs/reader*.hpp's.
#   cmake -DROOT=<repo> [-DOUT=<dir> -DUNIT=docs_blocks|docs_blocks_torch] -P docs_blocks.cmake
# With OUT, writes <OUT>/<UNIT>.cpp, the host's blocks or LibTorch's (only when
# its text changes); without, only checks the markers and reports.
cmake_minimum_required(VERSION 3.21)
if(NOT ROOT)
  message(FATAL_ERROR "docs_blocks.cmake: -DROOT=<repo> is required")
endif()
set(contexts "declarations" "statements" "torch" "torch statements")
# CMake lists split on ';' and do not split inside [ ]: stand-ins while in a list.
set(semi "@dtrain_semi@")
set(open "@dtrain_open@")
set(close "@dtrain_close@")
set(backslash "@dtrain_backslash@")
macro(unescape var)
  string(REPLACE "${semi}" ";" ${var} "${${var}}")
  string(REPLACE "${open}" "[" ${var} "${${var}}")
  string(REPLACE "${close}" "]" ${var} "${${var}}")
  string(REPLACE "${backslash}" "\\" ${var} "${${var}}")
endmacro()

set(failed "")
set(units_host "")
set(units_torch "")
set(includes_host "")
set(includes_torch "")
set(count_compiled 0)
set(count_torch 0)
set(count_tied 0)
set(not_compiled "")
set(block_number 0)

file(GLOB pages "${ROOT}/README.md" "${ROOT}/docs/*.md")
foreach(page IN LISTS pages)
  file(RELATIVE_PATH name "${ROOT}" "${page}")
  file(READ "${page}" text)
  string(REPLACE "\\" "${backslash}" text "${text}")
  string(REPLACE ";" "${semi}" text "${text}")
  string(REPLACE "[" "${open}" text "${text}")
  string(REPLACE "]" "${close}" text "${text}")
  string(REPLACE "\n" ";" lines "${text}")
  set(number 0)
  set(previous "")
  set(in_block OFF)    # inside a C++ block
  set(in_other OFF)    # inside another fenced block (```sh, ```cmake, ```)
  foreach(line IN LISTS lines)
    math(EXPR number "${number} + 1")
    if(in_other)
      if(line MATCHES "^ *```")
        set(in_other OFF)
      endif()
    elseif(in_block)
      if(line MATCHES "^ *```")
        set(in_block OFF)
        if(NOT context STREQUAL "skip")
          unescape(body)
          math(EXPR block_number "${block_number} + 1")
          set(unit "\n// ${name}:${start} (${context})\nnamespace dtrain_docs_block_${block_number} {\n"
                   "using namespace dtrain_docs;\n")
          if(context MATCHES "statements$")
            if(context MATCHES "^torch")
              set(scope torch_scope)
            else()
              set(scope host_scope)
            endif()
            string(APPEND unit "struct block : dtrain_docs::${scope} {\n  void statements() {\n"
                               "#line ${start} \"${name}\"\n${body}  }\n};\n")
          else()
            string(APPEND unit "#line ${start} \"${name}\"\n${body}")
          endif()
          string(APPEND unit "}  // namespace dtrain_docs_block_${block_number}\n")
          if(context MATCHES "^torch")
            string(APPEND units_torch "${unit}")
            list(APPEND includes_torch ${block_includes})
            math(EXPR count_torch "${count_torch} + 1")
          else()
            string(APPEND units_host "${unit}")
            list(APPEND includes_host ${block_includes})
            math(EXPR count_compiled "${count_compiled} + 1")
          endif()
        endif()
      else()
        set(code "${line}")
        if(indent)  # a block in a list item: its lines as the compiler would see them
          string(REGEX REPLACE "^${indent}" "" code "${code}")
        endif()
        if(code MATCHES "^#include ")  # hoisted: a blank line keeps the numbering
          unescape(code)
          list(APPEND block_includes "${code}")
          set(code "")
        endif()
        string(APPEND body "${code}\n")
      endif()
    elseif(line MATCHES "^( *)```(cpp|c\\+\\+) *$")
      set(indent "${CMAKE_MATCH_1}")
      set(in_block ON)
      set(body "")
      set(block_includes "")
      math(EXPR start "${number} + 1")  # the block's first line
      string(STRIP "${previous}" marker)
      set(context "declarations")
      if(marker MATCHES "^<!-- file: ")
        set(context "skip")
        math(EXPR count_tied "${count_tied} + 1")
      elseif(marker MATCHES "^<!-- compile: (.*) -->$")
        set(context "${CMAKE_MATCH_1}")
        if(NOT context IN_LIST contexts)
          string(APPEND failed "${name}:${number}: `<!-- compile: ${context} -->`: not a context "
                               "(declarations, statements, torch, torch statements)\n")
          set(context "skip")
        endif()
      elseif(marker MATCHES "^<!-- not compiled: (.+) -->$")
        set(context "skip")
        list(APPEND not_compiled "${name}:${number} (${CMAKE_MATCH_1})")
      elseif(marker MATCHES "^<!--")
        string(APPEND failed "${name}:${number}: `${marker}` before a C++ block is not a marker "
                             "(file:, compile:, not compiled:)\n")
        set(context "skip")
      endif()
    elseif(line MATCHES "^ *```")
      set(in_other ON)
    endif()
    set(previous "${line}")
  endforeach()
  if(in_block OR in_other)
    string(APPEND failed "${name}: a fenced block is never closed\n")
  endif()
endforeach()

unescape(failed)
if(failed)
  message("${failed}")  # unwrapped, one problem a line
  message(FATAL_ERROR "docs.blocks: the markers above are wrong")
endif()

# write_unit(<file> <reader header> <includes> <blocks>): one translation unit,
# written only when its text changes (no rebuild otherwise).
function(write_unit path reader includes blocks)
  list(REMOVE_DUPLICATES includes)
  string(REPLACE ";" "\n" includes "${includes}")
  string(CONCAT text "// Generated by tests/scripts/docs_blocks.cmake from README.md and docs/*.md.\n"
                "#include \"${reader}\"\n${includes}\n"
                "// A page's main() is compiled in a namespace, where it is not main: it\n"
                "// needs a return statement there, as a function.\n"
                "#pragma GCC diagnostic ignored \"-Wreturn-type\"\n${blocks}")
  set(old "")
  if(EXISTS "${path}")
    file(READ "${path}" old)
  endif()
  if(NOT old STREQUAL text)
    file(WRITE "${path}" "${text}")
  endif()
endfunction()
if(OUT AND UNIT STREQUAL "docs_blocks")
  write_unit("${OUT}/docs_blocks.cpp" "reader.hpp" "${includes_host}" "${units_host}")
elseif(OUT AND UNIT STREQUAL "docs_blocks_torch")
  write_unit("${OUT}/docs_blocks_torch.cpp" "reader_torch.hpp" "${includes_torch}" "${units_torch}")
elseif(OUT)
  message(FATAL_ERROR "docs_blocks.cmake: -DUNIT=${UNIT}: docs_blocks or docs_blocks_torch")
endif()

list(LENGTH not_compiled count_not_compiled)
if(not_compiled)
  list(JOIN not_compiled "\n  " not_compiled)
  unescape(not_compiled)
  set(not_compiled ":\n  ${not_compiled}")
endif()
message("docs.blocks: ${count_compiled} blocks compiled (dtrain_docs_blocks), ${count_torch} with "
        "LibTorch (dtrain_docs_blocks_torch), ${count_tied} tied to a file, ${count_not_compiled} "
        "not compiled${not_compiled}")
