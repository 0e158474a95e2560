#!/usr/bin/env bash
# Bytes of the working tree as the device tool sends it (files git tracks or does not ignore); with a folder
# argument, also copies those files there.
set -euo pipefail
cd "$(dirname "$0")/../.."
git ls-files -co --exclude-standard | while IFS= read -r f; do
  if [ -f "$f" ]; then
    stat -c %s "$f"
    if [ $# -gt 0 ]; then mkdir -p "$1/$(dirname "$f")" && cp -p "$f" "$1/$f"; fi
  fi
done | awk '{s += $1} END {print s + 0}'
