"""Driver for the distributed recipe tests: one GRPO step of the real recipe, then a dump of what tests compare.

Run under torchrun: python tests/recipe/one_step.py OUT.pt --config CONFIG [key=value ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from grpo.config import load_config  # noqa: E402
from tools._recipe import load_recipe  # noqa: E402


def gathered_trainable(engine) -> dict[str, torch.Tensor]:
    params = {n: p for n, p in engine.module.named_parameters() if p.requires_grad}
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {n: p.detach().float().cpu().clone() for n, p in params.items()}


def main() -> None:
    out = Path(sys.argv[1])
    args = sys.argv[2:]
    assert args[0] == "--config"
    recipe = load_recipe().FluxGRPORecipe(load_config(args[1], args[2:]))
    recipe.setup()
    before = gathered_trainable(recipe.engine)
    step = recipe.step(0)
    result = {"rewards": step.rewards.cpu(), "advantages": step.advantages.cpu(), "stats": step.stats,
              "before": before, "after": gathered_trainable(recipe.engine), "world": recipe.world}

    # Reference checks on the first chunk after the update (weights have moved).
    chunk = step.chunks[0]
    x, t = chunk.traj.latents[:, 1], recipe.sampler.sigmas[1].expand(len(chunk.ids))
    with torch.no_grad():
        if recipe.cfg.lora is not None:
            recipe.engine.module.disable_adapters()
            velocity = recipe.family.velocity
            disabled = velocity(recipe.engine.module, x, t, chunk.cond)
            recipe.engine.module.enable_adapters()
            enabled = velocity(recipe.engine.module, x, t, chunk.cond)
            base = velocity(recipe.family.load_transformer(recipe.model_path, recipe.dtype), x, t, chunk.cond)
            result.update(lora_disabled=disabled.cpu(), lora_enabled=enabled.cpu(), base=base.cpu())
        if recipe.reference is not None:
            params = list(recipe.reference.module.parameters())
            result["ref_local_numel"] = sum(p.ds_tensor.numel() for p in params)
            result["ref_full_numel"] = sum(p.ds_numel for p in params)
            result["ref_visible_numel"] = sum(p.numel() for p in params)  # persistent ones only, outside a forward
            result["ref_persistent_numel"] = sum(p.ds_numel for p in params if p.ds_persist)
            result["ref_persistent_max"] = max((p.ds_numel for p in params if p.ds_persist), default=0)
    if dist.get_rank() == 0:
        torch.save(result, out)
    dist.barrier()


if __name__ == "__main__":
    main()
