"""Exponential moving average of the trained weights, kept sharded like ZeRO-3 keeps the weights themselves.

Each rank holds the EMA of its own partition of every trainable parameter, in float32, next to DeepSpeed's fp32
master partition (``deepspeed.utils.safe_get_local_fp32_param``). Nothing is ever gathered to update it, so a full
fine-tune of a 12B model costs 4 bytes per parameter divided by the world size, and a LoRA run only the adapters.

Eval and export swap the EMA values into the ZeRO-3 partitions (``param.ds_tensor``) for the duration of a block
and copy the training values back afterwards; a gathered forward inside the block therefore sees the EMA weights.
The EMA is updated once per GRPO step in which at least one optimizer step was applied.

Export assembles the full tensors offline from the per-rank shards (:func:`assemble`): ZeRO-3 pads a parameter's
flattened elements to a multiple of the world size and gives rank r the r-th equal slice.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import torch
import torch.distributed as dist

PREFIX = "ema/"


def _local_fp32(param: torch.nn.Parameter) -> torch.Tensor:
    from deepspeed.utils import safe_get_local_fp32_param

    return safe_get_local_fp32_param(param).detach()


def _whole(param: torch.nn.Parameter) -> bool:
    """A persistent ZeRO-3 parameter (stage3_param_persistence_threshold) whose whole value is in .data now. The
    status is the same on every rank (same forwards and gathers), so the collectives below stay matched."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return getattr(param, "ds_persist", False) and param.ds_status == ZeroParamStatus.AVAILABLE


def _all_gather(shard: torch.Tensor) -> torch.Tensor:
    """Every rank's equal shard, concatenated in rank order (ZeRO-3's padded flat layout)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    parts = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(parts, shard.contiguous())
    return torch.cat(parts)


class ShardedEMA:
    """EMA of the trainable parameters of a ZeRO-3 engine, one fp32 shard per rank.

    Serves as the eval/export EMA (ema.decay) and as nft/awm's lagging policy (<objective>.lag_*, whose decay grows
    with the optimizer steps): a LoRA run keeps one more copy of the adapters, a full fine-tune one more fp32 shard,
    never a second copy of the base weights.

    Args:
        engine: the DeepSpeed training engine.
        decay: weight of the old average, e.g. 0.99 (update: ema = decay * ema + (1 - decay) * weights).
        prefix: names its tensors and metadata in checkpoints ("ema/", "lag/").
    """

    def __init__(self, engine, decay: float, prefix: str = PREFIX):
        self.decay = decay
        self.prefix = prefix
        self.params = {n: p for n, p in engine.module.named_parameters() if p.requires_grad}
        self.shadow = {n: _local_fp32(p).float().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def update(self, decay: float | None = None) -> None:
        """ema = d * ema + (1 - d) * weights, d = `decay` or the constructor's."""
        d = self.decay if decay is None else decay
        for name, p in self.params.items():
            s = self.shadow[name]
            s.lerp_(_local_fp32(p).to(device=s.device, dtype=torch.float32), 1.0 - d)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Within the block the model's (partitioned) weights are the EMA weights; collective when params persist."""
        saved = {}
        for name, p in self.params.items():
            saved[name] = p.ds_tensor.detach().clone()
            p.ds_tensor.copy_(self.shadow[name].to(p.ds_tensor.dtype))
        # Persistent (small) params keep a whole copy in .data while they are available: after a forward's fetch,
        # not after a GatheredParameters block (unwrap for the rollout), whose exit partitions them too.
        whole = {n: p for n, p in self.params.items() if _whole(p)}
        full_saved = {n: p.data.detach().clone() for n, p in whole.items()}
        for name, p in whole.items():
            p.data.copy_(self._gather_full(name).to(p.dtype))
        try:
            yield
        finally:
            for name, p in self.params.items():
                p.ds_tensor.copy_(saved[name])
            for name, p in self.params.items():
                if name in full_saved and _whole(p):
                    p.data.copy_(full_saved[name])
                elif _whole(p):  # fetched inside the block, from the EMA shards: take the restored shards' values
                    p.data.copy_(_all_gather(p.ds_tensor)[: p.ds_numel].view(p.ds_shape))

    def _gather_full(self, name: str) -> torch.Tensor:
        p = self.params[name]
        return _all_gather(self.shadow[name])[: p.ds_numel].view(p.ds_shape)

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """This rank's shards and the full shapes (safetensors tensors + metadata)."""
        tensors = {self.prefix + n: s.cpu() for n, s in self.shadow.items()}
        shapes = {n: [list(p.ds_shape), int(p.ds_numel)] for n, p in self.params.items()}
        tag = self.prefix.rstrip("/")
        return tensors, {f"{tag}_shapes": json.dumps(shapes), f"{tag}_decay": str(self.decay)}

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """A checkpoint's part (grpo.checkpoint.Stateful): this rank's shards."""
        return self.state()

    def load_state_dict(self, saved) -> None:
        """From a checkpoint (grpo.checkpoint.Saved): this rank's shards, or re-cut from every writer's when it was
        written by another number of processes."""
        if saved.resharded:
            self.load_resharded(saved.files)
        else:
            self.load(saved.tensors)

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, s in self.shadow.items():
            s.copy_(tensors[self.prefix + name])

    def load_resharded(self, rank_files: list) -> None:
        """Load from the rank files of a checkpoint written by another number of processes (rank order).

        This rank's shard is the elements [rank * n, rank * n + n) of the flattened parameter (n = its shard length
        here; padding past the parameter's end is zero); each writer's shard covers [q * m, q * m + m) in the same
        way, so only the overlapping pieces are read (safetensors slices): no rank holds a full copy."""
        from safetensors import safe_open

        rank = dist.get_rank() if dist.is_initialized() else 0
        with contextlib.ExitStack() as stack:
            files = [stack.enter_context(safe_open(str(f), framework="pt")) for f in rank_files]
            for name, s in self.shadow.items():
                numel, n = int(self.params[name].ds_numel), s.numel()
                out = torch.zeros(n, dtype=torch.float32)
                start, end = rank * n, min(rank * n + n, numel)
                for q, f in enumerate(files):
                    piece = f.get_slice(self.prefix + name)
                    m = piece.get_shape()[0]
                    lo, hi = max(start, q * m), min(end, q * m + m)
                    if lo < hi:
                        out[lo - start:hi - start] = piece[lo - q * m:hi - q * m].float()
                s.copy_(out.to(s.device))


def assemble(rank_tensors: list[dict[str, torch.Tensor]], shapes: dict[str, list]) -> dict[str, torch.Tensor]:
    """Full EMA tensors from every rank's shards (rank order), without any process group.

    Args:
        rank_tensors: per rank, its safetensors content ({"ema/<name>": flat shard}).
        shapes: {name: [shape, numel]} as written by :meth:`ShardedEMA.state`.

    Returns:
        {name: float32 tensor of the parameter's shape}.
    """
    out = {}
    for name, (shape, numel) in shapes.items():
        flat = torch.cat([t[PREFIX + name].float().reshape(-1) for t in rank_tensors])
        out[name] = flat[:numel].reshape(shape).clone()
    return out
