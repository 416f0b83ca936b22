#!/usr/bin/env bash
# The Debian package from end to end, as a user gets it: `cpack -G DEB` in the build tree, the
# package's fields and files, `apt-get install ./torchpoint_*.deb`, the consumer project built
# against the installed package with find_package(torchpoint) (nothing pointing at another copy),
# the installed CLI run with no LD_LIBRARY_PATH (--help, verify of good and damaged files), every
# Debian package the CLI links to and the CMake package finds declared in Depends, and finally
# the package purged, leaving no file of it on the system.
#
# It installs into the real /usr, so it needs root (it skips, exit 77, without) and holds a lock
# from before the install until after the removal: two copies of it never overlap. The removal
# runs however the test ends; a run killed outright leaves a marker, and the next run removes what
# it left. A torchpoint package or file already on the system that this test did not install
# fails it instead of being replaced.
# Usage: run_deb_test.sh SOURCE_DIR BUILD_DIR WORK_DIR GENERATOR TORCH_DIR TORCH_LIBRARY
#                        CXX_COMPILER CMAKE CPACK VERSION LIBDIR
set -euo pipefail
source_dir=$1 build_dir=$2 work=$3 generator=$4 torch_dir=$5 torch_library=$6 cxx=$7
cmake=$8 cpack=$9 version=${10} libdir=${11}

skip() {
  echo "deb_package: SKIPPED: $*"
  exit 77
}
fail() {
  printf 'deb_package: FAILED: %b\n' "$*" >&2
  exit 1
}
# Runs a command quietly, printing its output only when it fails.
quiet() {
  local log=$work/last_command.log
  if ! "$@" >"$log" 2>&1; then
    cat "$log" >&2
    fail "command failed: $*"
  fi
}

[[ $(id -u) -eq 0 ]] || skip "installing a .deb into /usr needs root (CI runs the tests as root)"
for tool in dpkg dpkg-deb dpkg-query apt-get flock readelf ldd; do
  command -v "$tool" >/dev/null || skip "$tool is missing: not a Debian system"
done
rm -rf "$work"
mkdir -p "$work"
cd "$work"

