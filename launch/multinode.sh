#!/usr/bin/env bash
# Multi-node run with the DeepSpeed launcher and a hostfile (one line per node: "hostname slots=8").
#
#   bash launch/multinode.sh HOSTFILE CONFIG [key=value ...]
#
# The launcher ssh-es into every host (passwordless ssh, the same repo path and Python environment on each). It passes
# the workers only the variables with its export prefixes (PYTHON*, MLFLOW*, MV2*, UCX*, and ASCEND*/HCCL*/PATH*/
# LD_LIBRARY* on NPU, NCCL* on CUDA) and those of a ".deepspeed_env" file, so this script writes the NPU environment
# into a per-job file (see DS_ENV_FILE below). MASTER_ADDR defaults to the first host of the file.
# Without ssh (e.g. under a scheduler) run torchrun on each node instead:
#   NNODES=4 NODE_RANK=$i MASTER_ADDR=head bash launch/multinode.sh --torchrun CONFIG [key=value ...]
# Exit code: the workers' (0 done or stopped cleanly, 2 bad input, 3 too many skipped updates, 75 a dependency is down:
# retry later, 1 anything else).
# Preemption: SIGTERM/SIGINT to this script go to the workers on this machine, which finish the step, agree with the
# other ranks to stop, save and exit 0 (GRACE_S seconds at most, default 600): in the --torchrun form every node's
# script must get the signal (tools/torchrun.py); in the hostfile form the launching node's workers stop the whole job
# (tools/deepspeed_run.py, around the DeepSpeed launcher, which alone would kill the workers at once). With no worker
# on the launching node the hostfile form falls back to DeepSpeed's immediate stop: resume from the last checkpoint.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
recipe=${RECIPE:-$root/recipes/flux_grpo.py}
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
if [[ $# -lt 2 ]]; then
  echo "usage: bash launch/multinode.sh HOSTFILE|--torchrun CONFIG [key=value ...]" >&2
  exit 2
fi
if python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch_npu') is None)"; then
  source "$root/launch/npu_env.sh"
fi
read -r kind count < <(python -c "from grpo.device import local_devices; print(*local_devices())")
if [[ $kind == cpu ]]; then
  export DS_ACCELERATOR=cpu
else
  # Freed host blocks go back to the OS at once: sharded loading then holds ~1 model copy per node, not ~2 (see
  # launch/run.sh). The hostfile form forwards it through its .deepspeed_env file (below).
  export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-65536}
fi

hostfile=""
if [[ $1 == --torchrun ]]; then
  shift
  config=$1
  shift
  cmd=(python -m tools.torchrun --nnodes "${NNODES:?set NNODES}" --node_rank "${NODE_RANK:?set NODE_RANK}"
       --nproc_per_node "${NPROC:-$count}" --master_addr "${MASTER_ADDR:?set MASTER_ADDR}"
       --master_port "${MASTER_PORT:-29500}" "$recipe" --config "$config" "$@")
  world=$(( NNODES * ${NPROC:-$count} ))
else
  hostfile=$1
  config=$2
  shift 2
  [[ -f $hostfile ]] || { echo "error: hostfile $hostfile does not exist" >&2; exit 2; }
  master=${MASTER_ADDR:-$(awk 'NF && $1 !~ /^#/ {print $1; exit}' "$hostfile")}
  world=$(awk 'NF && $1 !~ /^#/ {for (i = 2; i <= NF; i++) if ($i ~ /^slots=/) n += substr($i, 7)} END {print n + 0}' \
          "$hostfile")
  (( world > 0 )) || { echo "error: hostfile $hostfile gives no slots; write one line per node: hostname slots=8" >&2
                       exit 2; }
  cmd=(python -m tools.deepspeed_run --hostfile "$hostfile" --master_addr "$master"
       --master_port "${MASTER_PORT:-29500}" "$recipe" --config "$config" "$@")
fi
# A bad setting fails here, in one process that loads no model, before every rank pays for its imports.
python -m tools.check --world-size "$world" "$config" "$@"
# Hostfile form: the other nodes get only what the launcher passes them (deepspeed/launcher/runner.py): variables
# with its prefixes, which drops PYTORCH_NPU_ALLOC_CONF, TASK_QUEUE_ENABLE, CPU_AFFINITY_CONF, MALLOC_MMAP_THRESHOLD_
# and TOOLCHAIN_HOME (and on CPU/CUDA even HCCL*/ASCEND*), plus the KEY=VALUE lines of ".deepspeed_env" in ~ or the
# current folder, or of the file DS_ENV_FILE names. A per-job file named by DS_ENV_FILE carries this job's values
# without touching yours: the variables below as this shell has them, then the lines of your own file(s), which win.
if [[ ${hostfile:-} ]]; then
  env_file=$(mktemp "${TMPDIR:-/tmp}/grpo_deepspeed_env.XXXXXX")
  own=${DS_ENV_FILE:-.deepspeed_env}
  if [[ $own == /* ]]; then own=("$own"); else own=("$HOME/$own" "./$own"); fi
  {
    while IFS= read -r var; do
      case $var in
        HCCL_*|ASCEND_*|TOOLCHAIN_HOME|PYTORCH_NPU_ALLOC_CONF|PYTORCH_ALLOC_CONF|TASK_QUEUE_ENABLE|CPU_AFFINITY_CONF|\
        MALLOC_MMAP_THRESHOLD_|DS_ACCELERATOR|OMP_NUM_THREADS)
          if [[ ${!var} != *$'\n'* ]]; then printf '%s=%s\n' "$var" "${!var}"; fi ;;
      esac
    done < <(compgen -e | sort)
    for file in "${own[@]}"; do
      if [[ -f $file ]]; then sed -e '/^[[:space:]]*$/d' -e '$a\' "$file"; fi
    done
  } > "$env_file"
  export DS_ENV_FILE=$env_file
  echo "[launch] environment for every node: $env_file" >&2
fi
echo "[launch] ${cmd[*]}" >&2
exec "${cmd[@]}"
