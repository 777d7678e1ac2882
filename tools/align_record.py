"""The recording side of tools.align: one GRPO step of the recipe with hooks on the transformer's blocks.

Runs inside each process of a side (``python -m tools.align ... --worker OUT``, under torchrun for N processes);
rank 0 writes the dump (tools.align_report.save_dump).
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from grpo.step import Chunk
from tools._recipe import RECIPE_PATH, recipe_session
from tools.align_report import FORMAT_VERSION, AlignError, save_dump

logger = logging.getLogger(__name__)

# Modules of a FLUX transformer whose outputs are recorded, in the order they run; those a family lacks are skipped
# (FLUX.1: time_text_embed; FLUX.2: time_guidance_embed and the shared modulations of its double and single blocks).
EMBEDDERS = ("time_text_embed", "time_guidance_embed", "double_stream_modulation_img", "double_stream_modulation_txt",
             "single_stream_modulation", "context_embedder", "x_embedder", "pos_embed")
HEADS = ("norm_out", "proj_out")
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")



class BlockRecorder:
    """Forward hooks that keep the outputs of the transformer's blocks for chosen calls of its forward.

    The rollout calls the transformer once per denoising step and micro-batch, micro-batch after micro-batch, so
    call ``c`` is denoising step ``c % num_steps`` of micro-batch ``c // num_steps``. Only micro-batch 0 is recorded.
    Outputs are kept in their own dtype, on the CPU; tuple outputs (the blocks return text and image streams) are
    kept element by element.

    Args:
        model: The FLUX transformer (e.g. ``engine.module``; PEFT-injected LoRA keeps the module names).
        steps: Denoising steps to record, in [0, num_steps).
        num_steps: Transformer calls per micro-batch in the rollout.
        enabled: False on ranks that record nothing (the hooks are still cheap no-ops there).
    """

    def __init__(self, model: torch.nn.Module, steps: Sequence[int], num_steps: int, enabled: bool = True):
        self.model = model
        self.steps = sorted(set(steps))
        self.num_steps = num_steps
        self.enabled = enabled
        self.modules = recorded_modules(model)
        self.outputs: dict[str, torch.Tensor] = {}
        self._calls = -1
        self._active = False
        self._handles: list[Any] = []

    def __enter__(self) -> BlockRecorder:
        self._handles.append(self.model.register_forward_pre_hook(self._count))
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Records during the block it wraps (the rollout), counting transformer calls from its start."""
        self._calls, self._active = -1, True
        try:
            yield
        finally:
            self._active = False

    def _count(self, module: torch.nn.Module, args: tuple) -> None:
        self._calls += 1

    def _recording(self) -> int | None:
        """The denoising step being recorded, or None."""
        if not (self.enabled and self._active) or self._calls >= self.num_steps:
            return None
        return self._calls if self._calls in self.steps else None

    def _hook(self, name: str):
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            step = self._recording()
            if step is None:
                return
            for j, tensor in enumerate(_flat(output)):
                self.outputs[block_key(step, name, j)] = tensor.detach().to("cpu", copy=True).contiguous()

        return hook


