#!/usr/bin/env bash
# tools/install-deps --from DIR, as on a machine without a package registry
# (tools/gpu-check's GPU machines): every .deb's files unpacked where no file
# is (a file already there is kept, byte for byte), the links Debian's
# alternatives make for OpenBLAS, and a clear exit for bad input. Into a
# scratch root (DTRAIN_DEPS_ROOT), from two packages built here with
# dpkg-deb; --download needs a package registry and is not run here.
#   bash check_install_deps_offline.sh <repo>
set -uo pipefail
repo=$1
tool="$repo/tools/install-deps"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
if ! command -v dpkg-deb >/dev/null; then
  echo "SKIPPED: needs dpkg-deb (Debian's dpkg)"
  exit 0
fi

# Two packages: a header and a library in OpenBLAS's Debian places.
for pkg in fake-dev fake-blas; do
  mkdir -p "$work/$pkg/DEBIAN"
  printf 'Package: %s\nVersion: 1.0\nArchitecture: all\nMaintainer: dtrain tests <none@example.com>\nDescription: test\n' \
    "$pkg" >"$work/$pkg/DEBIAN/control"
done
mkdir -p "$work/fake-dev/usr/include/fake" "$work/fake-blas/usr/lib/x86_64-linux-gnu/openblas-pthread" \
  "$work/fake-blas/usr/include/x86_64-linux-gnu/openblas-pthread"
echo "packaged new" >"$work/fake-dev/usr/include/fake/new.h"
echo "packaged old" >"$work/fake-dev/usr/include/fake/old.h"
echo "library" >"$work/fake-blas/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
ln -s libopenblas.so.0 "$work/fake-blas/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so"
echo "cblas" >"$work/fake-blas/usr/include/x86_64-linux-gnu/openblas-pthread/cblas.h"
mkdir -p "$work/debs"
for pkg in fake-dev fake-blas; do
  dpkg-deb --root-owner-group -b "$work/$pkg" "$work/debs/$pkg.deb" >/dev/null || fail "dpkg-deb -b $pkg"
done

root="$work/root"
mkdir -p "$root/usr/include/fake"
echo "the system's" >"$root/usr/include/fake/old.h"
out=$(DTRAIN_DEPS_ROOT=$root bash "$tool" --from "$work/debs" 2>&1)
status=$?
echo "$out"
((status == 0)) || fail "--from exited $status"
[[ $(cat "$root/usr/include/fake/new.h") == "packaged new" ]] || fail "new.h was not added"
[[ $(cat "$root/usr/include/fake/old.h") == "the system's" ]] || fail "old.h, already there, was replaced"
[[ $(readlink "$root/usr/lib/x86_64-linux-gnu/libopenblas.so.0") == openblas-pthread/libopenblas.so.0 ]] ||
  fail "no libopenblas.so.0 link where the loader looks"
[[ $(cat "$root/usr/lib/x86_64-linux-gnu/libopenblas.so") == library ]] ||
  fail "libopenblas.so does not lead to the library"
[[ $(cat "$root/usr/include/x86_64-linux-gnu/cblas.h") == cblas ]] || fail "no cblas.h where CMake looks"
grep -q "files added under $root, 1 already there (kept)" <<<"$out" || fail "the summary line"
# Again: nothing to add, nothing replaced.
out=$(DTRAIN_DEPS_ROOT=$root bash "$tool" --from "$work/debs" 2>&1) || fail "--from a second time exited $?"
grep -q ": 0 files added" <<<"$out" || fail "a second --from added files: $out"

# Bad input: a folder without .deb files (exit 1, naming it), an unknown argument (exit 2).
mkdir "$work/empty"
out=$(DTRAIN_DEPS_ROOT=$root bash "$tool" --from "$work/empty" 2>&1)
status=$?
((status == 1)) && grep -q "no .deb file in '$work/empty'" <<<"$out" || fail "--from an empty folder: exit $status: $out"
out=$(bash "$tool" --frm "$work/debs" 2>&1)
status=$?
((status == 2)) && grep -q "unknown argument '--frm'" <<<"$out" || fail "--frm: exit $status: $out"
echo "install-deps --from: files added where none was, none replaced, OpenBLAS linked"
