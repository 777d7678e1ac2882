"""The device layer: one place that knows about NPU, CUDA and CPU.

Everything device-specific in the repository goes through this module, which in turn goes through DeepSpeed's
accelerator abstraction (``deepspeed.accelerator.get_accelerator()``): the device of a rank, the communication backend
(HCCL on Ascend NPU, NCCL on CUDA, gloo on CPU), the RNG of the device, the bf16/fp16 support
check and diffusers' attention backend.

Order matters:

* ``DS_ACCELERATOR`` (``npu``, ``cuda`` or ``cpu``) overrides DeepSpeed's auto-detection, but DeepSpeed reads it once,
  when ``import deepspeed`` runs (``deepspeed/runtime/utils.py`` calls ``get_accelerator()`` at import time). Set it
  in the environment before anything imports deepspeed. This module imports deepspeed lazily, so setting the variable
  after ``import grpo.device`` but before the first call of :func:`accelerator` is fine; :func:`accelerator` raises if
  it finds DeepSpeed already bound to a different accelerator.
* ``torch_npu`` is imported only where it is installed, and never with ``transfer_to_npu`` (that module rewrites
  ``torch.cuda`` and ``'cuda'`` strings process-wide; code here never names a device type, so it is not needed).
  DeepSpeed's auto-detection catches only ``ImportError`` and then silently falls back to CPU, so a torch_npu without
  CANN would train on the CPU without a word; :func:`import_torch_npu` turns that into a one-line error instead.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import random
import socket
import sys
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

try:
    import torch
except RuntimeError as _err:  # torch >= 2.5 auto-loads torch_npu through an entry point and fails with it
    if "torch_npu" in str(_err):
        raise RuntimeError(
            "import torch failed while auto-loading torch_npu: source CANN's set_env.sh "
            "(e.g. `source /usr/local/Ascend/ascend-toolkit/set_env.sh`) or install the torch_npu build that pairs "
            "with this torch; TORCH_DEVICE_BACKEND_AUTOLOAD=0 skips torch_npu entirely"
        ) from _err
    raise

import numpy as np

from grpo.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = [
    "DistInfo",
    "accelerator",
    "check_dtype_supported",
    "device_for_local_rank",
    "free_port",
    "import_torch_npu",
    "init_distributed",
    "is_npu",
    "local_devices",
    "resolve_dtype",
    "seed_everything",
    "set_attention_backend",
    "set_deterministic",
]

# Accepted spellings of the three compute dtypes; the config uses the short names.
_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# The device of "accelerator" tensors on the CPU accelerator. tools.npu_audit swaps in torch.device("cpu", 0)
# (same memory and kernels) so that its dispatch mode can tell device tensors from host ones
# (tools/npu_audit.py: emulate_device_on_cpu).
_cpu_accelerator_device = torch.device("cpu")

# The attention backends the device layer knows something about; any other name diffusers knows is passed through.
_NPU_ONLY_BACKENDS = frozenset({"_native_npu"})

_CANN_HINT = (
    "source CANN's set_env.sh (e.g. `source /usr/local/Ascend/ascend-toolkit/set_env.sh`, or launch/npu_env.sh), "
    "or install the torch_npu build that pairs with torch {torch} (same X.Y.Z, CPU build of torch); "
    "a CPU/CUDA-only environment should not have torch_npu installed"
)


def _one_line(text: str, limit: int = 300) -> str:
    """Collapses a multi-line error message into one line of at most ``limit`` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def import_torch_npu() -> bool:
    """Imports torch_npu if, and only if, it is installed.

    Returns:
        True when torch_npu is installed and imported (the NPU backend is registered with torch), False when it is not
        installed.

    Raises:
        RuntimeError: torch_npu is installed but cannot be imported: CANN's ``set_env.sh`` was not sourced
            (``ImportError: libhccl.so: cannot open shared object file``), torch and torch_npu versions do not pair,
            or a CUDA build of torch is installed next to it ("Two accelerators cannot be used at the same time").
            The message is one line and names the fix.
    """
    if "torch_npu" in sys.modules:
        return True
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        importlib.import_module("torch_npu")
    except (ImportError, OSError, RuntimeError) as err:
        # The hint is on the last line of the report, the raw cause is chained above it.
        raise RuntimeError(
            f"torch_npu is installed but failed to import ({type(err).__name__}: {_one_line(err)}); "
            + _CANN_HINT.format(torch=torch.__version__)
        ) from err
    return True