def _flat(output: Any) -> Iterator[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _flat(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _flat(item)


def recorded_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The embedders, every block and the output head of a FLUX.1 or FLUX.2 transformer, in execution order."""
    found = dict(model.named_modules())
    names = [n for n in EMBEDDERS if n in found]
    for blocks in BLOCK_LISTS:
        count = len(found[blocks]) if blocks in found else 0
        names += [f"{blocks}.{i}" for i in range(count)]
    names += [n for n in HEADS if n in found]
    if not any(n.startswith(BLOCK_LISTS) for n in names):
        raise AlignError(f"{type(model).__name__} has no transformer_blocks/single_transformer_blocks to record")
    return {n: found[n] for n in names}


def block_key(step: int, module: str, index: int) -> str:
    return f"block/{step:04d}/{module}/{index}"


def parse_record_steps(spec: str, num_steps: int) -> list[int]:
    """``"0,-1"`` -> [0, num_steps-1]; ``"all"`` -> every step. Negative indices count from the end."""
    from grpo.errors import ConfigError

    if spec.strip() == "all":
        return list(range(num_steps))
    try:
        raw = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--record-steps: {spec!r}; give step indices such as 0,-1 or all") from None
    if not raw or any(not -num_steps <= s < num_steps for s in raw):
        raise ConfigError(f"--record-steps: {spec!r} is outside the {num_steps} denoising steps; use 0..{num_steps - 1}")
    return sorted({s % num_steps for s in raw})


def _trainable(engine, max_numel: int, keep: bool) -> dict[str, torch.Tensor] | None:
    """The trainable weights, gathered from their ZeRO-3 shards (collective; every rank must call it).

    Returns:
        name -> weight on the CPU where ``keep`` ({} elsewhere), or None on every rank when more than ``max_numel``
        weights train.
    """
    import deepspeed

    params = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    if sum(getattr(p, "ds_numel", p.numel()) for _, p in params) > max_numel:
        return None
    out = {}
    for name, p in params:  # one at a time: never more than one gathered weight besides what is kept
        with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
            if keep:
                out[name] = p.detach().to("cpu", copy=True).contiguous()
    return out


def _gather_samples(chunks: list[Chunk], key: str, count: int) -> torch.Tensor:
    """Per-sample tensors of every rank's chunks -> [count, ...] in global sample order (samples >= count dropped)."""
    from grpo.distributed import gather_by_index

    local = torch.cat([key_of(c, key) for c in chunks])
    ids = torch.tensor([i for c in chunks for i in c.ids], dtype=torch.long, device=local.device)
    keep = ids < count
    rows = gather_by_index(local[keep].float().reshape(int(keep.sum()), -1), ids[keep], count)
    return rows.reshape(count, *local.shape[1:]).cpu()


def key_of(chunk: Chunk, key: str) -> torch.Tensor:
    if key == "images":
        return chunk.images
    return {"latents": chunk.traj.latents, "log_probs": chunk.traj.log_probs, "x0": chunk.traj.x0}[key]


def _nothing() -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def model_fingerprint(model_path: str | Path, chunk: int = 1 << 22) -> str:
    """A cheap identity of the transformer's weights: sha256 over each weight file's name, size, head and tail.

    Two sides that loaded different weights (a rebuilt tiny model, another FLUX revision) compare the weights, not the
    numerics; the comparison flags it. Reading 8 MB per file keeps this instant for FLUX.1-dev's 24 GB.
    """
    import hashlib

    digest = hashlib.sha256()
    for f in sorted((Path(model_path) / "transformer").glob("*.safetensors")):
        size = f.stat().st_size
        digest.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            digest.update(fh.read(chunk))
            fh.seek(max(size - chunk, 0))
            digest.update(fh.read(chunk))
    return digest.hexdigest()[:16]


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("torch", "torch_npu", "deepspeed", "diffusers", "peft"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[pkg] = md.version(pkg)
    return out


def _device_name(device: torch.device) -> str:
    with contextlib.suppress(Exception):
        if device.type in ("cuda", "npu"):
            return str(getattr(torch, device.type).get_device_name(device))
    return platform.processor() or platform.machine()


def record(config: str, overrides: Sequence[str], out: str | Path, record_steps: str = "0,-1",
           samples: int | None = None, max_weights: int = 50_000_000, recipe_path: str | Path = RECIPE_PATH) -> None:
    """Runs one side (this process is one rank of it) and writes its dump on rank 0.

    Args:
        config: YAML preset.
        overrides: Dotted config overrides.
        out: The safetensors file to write.
        record_steps: Denoising steps whose block outputs are recorded (``"0,-1"``, ``"all"``, ``"0,3,7"``).
        samples: Record the step's first ``samples`` global samples (trajectories, images); None = all.
        max_weights: Skip the weight comparison when more weights than this train (a full FLUX.1-dev fine-tune).
        recipe_path: The recipe script.
    """
    import torch.distributed as dist

    from grpo.config import to_dict
    from grpo.errors import ConfigError

    with recipe_session(config, overrides, recipe_path) as recipe:
        cfg = recipe.cfg
        steps = parse_record_steps(record_steps, cfg.sampling.num_steps)
        total = recipe.layout.samples_per_step
        count = total if samples is None else min(samples, total)
        if count < 1:
            raise ConfigError(f"--samples: {samples}; record at least 1 sample")
        first_chunk = recipe.layout.rank_sample_ids(0)[: recipe.layout.micro_batch_size]
        recorder = BlockRecorder(recipe.engine.module, steps, cfg.sampling.num_steps, enabled=recipe.rank == 0)
        before = _trainable(recipe.engine, max_weights, keep=recipe.rank == 0)
        with recorder:
            t0 = time.perf_counter()
            result = recipe.step(0, lambda phase: recorder.capture() if phase == "rollout" else _nothing())
            seconds = time.perf_counter() - t0
        after = _trainable(recipe.engine, max_weights, keep=recipe.rank == 0)
        chunks = result.chunks
        tensors = {key: _gather_samples(chunks, key, count) for key in ("latents", "x0", "log_probs", "images")}
        tensors["rewards"] = result.rewards.float().cpu()
        tensors["advantages"] = result.advantages.float().cpu()
        if before is not None and after is not None:
            tensors.update({f"weight_before/{n}": t for n, t in before.items()})
            tensors.update({f"weight_after/{n}": t for n, t in after.items()})
        tensors.update(recorder.outputs)
        meta = {
            "format": FORMAT_VERSION,
            "overrides": list(overrides),
            "config": to_dict(cfg),
            "world_size": recipe.world,
            "device": str(recipe.device),
            "device_name": _device_name(recipe.device),
            "accelerator": recipe.device.type,
            "dtype": str(recipe.dtype).replace("torch.", ""),
            "attention_backend": cfg.model.attention_backend,
            "model_fingerprint": model_fingerprint(recipe.model_path),
            "record_steps": steps,
            "block_samples": first_chunk,
            "modules": list(recorder.modules),
            "num_samples": count,
            "samples_per_step": total,
            "stats": {k: float(v) for k, v in result.stats.items()},
            "weights": "recorded" if before is not None else f"skipped (more than {max_weights} trainable weights)",
            "step_seconds": seconds,
            "host": platform.node(),
            "versions": _versions(),
            "env": {k: os.environ[k] for k in ("DS_ACCELERATOR", "OMP_NUM_THREADS") if k in os.environ},
        }
        if recipe.rank == 0:
            save_dump(out, tensors, meta)
        dist.barrier()


