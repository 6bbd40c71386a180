#!/usr/bin/env bash
# Every GPU benchmark in one run with one JSON summary ($OUT/gpu_all.json): see bench/gpu_all.py.
#   bench/gpu_all.sh            on the GPU machine (under 10 minutes)
#   bench/gpu_all.sh --smoke    on a CPU: checks the script, not the figures (CI runs it)
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/gpu_all.py" "$@"
