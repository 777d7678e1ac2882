"""Candidate selection (Sol-RL, arXiv 2604.06916; Pro-GRPO prunes groups alike): per prompt a pool of candidates is
previewed with fewer ODE steps of the same sampler and scored; the best and the worst of each pool become the
prompt's group, rolled out in full from their own starting noise and trained on their full rollouts' rewards.

The source, NVlabs/Sana@06af561 train_scripts/sol_rl/train_flux1.py `_rollout_for_one_prompt`: it previews
num_image_per_prompt candidates (96) with preview_step (6) deterministic steps, each from its own seed, scores the
previews, keeps full_rollout_num = best_of_n of them (24) by train_utils.py `select_indices_by_mode(...,
"best_worst")` (the target // 2 highest by torch.topk, then the rest lowest), regenerates the kept from the same
seeds at the full steps (10) and trains on the full images' own rewards. Here the two counts are settings
(sampling.candidates.keep_top, keep_bottom; the source's rule is keep_top = group_size // 2), ties are broken by the
candidate's index (torch.topk leaves their order unspecified) and a non-finite preview score ranks lowest.

Candidate c of prompt slot p has the pool index p * pool + c: its starting and SDE noise are pure functions of
(seed, step, pool index) (grpo/data.py's POOL_NOISE streams), and the selection is a pure function of the gathered
scores, so every rank keeps the same candidates on 1 or N processes, and a resumed step keeps them again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grpo.data import INIT_NOISE, POOL_NOISE, POOL_STEP_NOISE, STEP_NOISE


def select_extremes(scores: torch.Tensor, keep_top: int, keep_bottom: int) -> torch.Tensor:
    """[P, keep_top + keep_bottom] candidate indices of each row of `scores` [P, M]: its keep_top highest (highest
    first), then its keep_bottom lowest (lowest first), the order Sol-RL concatenates them in.

    One total order per row, by score and then by index, so the two ends never share a candidate and ties resolve
    alike on every rank."""
    m = scores.shape[1]
    if keep_top + keep_bottom > m:
        raise ValueError(f"keep {keep_top} + {keep_bottom} of {m} candidates")
    s = torch.nan_to_num(scores.double(), nan=-torch.inf)
    order = torch.sort(-s, dim=1, stable=True).indices  # stable: equal scores stay in index order
    return torch.cat([order[:, :keep_top], order[:, m - keep_bottom:].flip(1)], dim=1)


@dataclass(frozen=True)
class Starts:
    """Where each of a step's N samples (global index s, prompt-major) starts: the keys and streams of its starting
    noise and of its SDE noise (grpo/data.py)."""

    init_keys: list[int]
    sde_keys: list[int]
    init_stream: int = INIT_NOISE
    sde_stream: int = STEP_NOISE
    stats: dict[str, float] = field(default_factory=dict)  # what the selection logs

    @classmethod
    def own(cls, samples: int, group_size: int, same_noise: bool) -> "Starts":
        """No selection: sample s starts from its own noise (its group's with init_same_noise)."""
        return cls([s // group_size if same_noise else s for s in range(samples)], list(range(samples)))

    @classmethod
    def selected(cls, scores: torch.Tensor, pool: int, keep_top: int, keep_bottom: int) -> "Starts":
        """From the gathered [P * pool] preview scores: sample k of prompt slot p is the k-th kept candidate of p's
        pool, and its full rollout is that candidate's (its pool index keys both noises)."""
        per_prompt = scores.detach().float().cpu().view(-1, pool)
        kept = select_extremes(per_prompt, keep_top, keep_bottom)  # [P, G]
        offsets = torch.arange(len(kept)).unsqueeze(1) * pool
        keys = (kept + offsets).flatten().tolist()
        chosen = per_prompt.gather(1, kept)
        stats = {"candidates/preview_reward_mean": per_prompt.mean().item(),
                 "candidates/kept_preview_mean": chosen.mean().item(),
                 # how far apart the kept ends are: what the selection buys the group's advantages
                 "candidates/kept_preview_spread": (chosen[:, :keep_top].mean(1) - chosen[:, keep_top:].mean(1))
                 .mean().item() if keep_top and keep_bottom else 0.0}
        return cls(keys, keys, POOL_NOISE, POOL_STEP_NOISE, stats)
