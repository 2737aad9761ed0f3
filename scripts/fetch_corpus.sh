#!/usr/bin/env bash
# Fetch the demo model's corpus with the ordinary package client and write it to data/corpus.
# Needs: Debian/Ubuntu with apt (as root, or sudo), network access to the apt mirror.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
if [ ! -d /usr/share/doc/python3.11/html/_sources ] || [ ! -d /usr/lib/python3.11 ]; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3.11-doc libpython3.11-stdlib
fi
"$PY" -m tools.train.corpus --out data/corpus "$@"
