"""Every RNG state of a rank (Python, NumPy, torch CPU, the accelerator's) as safetensors-ready tensors and metadata,
and back: what a checkpoint needs besides DeepSpeed's state for a resumed run to draw exactly what it would have."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import numpy as np
import torch

from grpo import device as dev

RngState = tuple[dict[str, torch.Tensor], dict[str, str]]  # safetensors' tensors and metadata


def rng_state(device_rng: Callable[[], torch.Tensor] | None) -> RngState:
    """Python, NumPy, torch (CPU) and accelerator RNG states as tensors + string metadata (safetensors-ready)."""
    version, py_state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors = {
        "rng/python": torch.tensor(py_state, dtype=torch.int64),
        "rng/numpy": torch.from_numpy(keys.astype(np.int64)),
        "rng/torch": torch.get_rng_state(),
    }
    if device_rng is not None:
        tensors["rng/device"] = device_rng().cpu()
    meta = {"python": json.dumps([version, gauss]), "numpy": json.dumps([kind, int(pos), int(has_gauss), cached])}
    return tensors, meta


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, str],
                  set_device_rng: Callable[[torch.Tensor], None] | None) -> None:
    version, gauss = json.loads(meta["python"])
    random.setstate((version, tuple(tensors["rng/python"].tolist()), gauss))
    kind, pos, has_gauss, cached = json.loads(meta["numpy"])
    np.random.set_state((kind, tensors["rng/numpy"].numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["rng/torch"])
    if set_device_rng is not None and "rng/device" in tensors:
        set_device_rng(tensors["rng/device"])


def device_rng():
    """(get, set) of the accelerator's RNG state; (None, None) on the CPU accelerator (torch's CPU RNG is saved)."""
    acc = dev.accelerator()
    if acc.device_name() == "cpu":  # the CPU accelerator's RNG is torch's CPU RNG, saved already
        return None, None
    return acc.get_rng_state, acc.set_rng_state


def snapshot() -> RngState:
    """This rank's RNG state now, as a checkpoint stores it."""
    return rng_state(device_rng()[0])
