"""DeepSpeed ZeRO-3 pieces around the recipe's policy engine: LoRA adapters, the reference engine, gathered forwards
and exports. The policy's optimizer, LR schedule and ``deepspeed.initialize`` are in the recipe (build_policy).

The JSON files in ds_configs/ hold sharding, offload and precision; the batch, accumulation and clipping fields
come from the recipe config (one source of truth) and are filled in here. Only the Flux transformer goes through
DeepSpeed: the VAE, text encoders and reward models stay outside, because zero.Init/initialize would partition
(empty) their parameters.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from collections.abc import Iterator
from pathlib import Path

import deepspeed
import torch
from peft import LoraConfig as PeftLoraConfig

from grpo.export import write_transformer
from grpo.inputs import check_lora_targets
from grpo.settings import LoraConfig


def precision(ds: dict) -> torch.dtype:
    """The dtype DeepSpeed keeps the module's (gathered) weights in."""
    if ds.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if ds.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32


def add_lora(transformer: torch.nn.Module, lora: LoraConfig) -> None:
    """Freeze the base and add a PEFT adapter (diffusers' PeftAdapterMixin keeps disable_adapters() available)."""
    check_lora_targets(transformer, lora.target_modules)
    transformer.requires_grad_(False)
    transformer.add_adapter(
        PeftLoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            init_lora_weights=lora.init,
            target_modules=lora.target_modules,
        )
    )


def fetch_whole_blocks(transformer: torch.nn.Module, enabled: bool) -> None:
    """deepspeed.fetch_blocks (`enabled`): ZeRO-3 gathers and releases each FLUX block's weights as one unit
    (DeepSpeed's leaf modules) instead of registering fetch/release hooks on every sub-module. Call before
    deepspeed.initialize.

    DeepSpeed reduces a leaf's gradients from the block's full backward hook, which waits for the gradients of the
    block's positional inputs, and fires at once if none requires one. Then no weight gradient of the block exists
    yet and DeepSpeed fills them with zeros on the released weights (a crash). Two cases do that here: diffusers
    passes the inputs by keyword (the pre-hook below passes them positionally), and in a LoRA run the first block's
    inputs come from frozen layers (the pre-hook makes its hidden states require a gradient, as transformers'
    enable_input_require_grads does for the same reason: one extra input gradient, no change to the others).
    """
    if not enabled:
        return
    from deepspeed.utils import set_z3_leaf_modules

    from grpo.models.blocks import block_classes

    for block in set_z3_leaf_modules(transformer, block_classes(transformer)):
        block.register_forward_pre_hook(_inputs_by_position, with_kwargs=True)


@functools.cache
def _forward_signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.forward)


@torch.compiler.disable  # model.compile: runs before the block's graph, like DeepSpeed's own fetch hook
def _inputs_by_position(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if not torch.is_grad_enabled():  # rollouts, evals, the reference: no backward hook to feed
        return args, kwargs
    bound = _forward_signature(type(module)).bind(module, *args, **kwargs)
    args = bound.args[1:]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not any(t.requires_grad for t in tensors) and any(p.requires_grad for p in module.parameters()):
        args = (args[0].detach().requires_grad_(), *args[1:])  # hidden_states: nothing upstream needs a gradient
    return args, bound.kwargs


def build_reference(transformer: torch.nn.Module, ds: dict):
    """A ZeRO-3 inference engine (no optimizer) for the full fine-tune's frozen reference: each rank keeps a shard."""
    transformer.requires_grad_(False).eval()
    ref_ds = copy.deepcopy(ds)
    ref_ds.pop("gradient_clipping", None)
    engine, *_ = deepspeed.initialize(model=transformer, config=ref_ds)
    engine.eval()
    return engine


@contextlib.contextmanager
def inference_module(engine, gather: bool) -> Iterator[torch.nn.Module]:
    """The engine's module for no-grad forwards (rollouts, reference, eval).

    With `gather`, ZeRO-3's weights are all-gathered once and its fetch hooks removed for the whole block (TRL's
    unwrap-for-generation), so N denoising steps x B micro-batches do not each re-gather every layer. Without it,
    every forward gathers and frees layer by layer (slower, but never a full copy per device: use it when the
    planner, python -m tools.plan, says the gathered weights do not fit). The layer-wise path overlaps the next
    modules' all-gathers with compute as set in the DeepSpeed JSON: stage3_prefetch_bucket_size (elements fetched
    ahead, default 5e7), stage3_max_live_parameters (cap on gathered elements, 1e9) and stage3_max_reuse_distance
    (keep a module gathered if it is reused within that many elements, 1e9); larger values trade memory for
    fewer stalls. ZeRO-3 records the module order on the first forward and prefetches from it afterwards.
    Measured on 2 CPU processes (benchmarks/rollout.py): gathering once was 1.35x faster than layer-wise.
    """
    if gather:
        with deepspeed.zero.unwrap_model_for_generation(engine):
            yield engine.module
    else:
        yield engine.module


def lora_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """Gather the LoRA weights on every rank (collective); return them on rank 0 in PEFT naming, else None."""
    from peft.utils import get_peft_model_state_dict

    lora = [p for n, p in engine.module.named_parameters() if "lora_" in n]
    with deepspeed.zero.GatheredParameters(lora, modifier_rank=None):
        if torch.distributed.get_rank() != 0:
            return None
        return {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(engine.module).items()}


def save_full(engine, out_dir: str | Path) -> None:
    """A transformer folder of the model's own class (config + safetensors shards), gathered shard by shard
    (collective)."""
    state = engine._zero3_consolidated_16bit_state_dict()  # rank 0 gets the tensors, others an empty dict
    if torch.distributed.get_rank() == 0:
        write_transformer(state, type(engine.module).__name__, dict(engine.module.config), out_dir,
                          next(iter(state.values())).dtype)
