#!/usr/bin/env bash
# Compile time of a program's translation units (issue 14): wall time and peak
# memory of g++ on an empty TU, on `#include <dtrain/dtrain.hpp>` alone, on a
# run<> over Gloo TU, and on the issue's demo (run<> and a
# DistributedDataParallel), header-only and in separate mode
# (DTRAIN_SEPARATE_COMPILATION=1, what linking dtrain::compiled gives), at -O2
# and at CMake's Release flags. Median of N runs (3). Prints a markdown table.
# Run by hand, not by ctest; a loaded machine inflates every figure, so the
# load average is printed with it.
#
#   bench/compile_time.sh [--runs N] [--cxx g++] [--flags "-O2|-O3 -DNDEBUG"]
#
# The last row is what separate mode moves elsewhere: dtrain::compiled's Gloo
# part (src/gloo.cpp), compiled once per build of the library.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
runs=3
cxx="${CXX:-g++}"
flag_sets=("-O2" "-O3 -DNDEBUG")
while (($#)); do
  case "$1" in
    --runs) runs="$2"; shift 2 ;;
    --cxx) cxx="$2"; shift 2 ;;
    --flags) IFS='|' read -r -a flag_sets <<<"$2"; shift 2 ;;
    *) echo "usage: $0 [--runs N] [--cxx g++] [--flags \"-O2|-O3 -DNDEBUG\"]" >&2; exit 2 ;;
  esac
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
: >"$work/empty.cpp"
echo '#include <dtrain/dtrain.hpp>' >"$work/include.cpp"

# measure <source> <flags...>: "wall cpu MiB", each the median of $runs compiles
# (cpu: user + system seconds, which other processes on the machine inflate less).
measure() {
  local source="$1"; shift
  local walls=() cpus=() mems=() i w u s m
  for ((i = 0; i < runs; ++i)); do
    if ! /usr/bin/time -f '%e %U %S %M' -o "$work/time" "$cxx" -std=c++20 "$@" -DDTRAIN_WITH_GLOO=1 \
         -I"$root/include" -c "$source" -o "$work/out.o" 2>"$work/err"; then
      echo "compile of $source failed:" >&2; cat "$work/err" >&2; exit 1
    fi
    read -r w u s m < <(tail -n 1 "$work/time")
    walls+=("$w")
    cpus+=("$(awk -v u="$u" -v s="$s" 'BEGIN { printf "%.2f", u + s }')")
    mems+=("$((m / 1024))")
  done
  echo "$(median "${walls[@]}") $(median "${cpus[@]}") $(median "${mems[@]}")"
}

median() { printf '%s\n' "$@" | sort -g | sed -n "$((($# + 1) / 2))p"; }

# cell <wall> <cpu> <MiB>
cell() { printf '%s s (cpu %s s), %s MiB' "$1" "$2" "$3"; }

rows=(
  "empty TU|$work/empty.cpp|"
  "\`#include <dtrain/dtrain.hpp>\`|$work/include.cpp|"
  "run<> over Gloo (bench/compile_time/run_only.cpp)|$here/compile_time/run_only.cpp|"
  "demo: run<> + DDP (bench/compile_time/demo.cpp)|$here/compile_time/demo.cpp|"
)

echo "g++: $("$cxx" --version | head -n 1); $(nproc) cores; median of $runs"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
header="| TU |"
rule="| --- |"
for flags in "${flag_sets[@]}"; do
  header+=" header-only $flags | separate $flags |"
  rule+=" ---: | ---: |"
done
echo "$header"
echo "$rule"
for row in "${rows[@]}"; do
  IFS='|' read -r name source _ <<<"$row"
  line="| $name |"
  for flags in "${flag_sets[@]}"; do
    read -r -a f <<<"$flags"
    line+=" $(cell $(measure "$source" "${f[@]}")) |"
    line+=" $(cell $(measure "$source" "${f[@]}" -DDTRAIN_SEPARATE_COMPILATION=1)) |"
  done
  echo "$line"
done
line="| dtrain::compiled, Gloo part (src/gloo.cpp, once) |"
for flags in "${flag_sets[@]}"; do
  read -r -a f <<<"$flags"
  line+=" | $(cell $(measure "$root/src/gloo.cpp" "${f[@]}" -DDTRAIN_SEPARATE_COMPILATION=1)) |"
done
echo "$line"
echo
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
