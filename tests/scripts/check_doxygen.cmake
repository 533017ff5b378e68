# docs.doxygen: the API reference builds without a warning, and the links of
# its main page (README.md) and of the pages (docs/*.md) land somewhere.
#   cmake -DBUILD=<build dir> -DHTML=<its docs-api/html> -P check_doxygen.cmake
# Builds the target dtrain_api_docs (cmake/dtrain_docs.cmake: Doxygen's
# WARN_AS_ERROR = FAIL_ON_WARNINGS; a warning here fails too), then checks each
# relative href of index.html and md_*.html: the file exists, and an #anchor
# into index.html or an md_*.html page is an id there.
execute_process(COMMAND "${CMAKE_COMMAND}" --build "${BUILD}" --target dtrain_api_docs
                OUTPUT_VARIABLE out ERROR_VARIABLE out RESULT_VARIABLE rc)
message("${out}")
if(NOT rc EQUAL 0 OR out MATCHES "(warning|error):")
  message(FATAL_ERROR "docs.doxygen: the API reference has warnings (above; rc ${rc})")
endif()

file(GLOB pages "${HTML}/index.html" "${HTML}/md_*.html")
set(broken "")
set(count 0)
foreach(page IN LISTS pages)
  get_filename_component(name "${page}" NAME)
  file(READ "${page}" text)
  string(REGEX MATCHALL "href=\"[^\":]*\"" hrefs "${text}")
  list(REMOVE_DUPLICATES hrefs)
  foreach(href IN LISTS hrefs)
    string(REGEX REPLACE "^href=\"(.*)\"$" "\\1" href "${href}")
    string(REGEX MATCH "^([^#]*)(#(.*))?$" _ "${href}")
    set(file "${CMAKE_MATCH_1}")
    set(anchor "${CMAKE_MATCH_3}")
    if(file STREQUAL "")
      set(file "${name}")
    endif()
    math(EXPR count "${count} + 1")
    if(NOT EXISTS "${HTML}/${file}")
      string(APPEND broken "${name}: href=\"${href}\": no file ${file}\n")
    elseif(anchor AND file MATCHES "^(index|md_.*)\\.html$")
      file(READ "${HTML}/${file}" target)
      string(FIND "${target}" "id=\"${anchor}\"" at)
      if(at EQUAL -1)
        string(APPEND broken "${name}: href=\"${href}\": no id \"${anchor}\" in ${file}\n")
      endif()
    endif()
  endforeach()
endforeach()
if(broken)
  message(FATAL_ERROR "docs.doxygen: links of the pages that land on nothing:\n${broken}")
endif()
list(LENGTH pages n)
message("docs.doxygen: no warning; ${count} links of ${n} pages land")
