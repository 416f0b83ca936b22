#!/usr/bin/env bash
# Makes the project venv in ./.venv (ignored by git) with the pinned packages of
# python/requirements.txt, if it is missing or out of date, and prints its python's path.
# Everything else goes to stderr. Safe to run again: a venv that already matches is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
requirements=python/requirements.txt
stamp=$venv/.requirements
# One maker at a time (scripts/test.sh and sanitize.sh may ask at once): a second caller
# waits, then finds the venv made.
exec 9>"$venv.lock"
flock 9
if [[ -x $venv/bin/python ]] && cmp -s "$requirements" "$stamp"; then
  echo "$PWD/$venv/bin/python"
  exit 0
fi
{
  # The wheel is built for CPython 3.11: Debian 12's python3, or another 3.11 first on PATH.
  python=python3
  if ! python3 -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
    python=/usr/bin/python3
  fi
  if ! "$python" -c 'import venv, ensurepip' 2>/dev/null; then
    scripts/ensure_packages.sh venv python3 python3-venv
    python=/usr/bin/python3
  fi
  echo "venv: making $venv with $("$python" --version) and $requirements"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$requirements"
  cp "$requirements" "$stamp"
} >&2
echo "$PWD/$venv/bin/python"
