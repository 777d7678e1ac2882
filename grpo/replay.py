"""OP-GRPO's trajectory replay for the grpo objective ("Efficient Off-Policy GRPO for Flow-Matching Models",
arXiv 2604.04142): good trajectories of past steps are kept in a buffer and trained again, off-policy, with a
sequence-level importance weight, and only on their early (high-noise) transitions.

Only the paper's abstract was available, and there is no public code: every detail below is our choice, the paper's
body was not available. What the abstract states: high-quality trajectories are selected and adaptively added to a
replay buffer for reuse; a sequence-level importance sampling correction handles the off-policy shift "while
preserving the integrity of GRPO's clipping"; late denoising steps give ill-conditioned off-policy ratios, so
trajectories are truncated at late steps. Our reading:

    selection   after a step's advantages, its `per_step` samples with the highest positive advantage enter the
                buffer (ties by global sample index, a non-finite advantage never enters), so the choice is a pure
                function of the gathered rewards; "adaptively": a step with fewer positive advantages adds fewer
    buffer      FIFO of `size` trajectories, replicated on every rank (host memory): each entry keeps its prompt row,
                its latents x_0 .. x_L, its behaviour log-probs of transitions 0 .. L-1 and the advantage it had
                when it was rolled out (not recomputed: its group is gone). Rank 0's checkpoint file carries it
    use         one extra update block per step (one optimizer step, as many samples as an on-policy block) after
                the on-policy blocks, once the buffer holds that many: the entries are drawn by a permutation keyed by
                (seed, step), split over the ranks as an on-policy block is, so the block is the same on any world
                size and the on-policy block's first-pass ratio stays exactly 1
    weight      w(tau) = exp(sum_{j<L} [log pi_now(x_{j+1}|x_j) - log pi_behaviour(x_{j+1}|x_j)]), detached, capped
                at `weight_cap` when set; pi_now is a no-grad pass of the current policy just before the replay block
                (the log-probs are grpo's element-means, as in its ratio). The PPO clip then runs on the ratio of the
                policy to that pass, exactly 1 on its first pass, and the clipped term is multiplied by w: the clip
                keeps its meaning (a trust region around the current policy) and w carries the off-policy
                correction
    truncation  transitions j >= L (the late, low-noise ones) are left out of w and never trained from replay; the
                replay block trains K transitions of [0, L) per micro-batch (K: the on-policy count, so DeepSpeed's
                gradient accumulation is unchanged), drawn afresh keyed by (seed, step, block position), not the
                ones trained on-policy
    cost        the no-grad pass (L forwards per replayed trajectory) and the block's K trained transitions count in
                the step's forwards_per_image (the rollout plan's, grpo/rollout_plan.py), when the block runs

The grpo objective (grpo/objectives/grpo.py) owns a :class:`Replay`: the buffer, the block it draws and recomputes,
what it remembers after a step, its checkpoint state and its cost; the recipe only trains the block it is handed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from grpo.data import generator, micro_batches, prompts_for_step
from grpo.distributed import gather_by_index
from grpo.errors import ConfigError
from grpo.schema import setting
from grpo.step import Chunk, Trajectories

if TYPE_CHECKING:
    # RecipeConfig (grpo/config.py) is these settings plus the objectives' sections; it sits above the registry
    from grpo.objectives.base import Models
    from grpo.settings import RecipeSettings as RecipeConfig

# grpo/data.py's streams 0-8 are taken; these two are the replay's own
REPLAY_DRAW, REPLAY_TIMESTEPS = 9, 10


@dataclass(kw_only=True)
class ReplaySettings:
    size: int = setting(help="trajectories the FIFO buffer holds, at least one update block's samples "
                             "(prompts_per_step * group_size / updates_per_step)")
    per_step: int = setting(help="each step's samples with the highest positive advantage added to the buffer (at "
                                 "most; fewer when fewer are positive)")
    truncate: int = setting(help="L: only transitions 0 .. L-1 enter the importance weight and are trained from "
                                 "replay (OP-GRPO truncates the late steps); K trained per trajectory <= L <= "
                                 "num_steps - 1")
    weight_cap: float | None = setting(None, help="upper bound of the sequence-level importance weight; null = "
                                                  "uncapped")


def check(cfg: RecipeConfig, k: int) -> None:
    """One-line refusals of replay settings that make no sense with the rest of the preset; `k`: the transitions
    trained per trajectory."""
    r, s, b = cfg.grpo.replay, cfg.sampling, cfg.batch
    if r is None:
        return
    if s.branch is not None or s.window is not None:
        raise ConfigError("grpo.replay: needs every step SDE with its own log-prob (no sampling.window, no "
                          "sampling.branch); set them null or replay: null")
    if cfg.grpo.ratio_norm:
        raise ConfigError("grpo.replay: GRPO-Guard's RatioNorm needs the rollout's SDE means, which the buffer does "
                          "not keep; set grpo.ratio_norm: false or replay: null")
    samples = b.prompts_per_step * s.group_size
    if not 1 <= r.per_step <= samples:
        raise ConfigError(f"grpo.replay.per_step: {r.per_step}; use 1 .. the step's {samples} samples "
                          "(prompts_per_step * group_size)")
    block = samples // b.updates_per_step
    if r.size < block:
        raise ConfigError(f"grpo.replay.size: {r.size} is less than one update block's {block} samples (prompts_per_"
                          f"step * group_size / updates_per_step), the replay block's size; use at least {block}")
    if not k <= r.truncate <= s.num_steps - 1:
        raise ConfigError(f"grpo.replay.truncate: {r.truncate}; use {k} (the K transitions trained per trajectory) "
                          f".. {s.num_steps - 1} (the trainable ones), or lower grpo.timestep_fraction")
    if r.weight_cap is not None and not r.weight_cap > 0:
        raise ConfigError(f"grpo.replay.weight_cap: {r.weight_cap}; use a positive bound, e.g. 2.0, or null")


def select(advantages: torch.Tensor, per_step: int) -> list[int]:
    """Global indices of the at most `per_step` samples with the highest positive advantage, highest first; equal
    advantages in index order. [N] advantages, gathered: every rank selects the same."""
    a = torch.nan_to_num(advantages.detach().double().cpu(), nan=-torch.inf, posinf=-torch.inf)
    order = torch.sort(-a, stable=True).indices  # stable: ties stay in index order
    return [i for i in order[:per_step].tolist() if a[i] > 0]


def sequence_weight(log_probs_now: torch.Tensor, log_probs_behaviour: torch.Tensor, truncate: int,
                    cap: float | None) -> torch.Tensor:
    """[B] float32 w = exp(sum_{j<truncate} (now_j - behaviour_j)), capped at `cap`, detached; [B, >= truncate]
    log-probs."""
    log_w = (log_probs_now[:, :truncate].double() - log_probs_behaviour[:, :truncate].double()).sum(1)
    w = torch.exp(log_w)
    if cap is not None:
        w = torch.clamp(w, max=cap)
    return w.float().detach()


def draw(seed: int, step: int, held: int, count: int) -> list[int]:
    """The `count` buffer positions step `step` replays, of the `held` entries: a permutation keyed by (seed, step)."""
    return torch.randperm(held, generator=generator(seed, step, 0, REPLAY_DRAW))[:count].tolist()


def replay_transitions(truncate: int, k: int, seed: int, step: int, position: int) -> list[int]:
    """The k of transitions 0 .. truncate-1 one replayed micro-batch trains, increasing; `position`: its first
    sample's place in the replay block."""
    perm = torch.randperm(truncate, generator=generator(seed, step, position, REPLAY_TIMESTEPS))
    return sorted(perm[:k].tolist())


