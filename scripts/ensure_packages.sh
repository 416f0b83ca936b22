#!/usr/bin/env bash
# Installs whichever of the given Debian packages are missing, with apt-get (as root, or
# through sudo). Options starting with "-" before the packages go to `apt-get install`.
# Usage: scripts/ensure_packages.sh LABEL [APT_OPTION...] PACKAGE...
# Two of these may run at once (scripts/test.sh and scripts/sanitize.sh started together):
# a lock makes the second wait for the first, then look again at what is missing, instead of
# failing on dpkg's own lock.
set -euo pipefail
label=$1
shift
options=()
while (($# > 0)) && [[ $1 == -* ]]; do
  options+=("$1")
  shift
done
exec 9>"${TMPDIR:-/tmp}/torchpoint-apt.lock"
flock 9  # not passed on (9>&- below): a daemon a package starts must not keep it
missing=()
for p in "$@"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
((${#missing[@]} == 0)) && exit 0
echo "$label: installing ${missing[*]}"
sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q 9>&-
$sudo apt-get install -y -q "${options[@]}" "${missing[@]}" 9>&-
