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
# (ImportError "... Please run 'source set_env.sh' in the CANN installation path"). Looked for, first found wins:
# $ASCEND_TOOLKIT_HOME and $ASCEND_HOME_PATH (each itself or its parent: they may point at .../ascend-toolkit/latest,
# whose set_env.sh sits one level up on CANN < 8.5), then under the install root (GRPO_ASCEND_ROOT, default
# /usr/local/Ascend): ascend-toolkit/latest, ascend-toolkit, cann (CANN >= 8.5's link, as MindSpeed-MM's scripts use)
# and the newest cann-X.Y.Z folder (CANN >= 8.5 installs side by side, e.g. cann-8.5.0 and cann-9.1.0).
_grpo_ascend_root=${GRPO_ASCEND_ROOT:-/usr/local/Ascend}
_grpo_cann_env=""
for _grpo_dir in "${ASCEND_TOOLKIT_HOME:-}" "${ASCEND_HOME_PATH:-}" "$_grpo_ascend_root/ascend-toolkit/latest" \
                 "$_grpo_ascend_root/ascend-toolkit" "$_grpo_ascend_root/cann" \
                 "$(ls -d "$_grpo_ascend_root"/cann-* 2>/dev/null | sort -V | tail -n 1)"; do
  [[ -n "$_grpo_dir" ]] || continue
  if [[ -f "$_grpo_dir/set_env.sh" ]]; then
    _grpo_cann_env="$_grpo_dir/set_env.sh"
  elif [[ -f "$_grpo_dir/../set_env.sh" ]]; then
    _grpo_cann_env="$_grpo_dir/../set_env.sh"
  fi
  [[ -z "$_grpo_cann_env" ]] || break
done
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
  echo "[npu_env] CANN set_env.sh not found (set ASCEND_HOME_PATH or GRPO_ASCEND_ROOT); torch_npu will not import" >&2
fi
unset _grpo_cann_env _grpo_dir _grpo_ascend_root

# Seconds HCCL waits to set up links between ranks (default 120). Model loading on rank 0 and JIT op compilation
# skew the ranks' arrival at the first collective by minutes on big models; MindSpeed-MM and verl use 1200.
: "${HCCL_CONNECT_TIMEOUT:=1200}"
export HCCL_CONNECT_TIMEOUT

# MB of HCCL buffer per communicator, allocated twice (send + recv); default 200. ZeRO-3 all-gathers whole FLUX
# blocks (~340 MB in bf16 for a double-stream block), and a buffer smaller than a message splits it into rounds.
: "${HCCL_BUFFSIZE:=800}"
export HCCL_BUFFSIZE

# Caching allocator with virtual-memory segments: less fragmentation from the changing shapes of rollout (no grad)
# and training (grad) steps. Exactly one allocator variable is exported: setting both PYTORCH_NPU_ALLOC_CONF and
# PYTORCH_ALLOC_CONF is an error on newer torch_npu. The one you exported wins; if you exported both, PYTORCH_ALLOC_CONF
# is dropped. By default PYTORCH_NPU_ALLOC_CONF, the variable torch_npu documents
# (torch_npu docs/zh/api/environment_variable/PYTORCH_NPU_ALLOC_CONF.md) and that torch_npu 2.12 reads.
if [[ -n "${PYTORCH_NPU_ALLOC_CONF:-}" && -n "${PYTORCH_ALLOC_CONF:-}" ]]; then
  echo "[npu_env] both PYTORCH_NPU_ALLOC_CONF and PYTORCH_ALLOC_CONF are set; unsetting PYTORCH_ALLOC_CONF" >&2
  unset PYTORCH_ALLOC_CONF
elif [[ -z "${PYTORCH_ALLOC_CONF:-}" ]]; then
  : "${PYTORCH_NPU_ALLOC_CONF:=expandable_segments:True}"
  export PYTORCH_NPU_ALLOC_CONF
fi

# Operator dispatch pipeline of torch_npu: 0 off, 1 two-stage queue, 2 also balances work across host threads
# (fewer host-side stalls between small kernels). MindSpeed-MM's FLUX DanceGRPO script uses 2.
: "${TASK_QUEUE_ENABLE:=2}"
export TASK_QUEUE_ENABLE

# Bind each rank's host threads to the CPU cores near its NPU: 1 coarse binding, 2 finer (main/ACL/release threads
# on separate cores). Without it ranks compete for cores and launch kernels late.
: "${CPU_AFFINITY_CONF:=1}"
export CPU_AFFINITY_CONF

# Alignment runs (tools.align, comparing NPU with CPU/GPU or 1 with N processes): GRPO_ALIGNMENT_RUN=1 also makes
# HCCL reduce in a fixed order (HCCL_DETERMINISTIC=true), so that gradients and all-reduced metrics repeat bit for bit.
# Off otherwise: it slows all-reduce/reduce-scatter, and the first-pass ratio does not need it (model.deterministic
# covers the kernels; ZeRO-3's all-gathers move weights without arithmetic). An HCCL_DETERMINISTIC you set is kept.
if [[ "${GRPO_ALIGNMENT_RUN:-0}" == 1 ]]; then
  : "${HCCL_DETERMINISTIC:=true}"
  export HCCL_DETERMINISTIC
fi

# Which chips this job may use (ASCEND_RT_VISIBLE_DEVICES, the NPU's CUDA_VISIBLE_DEVICES) is left to the runtime
# (every chip of the container) or to you / the scheduler: set it before sourcing. It is not derived from
# `npu-smi`, whose ids are host ids inside a container that sees a subset of the chips, which made `set_device` fail.
