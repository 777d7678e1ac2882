#!/usr/bin/env bash
# Run the GRPO recipe on this machine: every local NPU or GPU, or 2 CPU processes where there are none.
#
#   bash launch/run.sh CONFIG [key=value ...]
#   NPROC=4 bash launch/run.sh recipes/configs/flux1_dev/grpo_lora.yaml data.train_prompts=my.txt \
#     data.eval_prompts=my_heldout.txt output_dir=runs/exp1
#   RECIPE=my_recipe.py bash launch/run.sh my_config.yaml
#
# Environment: NPROC (process count), RECIPE (recipe script), MASTER_PORT (default: a free port), GRACE_S (seconds the
# workers get to finish the step and save after SIGTERM/SIGINT, default 600).
# Exit code: the workers' (0 done or stopped cleanly, 2 bad input, 3 too many skipped updates, 75 a dependency is down
# or a rank was killed by a signal: retry later, 1 anything else).
# SIGTERM/SIGINT to this script go to the workers (tools/torchrun.py), which finish the step, save and exit 0.
set -euo pipefail
if [[ $# -lt 1 ]]; then
  echo "usage: bash launch/run.sh CONFIG [key=value ...]" >&2
  exit 2
fi
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
config=$1
shift
recipe=${RECIPE:-$root/recipes/flux_grpo.py}
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

# CANN must be sourced before torch_npu can even be imported, so the NPU environment comes first.
if python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch_npu') is None)"; then
  source "$root/launch/npu_env.sh"
fi
# Which accelerator: the same detection DeepSpeed uses (torch_npu importable -> NPU, else CUDA, else CPU).
read -r kind count < <(python -c "from grpo.device import local_devices; print(*local_devices())")
case $kind in
  cpu)
    export DS_ACCELERATOR=cpu
    count=2
    # Split the cores between the processes instead of letting each one oversubscribe all of them.
    cores=$(nproc)
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / ${NPROC:-$count} > 0 ? cores / ${NPROC:-$count} : 1 ))}
    ;;
  *)
    # Return freed host blocks to the OS at once: with glibc's default threshold one rank kept ~200 MiB of freed
    # loading buffers, so sharded loading held 1.88 model copies per node instead of 1.17 (benchmarks/RESULTS.md).
    # Not on CPU runs, where every activation is a host allocation and would pay an mmap.
    export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-65536}
    ;;
esac
nproc_per_node=${NPROC:-$count}
# A bad setting fails here, in one process that loads no model, before every rank pays for its imports.
python -m tools.check --world-size "$nproc_per_node" "$config" "$@"

# One machine: a free port unless MASTER_PORT says otherwise, so two jobs on one node never meet in one rendezvous.
port=${MASTER_PORT:-$(python -c "from tools.launch import free_port; print(free_port())")}
cmd=(python -m tools.torchrun --nnodes 1 --nproc_per_node "$nproc_per_node"
     --master_addr 127.0.0.1 --master_port "$port"
     "$recipe" --config "$config" "$@")
echo "[launch] $kind x $nproc_per_node: ${cmd[*]}" >&2
exec "${cmd[@]}"
