#!/usr/bin/env bash
# Environment for Ascend NPU runs (910B / A2, A3). Source it, do not execute it:
#
#   source launch/npu_env.sh            # launch/run.sh does this when it finds NPUs
#
# Every variable keeps a value you exported before sourcing (`: "${VAR:=default}"`), so override by exporting first,
# e.g. `HCCL_BUFFSIZE=800 source launch/npu_env.sh`. Safe under `set -euo pipefail`. Facts and sources:
# CANN's HCCL user guide (https://www.hiascend.com/document/detail/en/canncommercial/850/commlib/hcclug/),
# torch_npu docs/zh/api/environment_variable/ (env_variable_list.md, PYTORCH_NPU_ALLOC_CONF.md), and what the Ascend
# DanceGRPO ports set: Ascend/MindSpeed-MM examples/dancegrpo/posttrain_flux_dancegrpo.sh, verl-recipe
# mm_dance_grpo/run_verl_dance.sh.

# CANN: torch_npu cannot load libhccl.so / libascendcl.so without the toolkit's environment
# (ImportError "... Please run 'source set_env.sh' in the CANN installation path").
_grpo_cann_env=""
if [[ -n "${ASCEND_TOOLKIT_HOME:-}" && -f "${ASCEND_TOOLKIT_HOME}/set_env.sh" ]]; then
  _grpo_cann_env="${ASCEND_TOOLKIT_HOME}/set_env.sh"
elif [[ -n "${ASCEND_TOOLKIT_HOME:-}" && -f "${ASCEND_TOOLKIT_HOME}/../set_env.sh" ]]; then
  _grpo_cann_env="${ASCEND_TOOLKIT_HOME}/../set_env.sh"   # ASCEND_TOOLKIT_HOME may point at .../ascend-toolkit/latest
elif [[ -f /usr/local/Ascend/ascend-toolkit/set_env.sh ]]; then
  _grpo_cann_env=/usr/local/Ascend/ascend-toolkit/set_env.sh
elif [[ -f /usr/local/Ascend/cann/set_env.sh ]]; then
  _grpo_cann_env=/usr/local/Ascend/cann/set_env.sh      # CANN >= 8.5 layout used by MindSpeed-MM's scripts
fi
if [[ -n "$_grpo_cann_env" ]]; then
  # CANN's script reads unset variables (e.g. LD_LIBRARY_PATH) and may return non-zero: relax -u/-e while it runs.
  # ($- rather than $(set +o): bash clears errexit inside command substitutions, so that would lose `set -e`.)
  _grpo_opts=$-
  set +eu
  # shellcheck disable=SC1090
  source "$_grpo_cann_env"
  if [[ $_grpo_opts == *e* ]]; then set -e; fi
  if [[ $_grpo_opts == *u* ]]; then set -u; fi
  unset _grpo_opts
else
  echo "[npu_env] CANN set_env.sh not found (set ASCEND_TOOLKIT_HOME); torch_npu will fail to import" >&2
fi
unset _grpo_cann_env

# Seconds HCCL waits to set up links between ranks (default 120). Model loading on rank 0 and JIT op compilation
# skew the ranks' arrival at the first collective by minutes on big models; MindSpeed-MM and verl use 1200.
: "${HCCL_CONNECT_TIMEOUT:=1200}"
export HCCL_CONNECT_TIMEOUT

# MB of HCCL buffer per communicator, allocated twice (send + recv); default 200. ZeRO-3 all-gathers whole FLUX
# blocks (~340 MB in bf16 for a double-stream block), and a buffer smaller than a message splits it into rounds.
: "${HCCL_BUFFSIZE:=800}"
export HCCL_BUFFSIZE

# Caching allocator with virtual-memory segments: less fragmentation from the changing shapes of rollout (no grad)
# and training (grad) steps. Do not also set PYTORCH_ALLOC_CONF (setting both is an error on torch_npu >= 26.2.0).
: "${PYTORCH_NPU_ALLOC_CONF:=expandable_segments:True}"
export PYTORCH_NPU_ALLOC_CONF

# Operator dispatch pipeline of torch_npu: 0 off, 1 two-stage queue, 2 also balances work across host threads
# (fewer host-side stalls between small kernels). MindSpeed-MM's FLUX DanceGRPO script uses 2.
: "${TASK_QUEUE_ENABLE:=2}"
export TASK_QUEUE_ENABLE

# Bind each rank's host threads to the CPU cores near its NPU: 1 coarse binding, 2 finer (main/ACL/release threads
# on separate cores). Without it ranks compete for cores and launch kernels late.
: "${CPU_AFFINITY_CONF:=1}"
export CPU_AFFINITY_CONF

# Which chips this job may use (the NPU's CUDA_VISIBLE_DEVICES; logical chip ids). Left alone when set (a scheduler
# or the user chose). Otherwise the "Chip Logic ID"s of every Ascend chip `npu-smi info -m` lists (an A3 NPU holds two
# chips, so NPU ids are not chip ids); without npu-smi it stays unset, which the runtime reads as "all chips".
if [[ -z "${ASCEND_RT_VISIBLE_DEVICES:-}" ]] && command -v npu-smi >/dev/null 2>&1; then
  _grpo_npus=$(npu-smi info -m 2>/dev/null \
    | awk '$3 ~ /^[0-9]+$/ && $4 == "Ascend" {ids = ids (ids != "" ? "," : "") $3} END {print ids}') || true
  if [[ -n "$_grpo_npus" ]]; then
    export ASCEND_RT_VISIBLE_DEVICES="$_grpo_npus"
  fi
  unset _grpo_npus
fi
