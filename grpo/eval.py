"""Held-out evaluation: deterministic (eta = 0) samples of the held-out prompts with fixed noise, scored by the rewards.

One implementation serves both callers:

* the recipe, every `logging.eval_every` steps, with the ZeRO-3 engine (each rank samples its share of the prompts,
  scores are gathered by global index);
* ``python -m tools.eval CONFIG [checkpoint=PATH] [weights=auto|ema|model] [nproc=N] [key=value ...]``
  (tools/eval.py) and tools.bench, without DeepSpeed's engine (one process, or shards over N: tools/shards.py), which
  sample the same prompts with the same noise from the base model and from a checkpoint, and write ``grid.png`` (one
  row per prompt: base | checkpoint) and ``scores.json`` beside the evaluated run.

An eval draws `logging.eval_seeds` images per held-out prompt. Image j (0 <= j < n_prompts * eval_seeds) shows prompt
j % n_prompts from the noise ``initial_noise(seed, step=0, index=j, stream=EVAL_NOISE)`` (grpo/data.py), so every
eval of a run, and tools.eval afterwards, sees the very same starting latents, on any world size.
"""

from __future__ import annotations

import torch

from grpo.config import RecipeConfig
from grpo.data import EVAL_NOISE, micro_batches
from grpo.prompt_sets import PromptSet
from grpo.prompts import PromptCache
from grpo.rollout import FluxSampler

def eval_images(cache: PromptCache | PromptSet, cfg: RecipeConfig) -> int:
    """How many images an eval draws: `logging.eval_seeds` per held-out prompt (of the cache, or of the prompt set
    it is encoded from)."""
    return len(cache) * cfg.logging.eval_seeds


def _prompt_of(cache: PromptCache, ids: list[int]) -> list[int]:
    return [j % len(cache) for j in ids]


@torch.no_grad()
def sample_heldout(model: torch.nn.Module, sampler: FluxSampler, cache: PromptCache, ids: list[int],
                   micro_batch: int) -> list[torch.Tensor]:
    """ODE samples of eval images `ids` (see the module docstring), in micro-batches of `micro_batch` (the rollout
    micro-batch); returns the x0 latents of each micro-batch."""
    return [sampler.sample(model, sampler.conditioning(cache, _prompt_of(cache, chunk)),
                           sampler.initial_latents(0, chunk, EVAL_NOISE), eta=0.0).x0
            for chunk in micro_batches(ids, micro_batch)]


@torch.no_grad()
def score_heldout(sampler: FluxSampler, rewards, cache: PromptCache, ids: list[int], x0: list[torch.Tensor],
                  micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode the micro-batches of :func:`sample_heldout` and score them.

    Returns:
        images [len(ids), 3, H, W] in [0, 1] and raw reward components [len(ids), R] (float32).
    """
    images, scores = [], []
    with rewards.on_device():
        for chunk, latents in zip(micro_batches(ids, micro_batch), x0):
            im = sampler.decode(latents)
            rows = _prompt_of(cache, chunk)
            scores.append(rewards(im, [cache.prompts[i] for i in rows], [cache.metadata[i] for i in rows]).float())
            images.append(im)
    if not images:
        empty = torch.zeros(0, len(rewards.names), device=sampler.device)
        return torch.zeros(0, 3, 0, 0, device=sampler.device), empty
    return torch.cat(images), torch.cat(scores)