def accelerator() -> Any:
    """Returns DeepSpeed's accelerator object for this process (NPU, CUDA or CPU).

    torch_npu is imported first (see :func:`import_torch_npu`) unless ``DS_ACCELERATOR`` names another accelerator,
    so that DeepSpeed's auto-detection sees it and a broken install fails loudly instead of falling back to CPU.

    Returns:
        A ``deepspeed.accelerator.abstract_accelerator.DeepSpeedAccelerator``.

    Raises:
        RuntimeError: torch_npu is broken, or ``DS_ACCELERATOR`` disagrees with the accelerator DeepSpeed already chose
            (the variable was set after ``import deepspeed``).
    """
    requested = os.environ.get("DS_ACCELERATOR", "").strip().lower()
    if requested in ("", "npu"):
        import_torch_npu()
    from deepspeed.accelerator import get_accelerator  # lazy: DS_ACCELERATOR is read at deepspeed import time

    acc = get_accelerator()
    chosen = acc.device_name()
    if requested and chosen != requested:
        raise RuntimeError(
            f"DS_ACCELERATOR={requested} but DeepSpeed already chose '{chosen}': set DS_ACCELERATOR in the environment "
            "before anything imports deepspeed"
        )
    return acc


def is_npu() -> bool:
    """True when the process runs on Ascend NPU."""
    return accelerator().device_name() == "npu"


def fused_adamw(setting: bool | None) -> bool:
    """Whether AdamW runs torch's fused kernel (``optim.fused``; null = where torch ships it for sure).

    On the flat fp32 partition ZeRO-3 hands the optimizer, the unfused step allocates a dozen partition-sized
    temporaries (sqrt, div, ...): ~0.5 s of a ~10 s full fine-tune iteration on the CPU (benchmarks/RESULTS.md).
    Fused and unfused steps differ in the last bit of a weight, so the choice is the same on every rank.
    """
    if setting is not None:
        return setting
    return accelerator().device_name() in ("cpu", "cuda")


def local_devices() -> tuple[str, int]:
    """The accelerator kind of this machine and how many of its devices this process can see.

    For launch scripts (``launch/run.sh`` reads ``python -c "from grpo.device import local_devices;
    print(*local_devices())"``). DeepSpeed logs its import-time accelerator warning to stdout; it is sent to stderr
    here so stdout carries only the answer.

    Returns:
        ``(kind, count)``: kind is ``"npu"``, ``"cuda"`` or ``"cpu"``; count is the number of visible chips (it honours
        ``ASCEND_RT_VISIBLE_DEVICES`` / ``CUDA_VISIBLE_DEVICES``; 0 when torch_npu is installed on a host without
        chips), and 1 for the CPU.
    """
    with contextlib.redirect_stdout(sys.stderr):
        acc = accelerator()
        kind = acc.device_name()
        count = 1 if kind == "cpu" else int(acc.device_count())
    return kind, count


def device_for_local_rank(local_rank: int) -> torch.device:
    """The torch device of a local rank: ``npu:i`` / ``cuda:i``, or ``cpu`` (CPU accelerator's ``device()`` is None).

    Args:
        local_rank: Index of the process on its node.

    Returns:
        The device for that rank's tensors.
    """
    acc = accelerator()
    if acc.device_name() == "cpu":
        return _cpu_accelerator_device
    return torch.device(acc.device_name(local_rank))


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job.

    Attributes:
        rank: Global rank, 0..world_size-1.
        world_size: Number of processes.
        local_rank: Rank on this node; selects the device.
        device: The torch device of this rank (``npu:i``, ``cuda:i`` or ``cpu``).
        backend: The torch.distributed backend (``hccl``, ``nccl``, ``gloo`` or ``ccl``).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def free_port() -> int:
    """A TCP port that is free on localhost right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _fill_single_process_env() -> None:
    """Makes ``python recipe.py`` (no launcher) a valid 1-process job.

    Without all five variables ``deepspeed.init_distributed`` tries MPI discovery (mpi4py). A launcher (torchrun,
    ``deepspeed``) sets them all; a partial set with WORLD_SIZE > 1 is a launch error, not something to guess.
    """
    needed = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    world_size = os.environ.get("WORLD_SIZE")
    if world_size is not None and int(world_size) > 1:
        missing = [name for name in needed if name not in os.environ]
        if missing:
            raise RuntimeError(
                f"WORLD_SIZE={world_size} but {', '.join(missing)} unset: "
                "launch with torchrun or the deepspeed launcher"
            )
        return
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    # The CPU accelerator counts devices from LOCAL_SIZE (else NUMA nodes via numactl).
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))


# DeepSpeed 0.19 still calls the collectives torch 2.14 renamed, and torch warns on its calls again and again (84
# lines in the default run). Silenced by message and by the module torch attributes them to (the code here calls
# neither), so every other deprecation still shows.
_DEEPSPEED_DEPRECATIONS = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


def quiet_deepspeed_deprecations() -> None:
    """Hides torch.distributed's FutureWarnings for the collectives DeepSpeed calls under their old names."""
    warnings.filterwarnings("ignore", message=_DEEPSPEED_DEPRECATIONS, category=FutureWarning,
                            module=r"torch\.distributed\.c10d_logger")


