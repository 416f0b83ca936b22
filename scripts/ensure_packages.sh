#!/usr/bin/env bash
# Installs whichever of the given Debian packages are missing, with apt-get (as root, or
# through sudo). Options starting with "-" before the packages go to `apt-get install`.
# Usage: scripts/ensure_packages.sh LABEL [APT_OPTION...] PACKAGE...
set -euo pipefail
label=$1
shift
options=()
while (($# > 0)) && [[ $1 == -* ]]; do
  options+=("$1")
  shift
done
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
$sudo apt-get update -q
$sudo apt-get install -y -q "${options[@]}" "${missing[@]}"
