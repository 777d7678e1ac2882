"""Held-out evaluation: deterministic (eta = 0) samples of the held-out prompts with fixed noise, scored by the rewards.

One implementation serves both callers:

* the recipe, every `logging.eval_every` steps, with the ZeRO-3 engine (each rank samples its share of the prompts,
  scores are gathered by global index);
* ``python -m grpo.eval CONFIG [checkpoint=PATH] [weights=auto|ema|model] [key=value ...]``, a single process
  without DeepSpeed, which samples the same prompts with the same noise from the base model and from a checkpoint,
  and writes ``output_dir/eval/<checkpoint>/grid.png`` (one row per prompt: base | checkpoint) and ``scores.json``.

An eval draws `logging.eval_seeds` images per held-out prompt. Image j (0 <= j < n_prompts * eval_seeds) shows prompt
j % n_prompts from the noise ``initial_noise(seed, step=0, index=j, stream=EVAL_NOISE)`` (grpo/data.py), so every
eval of a run, and grpo.eval afterwards, sees the very same starting latents, on any world size.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch

from grpo.config import RecipeConfig
from grpo.data import EVAL_NOISE, micro_batches
from grpo.errors import ConfigError, run_command
from grpo.prompts import PromptCache
from grpo.rollout import FluxSampler

log = logging.getLogger(__name__)


def eval_images(cache: PromptCache, cfg: RecipeConfig) -> int:
    """How many images an eval draws: `logging.eval_seeds` per held-out prompt."""
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
            scores.append(rewards(im, [cache.prompts[i] for i in _prompt_of(cache, chunk)]).float())
            images.append(im)
    if not images:
        empty = torch.zeros(0, len(rewards.names), device=sampler.device)
        return torch.zeros(0, 3, 0, 0, device=sampler.device), empty
    return torch.cat(images), torch.cat(scores)


# ---------------------------------------------------------------------------------------------------- the CLI


def _side_by_side(base: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """[N,3,H,W] x 2 -> [2N,3,H,W] ordered base_0, trained_0, base_1, ... (a 2-column grid: one prompt per row)."""
    return torch.stack([base, trained], dim=1).flatten(0, 1)


def _summary(components: torch.Tensor, total: torch.Tensor, names: list[str], n_prompts: int) -> dict:
    return {
        "reward_mean": total.mean().item(),
        "per_prompt": total.view(-1, n_prompts).mean(0).tolist(),  # rows of the [seeds, prompts] layout of the ids
        "components": {n: components[:, i].tolist() for i, n in enumerate(names)},  # per image
    }


def evaluate_checkpoint(cfg: RecipeConfig, checkpoint: str | Path | None, weights: str = "auto",
                        out_dir: str | Path | None = None) -> dict:
    """Sample and score the held-out prompts with the base model and with `checkpoint`'s weights (one process).

    Args:
        cfg: the preset (model, sampling, rewards, held-out prompts).
        checkpoint: a checkpoint folder, a run folder, or None for the newest valid checkpoint under
            cfg.output_dir/checkpoints (base only when there is none).
        weights: auto (EMA when the checkpoint has it), ema, or model.
        out_dir: where grid.png and scores.json go; default output_dir/eval/<checkpoint name>.

    Returns:
        {"prompts", "base": {...}, "checkpoint": {...} | None, "images": {"base": T, "checkpoint": T}, "dir"}.
    """
    from grpo import device as dev
    from grpo import engine as eng
    from grpo import export
    from grpo.layout import derive_layout
    from grpo.flux import load_parts
    from grpo.inputs import load_ds_config, resolve_model_path
    from grpo.metrics import save_grid
    from grpo.prompts import ensure_cache, load_cache, read_prompt_file
    from grpo.rewards import build_rewards, check_rewards, mix

    if not cfg.data.eval_prompts:
        raise ConfigError("data.eval_prompts: null; grpo.eval needs a held-out prompt file, e.g. "
                          "assets/prompts/tiny_heldout.txt")
    layout = derive_layout(cfg, 1)
    ds = load_ds_config(cfg.deepspeed.config, cfg, layout)
    dtype = eng.precision(ds)
    model_path = resolve_model_path(cfg.model.path, cfg.model.revision)
    read_prompt_file(cfg.data.eval_prompts, "data.eval_prompts")
    check_rewards(cfg.rewards)
    if weights not in ("auto", "ema", "model"):
        raise ConfigError(f"weights: {weights!r}; use auto, ema or model")
    if checkpoint is None:
        found = export.find_checkpoint(Path(cfg.output_dir), required=False)
        if found is None:
            log.warning("no checkpoint under %s/checkpoints: evaluating the base model only", cfg.output_dir)
    else:
        found = export.find_checkpoint(Path(checkpoint))
    state, meta = export.trained_weights(found, weights) if found is not None else (None, None)

    device = dev.device_for_local_rank(0)
    cache = load_cache(ensure_cache(model_path, cfg.data.eval_prompts, "data.eval_prompts", cfg.data.cache_dir,
                                    cfg.data.max_sequence_length, device))
    parts = load_parts(model_path, vae_dtype=dev.resolve_dtype(cfg.model.dtype), transformer_dtype=dtype)
    model = parts.transformer.to(device).eval()
    dev.set_attention_backend(model, cfg.model.attention_backend)
    sampler = FluxSampler.from_parts(parts, parts.vae.to(device), cfg.sampling, cfg.seed, device, dtype)
    micro = layout.rollout_micro_batch_size
    rewards = build_rewards(cfg.rewards, device)
    ids = list(range(eval_images(cache, cfg)))

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x0 = sample_heldout(model, sampler, cache, ids, micro)
        images, comps = score_heldout(sampler, rewards, cache, ids, x0, micro)
        return images, comps, mix(comps, rewards.weights.to(comps.device), None, False)

    base_images, base_comps, base_total = run()
    result = {"prompts": list(cache.prompts), "base": _summary(base_comps, base_total, rewards.names, len(cache)),
              "checkpoint": None, "images": {"base": base_images.cpu()}}
    if found is not None:
        export.apply_weights(model, state, meta)
        images, comps, total = run()
        result["checkpoint"] = {"path": str(found), "step": meta["step"], "weights": meta["weights"],
                                **_summary(comps, total, rewards.names, len(cache))}
        result["images"]["checkpoint"] = images.cpu()
    out = Path(out_dir) if out_dir else Path(cfg.output_dir) / "eval" / (found.name if found else "base")
    out.mkdir(parents=True, exist_ok=True)
    first = slice(0, len(cache))  # the first seed's image of every prompt: one row per prompt
    grid = (_side_by_side(base_images[first], result["images"]["checkpoint"][first]) if found is not None
            else base_images[first])
    save_grid(grid, out / "grid.png", 2 if found is not None else min(len(cache), 8))
    (out / "scores.json").write_text(json.dumps({k: v for k, v in result.items() if k != "images"}, indent=1))
    result["dir"] = str(out)
    line = (f"held-out reward over {len(cache)} prompts x {cfg.logging.eval_seeds} seeds: "
            f"base {result['base']['reward_mean']:.4f}")
    if found is not None:
        line += f" | {found.name} ({meta['weights']}) {result['checkpoint']['reward_mean']:.4f}"
    log.info("%s -> %s", line, out)
    return result


def main(argv: list[str] | None = None) -> int:
    """`python -m grpo.eval CONFIG [checkpoint=PATH] [weights=auto|ema|model] [key=value ...]`."""
    from grpo.config import load_config

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    own = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv[1:] if a.startswith(("checkpoint=", "weights="))}
    overrides = [a for a in argv[1:] if not a.startswith(("checkpoint=", "weights="))]

    def body() -> str:
        cfg = load_config(argv[0], overrides)
        return evaluate_checkpoint(cfg, own.get("checkpoint") or None, own.get("weights", "auto"))["dir"]

    return run_command(body)


if __name__ == "__main__":
    sys.exit(main())