def init_distributed(timeout_s: float = 1800) -> DistInfo:
    """Initialises torch.distributed through DeepSpeed with the accelerator's backend.

    Works under torchrun / the deepspeed launcher and as a plain single process (the env defaults are filled in, with
    a free MASTER_PORT). The device is set from LOCAL_RANK before the process group exists, so HCCL/NCCL bind each
    rank to its own chip. Calling it again returns the same information without re-initialising.

    Args:
        timeout_s: Collective timeout in seconds (``HCCL_EXEC_TIMEOUT`` bounds it from the HCCL side on NPU).

    Returns:
        The rank, world size, local rank, device and backend of this process.
    """
    _fill_single_process_env()
    quiet_deepspeed_deprecations()
    acc = accelerator()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = device_for_local_rank(local_rank)
    if device.type != "cpu":
        acc.set_device(local_rank)
    backend = acc.communication_backend_name()

    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():
        deepspeed.init_distributed(
            dist_backend=backend, timeout=timedelta(seconds=timeout_s), auto_mpi_discovery=False, verbose=False
        )
        release_shm_buffer_name()
    info = DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        backend=dist.get_backend(),
    )
    logger.info("distributed: %s", info)
    return info


def shm_buffer_path(rank: int) -> Path:
    """Where DeepSpeed's CPU accelerator puts rank `rank`'s shared-memory all-reduce buffer (its csrc/cpu/comm/shm.cpp
    `shm_initialize`: "deepspeed_allreduce_buffer_{uid}_{MASTER_ADDR}_{MASTER_PORT}_{rank}" under /dev/shm)."""
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR')}_{os.environ.get('MASTER_PORT')}"
    return Path("/dev/shm") / f"{name}_{rank}"


def release_shm_buffer_name() -> None:
    """Unlink this rank's DeepSpeed shared-memory buffer name once every rank has mapped its peers' buffers.

    DeepSpeed 0.19's CPU accelerator creates a 64 MiB POSIX shared-memory buffer per rank when the process group
    starts and never unlinks it (its `shared_close` is never called), so every run leaves 64 MiB per rank in
    /dev/shm, which is RAM: a few hundred short runs filled 16 GiB of a 24 GiB host. Every rank maps its peers'
    buffers inside `init_distributed` (it waits for their names), so after a barrier the names are no longer needed;
    the mappings stay valid until the processes exit, even by kill -9, and then the memory is freed. No file: another
    accelerator, or not all ranks on one node (DeepSpeed then uses no shared memory).
    """
    import torch.distributed as dist

    path = shm_buffer_path(dist.get_rank())
    if not path.exists():
        return
    dist.barrier()
    path.unlink(missing_ok=True)


