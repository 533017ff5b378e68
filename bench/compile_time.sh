#!/usr/bin/env bash
# Compile time of a program's translation units (issues 14 and 30): CPU time
# (user + system) and peak memory of g++ compiling each TU below, header-only
# (dtrain::header_only) and as the default CMake targets give it (dtrain::dtrain
# and dtrain::<engine> link dtrain's library and define
# DTRAIN_SEPARATE_COMPILATION=1), at -O2 and at CMake's Release flags. Median of
# N runs (3). Prints a markdown table. Run by hand, not by ctest.
#
#   bench/compile_time.sh [--runs N] [--cxx g++] [--flags "-O2|-O3 -DNDEBUG"]
#
# Rows: an empty TU; `#include <dtrain/dtrain.hpp>` alone; run<> over Gloo
# (compile_time/run_only.cpp); run<> and a DistributedDataParallel
# (compile_time/demo.cpp); the demo's TU (examples/train_mlp.cpp, with its
# checkpoints, Adam and sharding); then, once per build of the library, its
# parts for Gloo (src/core.cpp, its non-template functions; src/gloo.cpp, the Gloo
# policies' templates; src/link_check.cpp). When bench/compile_time/torch_mlp.cpp
# (a LibTorch user's training TU) exists and LibTorch is found (CMake's
# find_package(Torch), else Debian's libtorch-dev paths): that TU without dtrain
# (compiled with -DDTRAIN_BENCH_WITHOUT_DTRAIN=1, which the file honours), with
# dtrain header-only and with dtrain's compiled parts
# (DTRAIN_TORCH_SEPARATE_COMPILATION=1 too), and src/torch.cpp once if it exists.
#
# CPU time, not wall time: other processes on the machine inflate it far less
# (the load average is printed before and after). Wall time is the last column
# of each cell for reference.
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

compiled=(-DDTRAIN_SEPARATE_COMPILATION=1)

# measure <source> <flags...>: "cpu MiB wall", each the median of $runs compiles.
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
    cpus+=("$(awk -v u="$u" -v s="$s" 'BEGIN { printf "%.1f", u + s }')")
    mems+=("$((m / 1024))")
  done
  echo "$(median "${cpus[@]}") $(median "${mems[@]}") $(median "${walls[@]}")"
}

median() { printf '%s\n' "$@" | sort -g | sed -n "$((($# + 1) / 2))p"; }

# cell <cpu> <MiB> <wall>
cell() { printf '%s s, %s MiB (wall %s s)' "$1" "$2" "$3"; }

# row <name> <source> <which: both|compiled|plain> [<extra flags>...]
# (compiled: the default columns only; plain: no dtrain, measured once for both columns)
row() {
  local name="$1" source="$2" which="$3"
  shift 3
  local line="| $name |" flags f c
  for flags in "${flag_sets[@]}"; do
    read -r -a f <<<"$flags"
    if [[ $which == plain ]]; then
      c="$(cell $(measure "$source" "${f[@]}" "$@"))"
      line+=" $c | $c |"
      continue
    fi
    if [[ $which == compiled ]]; then
      line+=" |"
    else
      line+=" $(cell $(measure "$source" "${f[@]}" "$@")) |"
    fi
    line+=" $(cell $(measure "$source" "${f[@]}" "${compiled[@]}" "$@")) |"
  done
  echo "$line"
}