def forwards_per_image(truncate: int, k: int, per_point: int, block: int, samples: int) -> float:
    """A replay block's transformer forward-equivalents per image of the step: per replayed trajectory, the
    weight's no-grad pass (truncate forwards) and k trained transitions at the objective's per-point cost."""
    return block * (truncate + k * per_point) / samples


@dataclass
class Batch:
    """Replayed entries, stacked: what a replay micro-batch is built from."""

    latents: torch.Tensor  # [B, L+1, S, C] float32 x_0 .. x_L
    log_probs: torch.Tensor  # [B, L] float32 behaviour log-probs
    advantages: torch.Tensor  # [B] float32, as at rollout
    prompt_idx: list[int]
    born: list[int]  # step each entry was rolled out in


class ReplayBuffer:
    """FIFO of trajectories, the same on every rank. Entries are kept in insertion order: the oldest first."""

    KEYS = ("latents", "log_probs", "advantages", "prompt_idx", "born")

    def __init__(self, size: int, truncate: int):
        self.size, self.truncate = size, truncate
        self.tensors: dict[str, torch.Tensor] | None = None  # None: empty

    def __len__(self) -> int:
        return 0 if self.tensors is None else len(self.tensors["born"])

    def add(self, latents: torch.Tensor, log_probs: torch.Tensor, advantages: torch.Tensor, prompt_idx: list[int],
            born: int) -> None:
        """Append [n, >= L+1, S, C] latents and [n, >= L] log-probs (cut to the first L transitions) with their
        advantages and prompt rows, then drop the oldest beyond `size`."""
        n, L = len(prompt_idx), self.truncate
        new = {"latents": latents[:, :L + 1].float().cpu().contiguous(),
               "log_probs": log_probs[:, :L].float().cpu().contiguous(),
               "advantages": advantages.float().cpu().reshape(n), "prompt_idx": torch.tensor(prompt_idx).long(),
               "born": torch.full((n,), born, dtype=torch.long)}
        if self.tensors is not None:
            new = {k: torch.cat([self.tensors[k], new[k]]) for k in self.KEYS}
        self.tensors = {k: v[-self.size:].contiguous() for k, v in new.items()} if len(new["born"]) else None

    def take(self, positions: list[int]) -> Batch:
        t = self.tensors
        idx = torch.tensor(positions, dtype=torch.long)
        return Batch(t["latents"][idx].contiguous(), t["log_probs"][idx].contiguous(), t["advantages"][idx],
                     t["prompt_idx"][idx].tolist(), t["born"][idx].tolist())

    def born(self, positions: list[int]) -> list[int]:
        """The steps the entries at `positions` were rolled out in."""
        return self.tensors["born"][torch.tensor(positions, dtype=torch.long)].tolist()

    # --------------------------------------------------------------------------------------------- checkpoint
    def state(self) -> dict[str, torch.Tensor]:
        """Safetensors-ready tensors ("replay/..."); none while empty."""
        return {} if self.tensors is None else {f"replay/{k}": v for k, v in self.tensors.items()}

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore from a checkpoint's tensors (without replay/* ones: an empty buffer)."""
        found = {k: tensors[f"replay/{k}"] for k in self.KEYS if f"replay/{k}" in tensors}
        self.tensors = {k: v.clone() for k, v in found.items()} if len(found) == len(self.KEYS) else None


