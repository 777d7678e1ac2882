"""The transformer's repeated blocks as the trainer uses them, for every family (ModelFamily.blocks): activation
checkpointing of some of them and regional compilation."""

from __future__ import annotations

import torch

from grpo.models.base import ModelFamily


def block_classes(transformer: torch.nn.Module) -> list[type]:
    """The classes of the repeated blocks (ZeRO-3 leaf modules), double-stream first."""
    return list(dict.fromkeys(type(b) for b in ModelFamily.blocks(transformer)))


def checkpointed_blocks(transformer: torch.nn.Module, every: bool | int) -> list[torch.nn.Module]:
    """The transformer blocks whose activations are recomputed: all (True or 1), every k-th (k), none (False/0).

    Blocks are counted double blocks first, then single blocks, and block 0 is always among them (k >= 1).
    """
    k = int(every)
    return [b for i, b in enumerate(ModelFamily.blocks(transformer)) if k > 0 and i % k == 0]


def enable_checkpointing(transformer: torch.nn.Module, every: bool | int) -> None:
    """Activation checkpointing of the update's forward for all blocks (True) or every k-th block (k).

    diffusers calls `_gradient_checkpointing_func(block, *args)` for every block when checkpointing is on; ours
    recomputes the chosen blocks with torch's non-reentrant checkpoint (diffusers' default) and runs the others
    plainly, so k trades memory (~1/k of the blocks' activations kept) for recompute (~1/k of a forward).
    """
    from torch.utils.checkpoint import checkpoint

    chosen = {id(b) for b in checkpointed_blocks(transformer, every)}
    if not chosen:
        return

    def checkpoint_some(block: torch.nn.Module, *args):
        if id(block) in chosen:
            return checkpoint(block.__call__, *args, use_reentrant=False)
        return block(*args)

    transformer.enable_gradient_checkpointing(checkpoint_some)


def compile_blocks(transformer: torch.nn.Module, enabled: bool) -> None:
    """Regional compilation (model.compile): torch.compile every double and single block in place, the way
    diffusers' compile_repeated_blocks does it. Blocks of one class share their compiled code (torch inlines the
    module's parameters as graph inputs), so compile time is that of two blocks, not of the whole model, and the
    model keeps its own forward, hooks (DeepSpeed's gather/release, diffusers' checkpointing) and state_dict names.
    Compilation happens lazily, on the first forward of each shape and grad mode (see compile_seconds)."""
    if enabled:
        transformer.compile_repeated_blocks()


def compile_seconds() -> float:
    """Seconds spent compiling in this process so far (dynamo tracing + inductor codegen), for time/compile_s."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(compilation_time_metrics.get("_compile.compile_inner", ()))