# LibTorch's include dirs and flags: CMake's find_package(Torch), else Debian's layout.
torch_flags=()
torch_source="$here/compile_time/torch_mlp.cpp"
find_torch() {
  mkdir -p "$work/torch"
  cat >"$work/torch/CMakeLists.txt" <<'EOF'
cmake_minimum_required(VERSION 3.21)
project(find_torch LANGUAGES CXX)
find_package(Torch QUIET)
if(Torch_FOUND)
  message(STATUS "dtrain-bench-torch-includes=${TORCH_INCLUDE_DIRS}")
  message(STATUS "dtrain-bench-torch-flags=${TORCH_CXX_FLAGS}")
endif()
EOF
  local out includes="" cxxflags="" dir
  if command -v cmake >/dev/null &&
     out="$(cmake -S "$work/torch" -B "$work/torch/build" -DCMAKE_CXX_COMPILER="$cxx" 2>/dev/null)" &&
     [[ $out == *dtrain-bench-torch-includes=* ]]; then
    includes="$(sed -n 's/^-- dtrain-bench-torch-includes=//p' <<<"$out")"
    cxxflags="$(sed -n 's/^-- dtrain-bench-torch-flags=//p' <<<"$out")"
  elif [[ -f /usr/include/torch/csrc/api/include/torch/torch.h ]]; then
    includes="/usr/include;/usr/include/torch/csrc/api/include"
    cxxflags="-D_GLIBCXX_USE_CXX11_ABI=1"
  else
    return 1
  fi
  IFS=';' read -r -a dirs <<<"$includes"
  for dir in "${dirs[@]}"; do
    # The compiler's own directories stay where they are in its search order.
    [[ $dir == /usr/include || $dir == /usr/local/include || -z $dir ]] || torch_flags+=(-isystem "$dir")
  done
  read -r -a f <<<"$cxxflags"
  torch_flags+=("${f[@]}")
}

echo "g++: $("$cxx" --version | head -n 1); $(nproc) cores; median of $runs; CPU seconds (user + system)"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
header="| translation unit |"
rule="| --- |"
for flags in "${flag_sets[@]}"; do
  header+=" header-only \`$flags\` | default (compiled) \`$flags\` |"
  rule+=" ---: | ---: |"
done
echo "$header"
echo "$rule"
row "empty" "$work/empty.cpp" both
row "\`#include <dtrain/dtrain.hpp>\`" "$work/include.cpp" both
row "\`run<>\` over Gloo (\`bench/compile_time/run_only.cpp\`)" "$here/compile_time/run_only.cpp" both
row "\`run<>\` + \`DistributedDataParallel\` (\`bench/compile_time/demo.cpp\`)" \
  "$here/compile_time/demo.cpp" both
# The demo's TU (examples/train_mlp.cpp: checkpoints, Adam, sharding), with its
# local headers; without MLP_CBLAS, so with examples/mlp.hpp's plain loops for
# its matrix products (the project's build, with a BLAS, compiles a call instead).
row "the demo (\`examples/train_mlp.cpp\`: checkpoints, Adam, sharding)" \
  "$root/examples/train_mlp.cpp" both -I"$root/examples"
row "the library's Gloo part (\`src/gloo.cpp\`, once per build of it)" "$root/src/gloo.cpp" compiled -fPIC
row "the library's non-template functions (\`src/core.cpp\`, once per build of it)" "$root/src/core.cpp" compiled -fPIC
row "the library's link check (\`src/link_check.cpp\`, once)" "$root/src/link_check.cpp" compiled -fPIC
if [[ -f $torch_source ]]; then
  if find_torch; then
    row "LibTorch training TU without dtrain (\`bench/compile_time/torch_mlp.cpp\`)" "$torch_source" \
      plain -DDTRAIN_BENCH_WITHOUT_DTRAIN=1 "${torch_flags[@]}"
    row "the same TU with dtrain" "$torch_source" both -DDTRAIN_TORCH_SEPARATE_COMPILATION=1 \
      "${torch_flags[@]}"
    if [[ -f $root/src/torch.cpp ]]; then
      row "\`dtrain::torch\`'s part (\`src/torch.cpp\`, once per build of it)" "$root/src/torch.cpp" \
        compiled -fPIC -DDTRAIN_TORCH_SEPARATE_COMPILATION=1 "${torch_flags[@]}"
    fi
  else
    echo
    echo "(no LibTorch found: the LibTorch rows are left out)"
  fi
fi
echo
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