class Replay:
    """OP-GRPO's replay as the grpo objective runs it, the same on every rank: the buffer, the replay block of a step,
    what a step leaves in the buffer, and the block's cost."""

    def __init__(self, settings: ReplaySettings, cfg: RecipeConfig):
        self.settings, self.cfg = settings, cfg
        self.buffer = ReplayBuffer(settings.size, settings.truncate)
        self.samples = cfg.batch.prompts_per_step * cfg.sampling.group_size  # of a step
        self.block_size = self.samples // cfg.batch.updates_per_step  # an update block's samples, the replay block's

    # ------------------------------------------------------------------------------------------------- cost
    def expected_blocks(self, step: int) -> int:
        """Replay blocks step `step` runs when every step adds per_step trajectories (at least per_step positive
        advantages a step): 1 once the buffer holds a block. What the planner and the benchmarks count; the recipe
        counts the blocks that ran."""
        return int(step >= math.ceil(self.block_size / self.settings.per_step))

    def forwards_per_image(self, k: int, per_point: int) -> float:
        """One replay block's forward-equivalents per image of the step (:func:`forwards_per_image`)."""
        return forwards_per_image(self.settings.truncate, k, per_point, self.block_size, self.samples)

    # ------------------------------------------------------------------------------------------------ block
    @torch.no_grad()
    def block(self, models: Models, step: int, fixed_targets: Callable[[list[Chunk]], None],
              keep_means: bool = False) -> tuple[list[Chunk], dict[str, float]]:
        """The replay block of step `step`: once the buffer holds an update block's samples, that many entries drawn
        by a permutation keyed by (seed, step), split over the ranks and cut into micro-batches as an on-policy block
        is; each micro-batch's log-probs of transitions 0 .. L-1 recomputed by the current policy without gradients
        (the ratio's reference, and with the stored behaviour log-probs the sequence-level importance weight), and K
        of them drawn to train; `fixed_targets` fills in the objective's (e.g. the reference at the trained points);
        `keep_means`: that pass's SDE means too (Flow-DPPO's KL is to the policy the ratio is to).
        Returns this rank's chunks (none before the buffer holds a block) and the stats."""
        cfg, lay, r = self.cfg, models.layout, self.settings
        stats = {"replay/size": float(len(self.buffer)), "replay/blocks": 0.0}
        if len(self.buffer) < self.block_size:
            return [], stats
        positions = draw(cfg.seed, step, len(self.buffer), self.block_size)
        n, rank = lay.samples_per_rank_per_update, _rank()
        places = list(range(rank * n, (rank + 1) * n))  # this rank's places in the block
        device = models.sampler.device
        chunks, weights = [], []
        with models.inference() as model:
            for mb in micro_batches(places, lay.micro_batch_size):
                b = self.buffer.take([positions[p] for p in mb])
                latents = b.latents.to(device)
                cond = models.sampler.conditioning(models.prompts, b.prompt_idx)
                now, means = [], []
                for j in range(r.truncate):
                    out = models.sampler.transition(model, cond, latents, j)
                    now.append(out.log_prob)
                    if keep_means:
                        means.append(out.mean)
                now = torch.stack(now, dim=1)
                w = sequence_weight(now, b.log_probs.to(device), r.truncate, r.weight_cap)
                trained = replay_transitions(r.truncate, lay.trained_transitions, cfg.seed, step, mb[0])
                # no image is decoded from a replayed trajectory: x0 stays a placeholder
                traj = Trajectories(latents, now, x0=latents[:, -1],
                                    means=torch.stack(means, dim=1) if keep_means else None)
                chunks.append(Chunk(mb, b.prompt_idx, cond, traj, trained, weight=w,
                                    advantages=b.advantages.to(device)))
                weights.append(w)
        fixed_targets(chunks)
        return chunks, {**stats, "replay/blocks": 1.0, **self._weight_stats(step, positions, weights, places)}

    def _weight_stats(self, step: int, positions: list[int], weights: list[torch.Tensor],
                      places: list[int]) -> dict[str, float]:
        """Collective: the block's importance weights over every rank, and the age of its entries."""
        w = gather_by_index(torch.cat(weights), torch.tensor(places, device=weights[0].device), self.block_size)
        born = torch.tensor(self.buffer.born(positions), dtype=torch.float32)
        return {"replay/weight_mean": w.mean().item(), "replay/weight_max": w.max().item(),
                "replay/weight_min": w.min().item(), "replay/age_mean": (step - born).mean().item()}

    # --------------------------------------------------------------------------------------------- remember
    def remember(self, models: Models, step: int, chunks: list[Chunk], advantages: torch.Tensor) -> None:
        """Collective: the step's at most per_step samples of highest positive advantage enter the buffer on every
        rank, their latents and log-probs gathered from the ranks that rolled them out."""
        cfg, r, g = self.cfg, self.settings, self.cfg.sampling.group_size
        chosen = select(advantages, r.per_step)  # the same on every rank: the advantages are gathered
        if not chosen:
            return
        place = {s: i for i, s in enumerate(chosen)}
        latent_shape = chunks[0].traj.latents.shape[2:]
        rows, where = [], []
        for c in chunks:
            for row, s in enumerate(c.ids):
                if s in place:
                    rows.append(torch.cat([c.traj.latents[row, :r.truncate + 1].flatten(),
                                           c.traj.log_probs[row, :r.truncate]]).float())
                    where.append(place[s])
        device = models.sampler.device
        width = (r.truncate + 1) * latent_shape.numel() + r.truncate
        local = torch.stack(rows) if rows else torch.zeros(0, width, device=device)
        table = gather_by_index(local, torch.tensor(where, dtype=torch.long, device=device), len(chosen))
        prompt_of_slot = prompts_for_step(len(models.prompts), cfg.batch.prompts_per_step, cfg.seed, step)
        self.buffer.add(table[:, :-r.truncate].reshape(len(chosen), r.truncate + 1, *latent_shape),
                        table[:, -r.truncate:], advantages[torch.tensor(chosen, device=advantages.device)],
                        [prompt_of_slot[s // g] for s in chosen], born=step)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