# The package, from the build tree as it is (cpack installs what the build made; it builds nothing).
quiet "$cpack" -G DEB --config "$build_dir/CPackConfig.cmake" -B "$work/cpack"
debs=("$work"/cpack/torchpoint_*.deb)
[[ ${#debs[@]} -eq 1 && -f ${debs[0]} ]] || fail "cpack wrote no single torchpoint_*.deb: ${debs[*]}"
deb=${debs[0]}
arch=$(dpkg --print-architecture)
[[ $(basename "$deb") == "torchpoint_${version}_${arch}.deb" ]] || fail "file name $(basename "$deb")"

field() { dpkg-deb -f "$deb" "$1"; }
[[ $(field Package) == torchpoint ]] || fail "Package: $(field Package)"
[[ $(field Version) == "$version" ]] || fail "Version: $(field Version), the project's is $version"
[[ $(field Architecture) == "$arch" ]] || fail "Architecture: $(field Architecture)"
[[ $(field Maintainer) == *"<"*"@"*">" ]] || fail "Maintainer is not 'name <address>': $(field Maintainer)"
torch_lib_dir=$(dirname "$torch_library")
debian_torch=false  # Debian's libtorch-dev is a dependency like the others; any other LibTorch is not
[[ $torch_lib_dir == /usr/lib/* ]] && debian_torch=true
$debian_torch || [[ $(field Description) == *"$torch_lib_dir"* ]] ||
  fail "the Description does not name the LibTorch the package needs ($torch_lib_dir)"
# Dependency names, alternatives included, without versions.
depends=$(field Depends)
declared=" $(sed -e 's/([^)]*)//g' -e 's/[,|]/ /g' <<<"$depends" | tr -s ' ') "

# Its files: the library, every public header, the CMake package and the CLI, all under /usr.
files=() dirs=()
while read -r mode path; do
  path=${path#.}
  path=${path%/}
  [[ -z $path ]] && continue
  [[ $path == /usr || $path == /usr/* ]] || fail "the package installs $path, outside /usr"
  if [[ $mode == d* ]]; then dirs+=("$path"); else files+=("$path"); fi
done < <(dpkg-deb -c "$deb" | awk '{ print $1, $6 }')
config_dir=/usr/$libdir/cmake/torchpoint
expected=(/usr/bin/torchpoint "/usr/$libdir/libtorchpoint.a" "$config_dir/torchpointConfig.cmake"
  "$config_dir/torchpointConfigVersion.cmake" "$config_dir/torchpointTargets.cmake"
  "$config_dir/FindxxHash.cmake" "$config_dir/torchpoint_torch_paths.cmake")
for h in "$source_dir"/include/torchpoint/*.h; do expected+=("/usr/include/torchpoint/$(basename "$h")"); done
for f in "${expected[@]}"; do
  [[ " ${files[*]} " == *" $f "* ]] || fail "the package lacks $f"
done

# From here on the system changes: one copy of this test at a time.
lock_dir=/run/lock
[[ -d $lock_dir ]] || lock_dir=/tmp
exec 9>"$lock_dir/torchpoint-deb-test.lock"
flock -w 300 9 || fail "another deb_package test held $lock_dir/torchpoint-deb-test.lock for 5 minutes"
marker=/var/tmp/torchpoint-deb-test.installed
apt_options=(-y -q --no-install-recommends -o DPkg::Lock::Timeout=120)
export DEBIAN_FRONTEND=noninteractive
known() { dpkg-query -W -f='${db:Status-Abbrev}' torchpoint 2>/dev/null | grep -qv '^un'; }
if [[ -f $marker ]]; then
  echo "deb_package: removing the torchpoint package a killed run of this test left installed"
  if known; then quiet apt-get purge "${apt_options[@]}" torchpoint; fi
  rm -f "$marker"
fi
if known; then
  fail "a torchpoint package this test did not install is on the system; it would replace and" \
    "then remove it: remove it first (apt-get purge torchpoint) or run the test elsewhere"
fi
for f in "${files[@]}"; do
  [[ -e $f || -L $f ]] && fail "$f is already on the system (installed by hand?): the package" \
    "would overwrite it and its removal would delete it; remove it or run the test elsewhere"
done
new_dirs=()
for d in "${dirs[@]}"; do [[ -d $d ]] || new_dirs+=("$d"); done
# Nothing but the package itself may be installed: a missing dependency would be downloaded and
# stay behind. setup.sh installs them all.
plan=$(apt-get install -s "${apt_options[@]}" "$deb" 2>&1) || fail "apt-get cannot install the package:\n$plan"
others=$(sed -n 's/^Inst \([^ ]*\).*/\1/p' <<<"$plan" | grep -vx torchpoint || true)
[[ -z $others ]] || fail "dependencies of the package are missing ($(echo $others)): install them" \
  "first (scripts/setup.sh does)"

remove_package() {
  local rc=$? left=()
  trap - EXIT
  if known && ! apt-get purge "${apt_options[@]}" torchpoint >"$work/purge.log" 2>&1; then
    cat "$work/purge.log" >&2
    echo "deb_package: FAILED: could not remove the package (apt-get purge torchpoint)" >&2
    exit 1
  fi
  for f in "${files[@]}"; do [[ -e $f || -L $f ]] && left+=("$f"); done
  for d in "${new_dirs[@]}"; do [[ -d $d ]] && left+=("$d/"); done
  if ((${#left[@]} > 0)); then
    echo "deb_package: FAILED: the removed package left ${left[*]}" >&2
    rc=1
  fi
  rm -f "$marker"
  exit $rc
}
echo "$$ $deb" >"$marker"
trap remove_package EXIT
trap 'exit 130' INT TERM HUP
quiet apt-get install "${apt_options[@]}" "$deb"
dpkg-query -W -f='${db:Status-Abbrev}' torchpoint | grep -q '^ii' || fail "torchpoint is not installed"

# A project of a user's: find_package(torchpoint) with nothing but the LibTorch it needs, which
# must find the package in /usr (not the build tree, not another test's prefix).
quiet env -u CMAKE_PREFIX_PATH -u LD_LIBRARY_PATH "$cmake" -S "$source_dir/tests/consumer" \
  -B "$work/build" -G "$generator" "-DTorch_DIR=$torch_dir" -DCMAKE_BUILD_TYPE=Release \
  "-DCMAKE_CXX_COMPILER=$cxx"
cache() { sed -n "s/^$1:[A-Z]*=//p" "$work/build/CMakeCache.txt"; }
[[ $(cache torchpoint_DIR) == "$config_dir" ]] ||
  fail "find_package(torchpoint) found $(cache torchpoint_DIR), not the package's $config_dir"
quiet "$cmake" --build "$work/build"
quiet env -u LD_LIBRARY_PATH "$work/build/consumer" "$work"

# The Debian package owning a file; /lib and /usr/lib are one directory on merged-/usr systems.
owner() {
  local c out
  for c in "$1" "$(readlink -f "$1")" "${1#/usr}" "/usr$1"; do
    if out=$(dpkg-query -S "$c" 2>/dev/null); then
      echo "${out%%:*}"
      return
    fi
  done
  echo "(no package)"
}
need_declared() {  # need_declared FILE WHY
  local package
  package=$(owner "$1")
  [[ $declared == *" $package "* ]] ||
    fail "$2 $1, of the Debian package $package, which Depends does not name: $depends"
}
# Build time: what the installed torchpointConfig.cmake found for the consumer.
for key in nlohmann_json_DIR fmt_DIR simdjson_DIR xxHash_LIBRARY PKG_CONFIG_EXECUTABLE \
  pkgcfg_lib_cairo_cairo; do
  path=$(cache "$key")
  [[ -n $path ]] || fail "the consumer's configure set no $key"
  if [[ $key == *_DIR ]]; then  # the package's config file: a directory may have many owners
    path=$(find "$path" -maxdepth 1 -name '*onfig.cmake' | head -n 1)
  fi
  need_declared "$path" "find_package(torchpoint) uses"
done
need_declared "$(cache xxHash_INCLUDE_DIR)/xxhash.h" "find_package(torchpoint) uses"

# Run time: every library the installed CLI names, found without LD_LIBRARY_PATH; LibTorch the one
# it was built against, the rest declared.
libraries=$(env -u LD_LIBRARY_PATH ldd /usr/bin/torchpoint) || fail "ldd /usr/bin/torchpoint:\n$libraries"
expected_torch=$(readlink -f "$torch_lib_dir")
for name in $(readelf -d /usr/bin/torchpoint | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
  # "name => path (address)", or "path (address)" for the dynamic loader.
  path=$(awk -v n="$name" '($1 == n && $2 == "=>") { print $3 }
    ($2 != "=>" && substr($1, length($1) - length(n)) == "/" n) { print $1 }' <<<"$libraries")
  [[ -n $path && $path != not ]] || fail "the installed CLI does not find $name:\n$libraries"
  if ! $debian_torch && [[ $name == libtorch* || $name == libc10* ]]; then
    [[ $(dirname "$(readlink -f "$path")") == "$expected_torch" ]] ||
      fail "the installed CLI loads $name from $path, not from $expected_torch"
  else
    need_declared "$path" "the installed CLI links to"
  fi
done

unset LD_LIBRARY_PATH
quiet /usr/bin/torchpoint --help
grep -q verify "$work/last_command.log" || fail "torchpoint --help does not list verify"
quiet /usr/bin/torchpoint verify "$work/consumer.safetensors" "$source_dir/tests/data/golden_v2/checkpoint_1"
# A damaged copy: verify must say so (exit status 1), naming the file.
cp "$work/consumer.safetensors" "$work/damaged.safetensors"
size=$(stat -c %s "$work/damaged.safetensors")
last=$(tail -c 1 "$work/damaged.safetensors" | od -An -tu1 | tr -d ' ')
printf "\\x$(printf %02x $((255 - last)))" |
  dd of="$work/damaged.safetensors" bs=1 seek=$((size - 1)) conv=notrunc status=none
rc=0
/usr/bin/torchpoint verify "$work/damaged.safetensors" >"$work/damaged.log" 2>&1 || rc=$?
[[ $rc -eq 1 ]] && grep -q damaged.safetensors "$work/damaged.log" ||
  fail "verify of a damaged file exited $rc: $(cat "$work/damaged.log")"
echo "deb_package: $(basename "$deb") installed, used by find_package and run from /usr/bin, removed"
