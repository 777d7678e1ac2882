#!/usr/bin/env bash
# Everything your first GPU or NPU machine should show, in one command and at most 9 minutes: the device tests, a
# tiny-preset run (first-pass ratio), block-by-block alignment against the CPU and the FLUX.1-dev-sized benchmark.
#
#   bash launch/device_check.sh OUT_DIR [--budget-s 540] [--only tests ratio align bench] [--cpu]
#
# Logs: OUT_DIR/<part>.log; one line per part on stdout and in OUT_DIR/summary.txt (tools/device_check.py).
# Exit code: 0 every part passed, 1 one failed or ran out of time, 2 no accelerator found (or a bad argument).
set -euo pipefail
if [[ $# -lt 1 || $1 == -* ]]; then
  echo "usage: bash launch/device_check.sh OUT_DIR [--budget-s S] [--only PART ...] [--cpu]" >&2
  exit 2
fi
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# CANN must be sourced before torch_npu can be imported (see launch/run.sh).
if python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch_npu') is None)"; then
  source "$root/launch/npu_env.sh"
fi
out=$1
shift
exec python -m tools.device_check --out "$out" "$@"