def seed_everything(seed: int) -> None:
    """Seeds Python's ``random``, NumPy, torch's CPU generator and every generator of the accelerator.

    Args:
        seed: The seed; callers offset it by rank where ranks must differ.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    accelerator().manual_seed_all(seed)


def set_deterministic(enabled: bool) -> bool:
    """Deterministic kernels on NPU and CUDA (``model.deterministic``), for the first pass's ratio = 1 promise.

    The update's first pass recomputes the rollout's log-probs; it reproduces them only if every kernel gives the same
    bits run to run. Ascend (atomic-add reductions, split-K matmuls) and CUDA kernels do not by default. This calls
    ``torch.use_deterministic_algorithms(True, warn_only=True)``: torch_npu maps it onto CANN's deterministic mode
    (aclnn ops), CUDA onto deterministic cuBLAS/cuDNN/scatter kernels (``CUBLAS_WORKSPACE_CONFIG=:4096:8`` is set
    unless already given, as cuBLAS requires); an op without a deterministic kernel warns instead of failing.
    Collectives are another matter: HCCL reduces in a fixed order only with ``HCCL_DETERMINISTIC=true``, which
    ``launch/npu_env.sh`` exports for alignment runs (``GRPO_ALIGNMENT_RUN=1``); it slows all-reduce and
    reduce-scatter, and the ratio does not depend on it (the first pass and the rollout use the same gathered weights).

    On the CPU nothing is changed: its kernels are already run-to-run exact here, and the switch would only risk other
    kernels (and other numbers) than the default run's.

    Args:
        enabled: The setting; False leaves torch's defaults.

    Returns:
        True when deterministic algorithms were switched on.
    """
    if not enabled or accelerator().device_name() == "cpu":
        return False
    if accelerator().device_name() == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    return True


def resolve_dtype(name: str) -> torch.dtype:
    """Maps a config dtype name to a torch dtype.

    Args:
        name: ``"fp32"``, ``"bf16"`` or ``"fp16"``.

    Returns:
        The torch dtype.

    Raises:
        ConfigError: Any other name.
    """
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"dtype: unknown dtype {name!r}; use one of {', '.join(_DTYPES)}") from None


def check_dtype_supported(dtype: torch.dtype, setting: str = "dtype") -> None:
    """Fails early when the accelerator cannot compute in ``dtype``.

    Args:
        dtype: The compute dtype.
        setting: The config key to name in the error.

    Raises:
        ConfigError: bf16 on a chip without bf16 (e.g. pre-A2 Ascend), fp16 on a CPU without AMX-FP16, or a dtype
            outside fp32/bf16/fp16.
    """
    acc = accelerator()
    if dtype == torch.float32:
        return
    if dtype == torch.bfloat16:
        ok = acc.is_bf16_supported()
    elif dtype == torch.float16:
        ok = acc.is_fp16_supported()
    else:
        raise ConfigError(f"{setting}: {dtype} is not a compute dtype; use one of {', '.join(_DTYPES)}")
    if not ok:
        raise ConfigError(
            f"{setting}: {dtype} is not supported by the {acc.device_name()} accelerator; use fp32 or bf16"
        )


def _top_level_diffusers_models(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost diffusers ``ModelMixin`` modules inside ``module`` (itself included), e.g. under a DS engine."""
    from diffusers.models.modeling_utils import ModelMixin

    found: list[torch.nn.Module] = []
    inside: set[int] = set()
    for sub in module.modules():  # pre-order: parents come before their children
        if id(sub) in inside:
            continue
        if isinstance(sub, ModelMixin):
            found.append(sub)
            inside.update(id(m) for m in sub.modules())
    return found


def set_attention_backend(module: torch.nn.Module, name: str | None) -> str:
    """Selects diffusers' attention backend for every diffusers model inside ``module``.

    Args:
        module: A diffusers model (e.g. ``FluxTransformer2DModel``) or any module that wraps one (PEFT, DeepSpeed
            engine).
        name: A diffusers ``AttentionBackendName`` value. ``None`` or ``"native"``: torch SDPA (the default).
            ``"_native_npu"``: ``torch_npu.npu_fusion_attention`` (NPU only). ``"flash"``, ``"sage"``, ... need their
            package installed; diffusers checks that the kernel imports. flash-attn is never required.

    Returns:
        The backend name now in effect.

    Raises:
        ConfigError: Unknown name (the message lists the valid ones), an NPU backend off NPU, a backend whose kernel
            package is missing, or no diffusers model inside ``module``.
    """
    from diffusers.models.attention_dispatch import AttentionBackendName

    backend = "native" if name is None else str(name).lower()
    valid = [member.value for member in AttentionBackendName]
    if backend not in valid:
        raise ConfigError(f"attention_backend: unknown backend {name!r}; use one of {', '.join(valid)}")
    if backend in _NPU_ONLY_BACKENDS and not is_npu():
        raise ConfigError(
            f"attention_backend: {backend!r} runs torch_npu.npu_fusion_attention and needs an Ascend NPU, but this "
            f"process runs on {accelerator().device_name()}; use 'native'"
        )
    models = _top_level_diffusers_models(module)
    if not models:
        raise ConfigError(f"attention_backend: no diffusers model inside {type(module).__name__}; pass the transformer")
    for model in models:
        try:
            model.set_attention_backend(backend)
        except (RuntimeError, ImportError) as err:  # diffusers: kernel package missing or too old
            raise ConfigError(
                f"attention_backend: {backend!r} is not usable here ({_one_line(err)}); use 'native'"
            ) from err
    return backend
