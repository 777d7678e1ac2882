"""GRPO fine-tuning of FLUX with the transformer sharded by DeepSpeed ZeRO-3 (Ascend NPU, CUDA or CPU).

One step reads top to bottom as the algorithm:
    rollout    each rank samples its share of the step's images with the SDE sampler, recording latents and log-probs
    reward     each rank scores its own images; only scalars cross ranks
    advantage  rewards are gathered with their global sample index and normalised within each prompt's group
    reference  (kl_coef > 0) SDE means of the reference policy for the transitions to be trained
    update     PPO-clip loss on a random share of each trajectory's transitions, accumulated, then an optimizer step
    log/save   metrics.jsonl, TensorBoard, sample grids, and finally a LoRA or a full transformer export

Features and the settings that control them (see grpo/config.py for every key):
    full fine-tune or LoRA ........ lora: null | {rank, alpha, target_modules}
    KL to a reference ............. grpo.kl_coef (0 = no reference model at all); LoRA: adapters disabled;
                                    full: a second ZeRO-3 engine without optimizer
    sharding/offload/precision .... deepspeed.config (ds_configs/*.json); batch fields are derived, never set there
    activation recompute .......... model.gradient_checkpointing
    sampler ....................... sampling.{num_steps, eta, sde: dance|flow, shift, guidance, init_same_noise}
    batch ......................... batch.{prompts_per_step (global), micro_batch_size, updates_per_step},
                                    sampling.group_size (global); per-rank values derived from the world size

Seeds: prompts, initial noise, SDE noise and trained timesteps are pure functions of (seed, step, global sample index)
(grpo/data.py), so a preset gives the same run on 1 or N processes. Torch's global generators are seeded with
seed + rank for anything else (e.g. LoRA init is broadcast from rank 0 by ZeRO-3, so it does not depend on it).

Launch:
    bash launch/run.sh recipes/configs/tiny/grpo_lora.yaml [key=value ...]          # all local devices, or 2 CPU procs
    torchrun --nproc_per_node 8 recipes/flux_grpo.py --config CONFIG [key=value ...]
    bash launch/multinode.sh HOSTFILE CONFIG [key=value ...]
Copy and edit: cp recipes/flux_grpo.py my_recipe.py, then `bash launch/run.sh CONFIG` with RECIPE=my_recipe.py.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from grpo import device as dev
from grpo import engine as eng
from grpo.advantages import group_advantages
from grpo.config import RecipeConfig, derive_layout, dump_config, load_config
from grpo.data import EVAL_NOISE, INIT_NOISE, initial_noise, prompts_for_step, step_noise_generator, trained_steps
from grpo.distributed import gather_by_index
from grpo.errors import ConfigError
from grpo.flux import decode, load_parts, load_transformer, make_conditioning, pack, resolve_model_path
from grpo.loss import grpo_loss
from grpo.metrics import MetricsLogger, save_grid
from grpo.prompts import ensure_cache, load_cache, read_prompt_file
from grpo.rewards import build_rewards, check_rewards, finite_check, mix
from grpo.rollout import SDEParams, Trajectories, sample, transition
from grpo.sde import dynamic_sigmas, kl_same_std, shifted_sigmas

log = logging.getLogger("flux_grpo")


class FluxGRPORecipe:
    def __init__(self, cfg: RecipeConfig):
        """Checks everything that can be checked without loading a model, then joins the process group."""
        self.cfg = cfg
        self.dist = dev.init_distributed()
        self.rank, self.world = self.dist.rank, self.dist.world_size
        self.device = self.dist.device
        self.layout = derive_layout(cfg, self.world)
        self.model_path = resolve_model_path(cfg.model.path, cfg.model.revision)
        read_prompt_file(cfg.data.train_prompts, "data.train_prompts")
        if cfg.data.eval_prompts:
            read_prompt_file(cfg.data.eval_prompts, "data.eval_prompts")
        check_rewards(cfg.rewards)
        self.ds_config = eng.load_ds_config(cfg.deepspeed.config, cfg, self.layout)
        self.dtype = eng.precision(self.ds_config)
        dev.check_dtype_supported(self.dtype, "deepspeed.config precision")
        self.out = Path(cfg.output_dir)
        if (self.out / "metrics.jsonl").exists():
            raise ConfigError(f"output_dir: {self.out} already holds a run; choose a new output_dir or delete it")
        dev.seed_everything(cfg.seed + self.rank)
        self.sde = SDEParams(cfg.sampling.eta, cfg.sampling.sde)

    # ------------------------------------------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg = self.cfg
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            dump_config(cfg, self.out / "config.yaml")
            self._log_layout()
        self._setup_data()
        parts = load_parts(self.model_path, vae_dtype=dev.resolve_dtype(cfg.model.dtype), transformer_dtype=self.dtype)
        self.vae = parts.vae.to(self.device)
        self.vae_scale_factor = parts.vae_scale_factor
        self.latent_size = parts.latent_size(cfg.sampling.resolution)
        self.guidance_embeds = parts.transformer.config.guidance_embeds
        self.latent_channels = parts.transformer.config.in_channels // 4
        dev.set_attention_backend(parts.transformer, cfg.model.attention_backend)
        self.sigmas = self._sigmas(parts.scheduler_config)
        self.rewards = build_rewards(cfg.rewards, self.device)
        self.engine, self.scheduler = eng.build_policy(parts.transformer, cfg, self.ds_config)
        self.reference = self._setup_reference()
        self.metrics = MetricsLogger(self.out, self.rank == 0, cfg.logging.tensorboard)

    def _setup_data(self) -> None:
        """Rank 0 encodes missing prompt caches (text encoders freed right after); every rank then reads them."""
        d = self.cfg.data
        files = {"train": (d.train_prompts, "data.train_prompts")}
        if d.eval_prompts:
            files["eval"] = (d.eval_prompts, "data.eval_prompts")
        paths = {}
        for name, (prompt_file, setting) in files.items():
            if self.rank == 0:
                ensure_cache(self.model_path, prompt_file, setting, d.cache_dir, d.max_sequence_length, self.device)
            dist.barrier()
            paths[name] = ensure_cache(self.model_path, prompt_file, setting, d.cache_dir, d.max_sequence_length,
                                       self.device)
        self.train_prompts = load_cache(paths["train"])
        self.eval_prompts = load_cache(paths["eval"]) if "eval" in paths else None

    def _sigmas(self, scheduler_config: dict) -> torch.Tensor:
        s = self.cfg.sampling
        if s.shift == "dynamic":
            return dynamic_sigmas(s.num_steps, (self.latent_size // 2) ** 2, scheduler_config)
        return shifted_sigmas(s.num_steps, float(s.shift))

    def _setup_reference(self):
        """None when kl_coef = 0; the policy itself with adapters disabled for LoRA; else a sharded frozen copy."""
        if self.cfg.grpo.kl_coef == 0 or self.cfg.lora is not None:
            return None
        return eng.build_reference(load_transformer(self.model_path, self.dtype), self.ds_config)

    def _log_layout(self) -> None:
        lay = self.layout
        log.info(
            "world %d | images/step %d (%d prompts x %d) | per rank %d | micro-batch %d | updates/step %d | "
            "trained transitions/trajectory %d of %d | backward passes per optimizer step %d",
            lay.world_size, lay.samples_per_step, self.cfg.batch.prompts_per_step, self.cfg.sampling.group_size,
            lay.samples_per_rank, lay.micro_batch_size, lay.updates_per_step, lay.trained_transitions,
            self.cfg.sampling.num_steps - 1, lay.grad_accum_steps,
        )

    # ------------------------------------------------------------------------------------------------ train
    def train(self) -> None:
        cfg = self.cfg
        self.evaluate(step=0)
        for step in range(cfg.max_steps):
            clock = [time.perf_counter()]
            batch = self.rollout(step)
            clock.append(time.perf_counter())
            rewards, reward_stats = self.score(batch)
            advantages, adv_stats = self.advantages(rewards)
            clock.append(time.perf_counter())
            reference = self.reference_means(batch) if cfg.grpo.kl_coef > 0 else None
            if torch.isfinite(rewards).all():
                update_stats = self.update(step, batch, advantages, reference)
            else:  # a NaN reward would poison every advantage of the step: skip the update, keep the count
                update_stats = {"skipped_updates": 1.0}
            clock.append(time.perf_counter())
            elapsed = clock[-1] - clock[0]
            timings = {"time/rollout_s": clock[1] - clock[0], "time/reward_s": clock[2] - clock[1],
                       "time/update_s": clock[3] - clock[2], "step_time_s": elapsed,
                       "samples_per_s": self.layout.samples_per_step / elapsed}
            self.metrics.log(step, {**reward_stats, **adv_stats, **update_stats, **timings})
            if self.rank == 0:
                log.info("step %d | reward %.4f | loss %.3e | ratio_max_dev %.2e | %.1fs", step,
                         reward_stats["reward_mean"], update_stats.get("loss", float("nan")),
                         update_stats.get("ratio_max_dev", float("nan")), elapsed)
            if cfg.logging.sample_every and step % cfg.logging.sample_every == 0 and self.rank == 0:
                save_grid(batch["images"], self.out / "samples" / f"step_{step:05d}.png", cfg.sampling.group_size)
        self.evaluate(step=cfg.max_steps)
        self.save_final()

    # ---------------------------------------------------------------------------------------------- rollout
    def _chunks(self, ids: list[int]) -> list[list[int]]:
        m = self.layout.micro_batch_size
        return [ids[i : i + m] for i in range(0, len(ids), m)]

    def _conditioning(self, cache, prompt_idx: list[int]):
        return make_conditioning(cache.prompt_embeds[prompt_idx], cache.pooled[prompt_idx], self.latent_size,
                                 self.cfg.sampling.guidance, self.guidance_embeds, self.device, self.dtype)

    def _initial_latents(self, step: int, keys: list[int], stream: int = INIT_NOISE) -> torch.Tensor:
        shape = (self.latent_channels, self.latent_size, self.latent_size)
        noise = torch.stack([initial_noise(shape, self.cfg.seed, step, k, stream) for k in keys])
        return pack(noise).to(self.device)

    @torch.no_grad()
    def rollout(self, step: int) -> dict:
        """Sample this rank's trajectories, micro-batch by micro-batch, and decode x0 predicted at the last step."""
        cfg, g = self.cfg, self.cfg.sampling.group_size
        prompt_of_slot = prompts_for_step(len(self.train_prompts), cfg.batch.prompts_per_step, cfg.seed, step)
        ids = self.layout.rank_sample_ids(self.rank)
        chunks = []
        with eng.inference_module(self.engine, cfg.deepspeed.gather_for_rollout) as model:
            for chunk in self._chunks(ids):
                prompt_idx = [prompt_of_slot[s // g] for s in chunk]
                noise_keys = [s // g for s in chunk] if cfg.sampling.init_same_noise else chunk
                cond = self._conditioning(self.train_prompts, prompt_idx)
                traj = sample(model, cond, self._initial_latents(step, noise_keys), self.sigmas, self.sde,
                              [step_noise_generator(cfg.seed, step, s) for s in chunk])
                chunks.append({"ids": chunk, "prompt_idx": prompt_idx, "cond": cond, "traj": traj,
                               "trained": self._trained_steps(step, chunk)})
        for c in chunks:  # decode after the gathered weights are released
            c["images"] = decode(self.vae, c["traj"].x0, cfg.sampling.resolution, self.vae_scale_factor)
        return {"chunks": chunks, "images": torch.cat([c["images"] for c in chunks])}

    # ----------------------------------------------------------------------------------------------- reward
    @torch.no_grad()
    def score(self, batch: dict) -> tuple[torch.Tensor, dict]:
        """Score own images, gather the per-reward scores with their global index, mix them. Returns [N] rewards."""
        local, ids = [], []
        with self.rewards.on_device():
            for c in batch["chunks"]:
                prompts = [self.train_prompts.prompts[i] for i in c["prompt_idx"]]
                local.append(self.rewards(c["images"], prompts).float())
                ids.extend(c["ids"])
        local = torch.cat(local)
        nonfinite = finite_check(local, self.rewards.names)
        components = gather_by_index(local, torch.tensor(ids, device=local.device), self.layout.samples_per_step)
        groups = torch.arange(self.layout.samples_per_step, device=components.device) // self.cfg.sampling.group_size
        total = mix(components, self.rewards.weights.to(components.device), groups,
                    self.cfg.normalize_rewards_per_group)
        stats = {"reward_mean": total.mean().item(), "reward_std": total.std().item()}
        for i, name in enumerate(self.rewards.names):
            stats[f"reward/{name}_mean"] = components[:, i].mean().item()
        stats.update({f"nonfinite/{k}": float(v) for k, v in nonfinite.items()})
        return total, stats

    # -------------------------------------------------------------------------------------------- advantage
    def advantages(self, rewards: torch.Tensor) -> tuple[torch.Tensor, dict]:
        groups = torch.arange(len(rewards), device=rewards.device) // self.cfg.sampling.group_size
        adv, stats = group_advantages(rewards, groups, std_scope=self.cfg.grpo.std_scope, clip=self.cfg.grpo.adv_clip)
        return adv, {k: float(v) for k, v in stats.items()}

    # -------------------------------------------------------------------------------------------- reference
    def _trained_steps(self, step: int, chunk: list[int]) -> list[int]:
        return trained_steps(self.cfg.sampling.num_steps - 1, self.layout.trained_transitions, self.cfg.seed, step,
                             chunk[0])

    @torch.no_grad()
    def reference_means(self, batch: dict) -> list[dict[int, torch.Tensor]]:
        """Reference SDE means of every transition the update will train, per chunk (computed sharded)."""
        lora = self.reference is None  # LoRA: the base model is the policy with its adapters switched off
        gather = self.cfg.deepspeed.gather_for_rollout and lora
        with eng.inference_module(self.engine if lora else self.reference, gather) as model:
            if lora:
                model.disable_adapters()
            try:
                return [
                    {j: transition(model, c["cond"], c["traj"].latents, self.sigmas, j, self.sde).mean
                     for j in c["trained"]}
                    for c in batch["chunks"]
                ]
            finally:
                if lora:
                    model.enable_adapters()

    # ----------------------------------------------------------------------------------------------- update
    def update(self, step: int, batch: dict, advantages: torch.Tensor, reference) -> dict:
        """Accumulate the clipped loss over the trained transitions of each update block, then step."""
        per_update = self.layout.micro_batches_per_update
        sums: dict[str, float] = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "approx_kl": 0.0, "ratio_mean": 0.0}
        count, max_dev, grad_norms = 0, 0.0, []
        for n, c in enumerate(batch["chunks"]):
            adv = advantages[torch.tensor(c["ids"], device=advantages.device)]
            for j in c["trained"]:
                out = transition(self.engine, c["cond"], c["traj"].latents, self.sigmas, j, self.sde)
                kl = kl_same_std(out.mean, reference[n][j], out.std) if reference is not None else None
                loss, st = grpo_loss(out.log_prob, c["traj"].log_probs[:, j], adv, clip_range=self.cfg.grpo.clip_range,
                                     kl=kl, kl_coef=self.cfg.grpo.kl_coef)
                self.engine.backward(loss)
                self.engine.step()
                if n < per_update:  # the first update block is exactly on-policy
                    max_dev = max(max_dev, (st["ratio"] - 1).abs().max().item())
                for k in sums:
                    sums[k] += (st["ratio"].mean() if k == "ratio_mean" else loss if k == "loss" else st[k]).item()
                count += 1
            if (n + 1) % per_update == 0:
                grad_norms.append(float(self.engine.get_global_grad_norm() or 0.0))
        totals = torch.tensor([sums[k] / count for k in sums] + [max_dev], device=self.device)
        dist.all_reduce(totals[:-1])
        totals[:-1] /= self.world
        dist.all_reduce(totals[-1:], op=dist.ReduceOp.MAX)
        stats = dict(zip(list(sums) + ["ratio_max_dev"], totals.tolist()))
        stats.update(grad_norm=grad_norms[-1], lr=self.scheduler.get_last_lr()[0])
        return stats

    # --------------------------------------------------------------------------------------------- evaluate
    @torch.no_grad()
    def evaluate(self, step: int) -> float | None:
        """ODE (eta = 0) samples of the held-out prompts with fixed noise, scored; logs eval/reward_mean."""
        if self.eval_prompts is None:
            return None
        n = len(self.eval_prompts)
        ids = list(range(self.rank, n, self.world))
        x0 = []
        with eng.inference_module(self.engine, self.cfg.deepspeed.gather_for_rollout) as model:
            for chunk in self._chunks(ids):
                cond = self._conditioning(self.eval_prompts, chunk)
                x0.append(sample(model, cond, self._initial_latents(0, chunk, EVAL_NOISE), self.sigmas,
                                 SDEParams(0.0, self.cfg.sampling.sde)).x0)
        local, seen = [], []
        with self.rewards.on_device():
            for chunk, latents in zip(self._chunks(ids), x0):
                images = decode(self.vae, latents, self.cfg.sampling.resolution, self.vae_scale_factor)
                local.append(self.rewards(images, [self.eval_prompts.prompts[i] for i in chunk]).float())
                seen.extend(chunk)
                if self.rank == 0 and len(seen) == len(chunk):
                    save_grid(images, self.out / "samples" / f"eval_step_{step:05d}.png", len(chunk))
        empty = torch.zeros(0, len(self.rewards.names), device=self.device)
        local = torch.cat(local) if local else empty
        components = gather_by_index(local, torch.tensor(seen, device=self.device, dtype=torch.long), n)
        total = mix(components, self.rewards.weights.to(components.device), None, False)
        self.metrics.log(step, {"eval/reward_mean": total.mean().item()})
        if self.rank == 0:
            log.info("eval at step %d: held-out reward %.4f over %d prompts", step, total.mean().item(), n)
        return total.mean().item()

    # ------------------------------------------------------------------------------------------------- save
    def save_final(self) -> None:
        """Collective: every rank takes part in gathering the shards; rank 0 writes."""
        if self.cfg.lora is not None:
            eng.save_lora(self.engine, self.out / "final" / "lora")
        else:
            eng.save_full(self.engine, self.out / "final" / "transformer")
        dist.barrier()
        self.metrics.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML preset, e.g. recipes/configs/tiny/grpo_lora.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. max_steps=10")
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    try:
        recipe = FluxGRPORecipe(load_config(args.config, args.overrides))
        recipe.setup()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    recipe.train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
