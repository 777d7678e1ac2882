"""RL fine-tuning of FLUX with the transformer sharded by DeepSpeed ZeRO-3 (Ascend NPU, CUDA or CPU): GRPO, and the
forward-process objectives DiffusionNFT and AWM, in one recipe (`algorithm: grpo | nft | awm`).

One step (`step()`, which the training loop, the tools and the tests all run) reads top to bottom as the algorithm:
    rollout    each rank samples its share of the step's images (grpo: the SDE sampler, recording latents and
               log-probs, optionally only inside an SDE window; nft: the lagging policy's sampler; awm: the policy's);
               with candidate selection a cheaper ODE preview of a larger pool per prompt is scored first, and the
               best and worst candidates of each pool are the group rolled out in full
    reward     each rank scores its own images (with their prompts and dataset metadata); only scalars cross ranks
    advantage  rewards are gathered with their global sample index and normalised within each prompt's group
               (a tree: per depth, over its nodes)
    reference  grpo: the reference policy's SDE means (kl_coef > 0; with grpo.gardo its refreshed copy's); nft/awm:
               the clean samples noised at sampled schedule points, with the lagging policy's and the reference's
               velocities there
    update     grpo: PPO-clip on the trained transitions; nft: the implicit positive/negative policies; awm:
               advantage-weighted flow matching; accumulated, then an optimizer step; then the objective's extra
               blocks, if any (grpo with replay: past trajectories from its buffer, importance-weighted)
    remember   what the objective keeps for later steps (grpo with replay: the best positive-advantage trajectories)
    log/save   health line, metrics.jsonl, TensorBoard, reward curve, sample grids, held-out eval every N steps
               (the best one's weights exported to best/, the collapse alarm), a resumable checkpoint every N steps,
               and finally a LoRA or a full transformer export

Features and the settings that control them (every key with its help: python -m tools.check --help):
    full fine-tune or LoRA ........ lora: null | {rank, alpha, target_modules}
    KL to a reference ............. <objective>.kl_coef (0 = no reference model at all); LoRA: adapters disabled;
                                    full: a second ZeRO-3 engine without optimizer
    sharding/offload/precision .... deepspeed.config (ds_configs/*.json); batch fields are derived, never set there
    activation recompute .......... model.gradient_checkpointing
    sampler ....................... sampling.{num_steps, eta, sde: dance|flow|cps, shift, guidance, init_same_noise}
    fast GRPO strategies .......... sampling.window (MixGRPO, Flow-GRPO-Fast; placement group: Flash-GRPO, with
                                    grpo.timestep_rescale), sampling.tail: dpm2 (MixGRPO-Flash), grpo.ratio_norm
                                    (GRPO-Guard), sampling.branch (BranchGRPO's trees, grpo/tree.py)
    trust region .................. grpo.trust_region.kl_threshold (Flow-DPPO's KL mask in place of the ratio clip,
                                    grpo/loss.py)
    gated KL, refreshed reference . grpo.gardo.{aux_rewards, share, kl_coef, kl_threshold, refresh_every} (GARDO: a KL
                                    on the samples the auxiliary rewards rank apart, to a copy of the policy refreshed
                                    on a KL trigger or every N steps, grpo/gardo.py)
    candidate selection ........... sampling.candidates.{pool, keep_top, keep_bottom, preview_steps} (Sol-RL,
                                    grpo/candidates.py), for every objective
    trajectory replay ............. grpo.replay.{size, per_step, truncate, weight_cap} (OP-GRPO, grpo/replay.py:
                                    the grpo objective's extra block, memory and checkpoint state)
    objective ..................... algorithm: grpo | nft | awm, its settings in the section of that name
                                    (grpo/objectives/: the recipe calls the objective, never asks which it is)
    advantages .................... advantage.{clip, std_scope, eps, per_reward}
    batch ......................... batch.{prompts_per_step (global), micro_batch_size, rollout_micro_batch_size,
                                    updates_per_step},
                                    sampling.group_size (global); per-rank values derived from the world size
    checkpoints and resume ........ checkpoint.{every, keep, resume: null|auto|PATH} (grpo/checkpoint/), also on
                                    another number of processes (resharded through DeepSpeed's universal checkpoint);
                                    python -m tools.export CHECKPOINT OUT; python -m tools.eval CONFIG checkpoint=...
    EMA of the trained weights .... ema.decay (null = off); used by eval and exports
    faults ........................ faults.{max_consecutive_skips, comm_timeout_s}; SIGTERM/SIGINT: finish the
                                    step, save, exit 0 (grpo/health.py, grpo/run_control.py)
    logging ....................... logging.{sample_every, eval_every, tensorboard, wandb, progress}
    best checkpoint, collapse ..... every held-out eval better than all before it exports its weights to best/
                                    (grpo/best.py); logging.collapse_alarm.{sigmas, stop}: warn (and stop) when an
                                    eval falls below the best by more than sigmas paired standard errors

Seeds: prompts, initial noise, SDE noise and trained timesteps are pure functions of (seed, step, global sample index)
(grpo/data.py), so a preset gives the same run on 1 or N processes, and a resumed run continues exactly. Torch's
global generators are seeded with seed + rank for anything else (e.g. LoRA init is broadcast from rank 0 by ZeRO-3, so
it does not depend on it); checkpoints save and restore them on every rank.

Launch:
    bash launch/run.sh recipes/configs/tiny/grpo_lora.yaml [key=value ...]          # all local devices, or 2 CPU procs
    torchrun --nproc_per_node 8 recipes/flux_grpo.py --config CONFIG [key=value ...]
    bash launch/multinode.sh HOSTFILE CONFIG [key=value ...]
    ... checkpoint.resume=auto                     # after a preemption or crash: continue from the last checkpoint
Exit codes: 0 done (or stopped by SIGTERM/SIGINT or logging.collapse_alarm.stop after saving), 2 bad input (one line
on stderr, nothing written), 3 too many skipped updates in a row (a checkpoint was saved), 75 a dependency is down,
retry later (e.g. the reward server stopped answering: one line; resume with checkpoint.resume=auto once it is back),
1 anything else (e.g. a dead rank, a full disk: one line). A plain torchrun reports 2, 3 and 75 as 1 (rank 0's line
is its report's root cause); launch/*.sh and python -m tools.torchrun keep them (grpo/run_control.py: the exit codes,
evals, checkpoints, stops).
Copy and edit: cp recipes/flux_grpo.py my_recipe.py, then `bash launch/run.sh CONFIG` with RECIPE=my_recipe.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import shutil
from collections.abc import Iterable
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from grpo import checkpoint as ckpt
from grpo import device as dev
from grpo import engine as eng
from grpo import eval as evals
from grpo import export, health, lora_files, perf
from grpo import lock as out_lock
from grpo import run_control
from grpo.best import Best, HeldOut, below_best, definition
from grpo.candidates import Starts
from grpo.config import RecipeConfig, dump_config, load_config, to_dict
from grpo.data import POOL_NOISE, micro_batches, prompts_for_step, step_noise_generator
from grpo.distributed import agreed_outside_failure, end_process, gather_by_index
from grpo.ema import ShardedEMA
from grpo.errors import writes_under
from grpo.models.blocks import compile_blocks, compile_seconds, enable_checkpointing
from grpo.inputs import check_inputs
from grpo.loading import transformer_loader
from grpo.loss import poison_nonfinite
from grpo.manifest import RunManifest, device_name
from grpo.metrics import MetricsLogger, progress, save_grid
from grpo.profiling import PhaseClock, StepProfiler
from grpo.prompts import ensure_cache, ensure_negative, ensure_references, load_cache, read_prompt_set
from grpo.objectives import Models
from grpo.rewards import build_rewards, finite_check, mix
from grpo.rollout import FluxSampler
from grpo.rollout_plan import RolloutPlan
from grpo.step import Chunk, LossSums, StepResult, UpdateStats

log = logging.getLogger("flux_grpo")


def build_policy(transformer: torch.nn.Module, cfg: RecipeConfig, ds_config: dict, init_lora=None):
    """The trained transformer in a ZeRO-3 engine: LoRA adapters (or every weight), AdamW, a linear LR warmup.

    `init_lora`: the family whose reader reads lora.init_from into the adapters (a fresh run), or None (a resumed
    one: its checkpoint holds them). Returns (engine, lr_scheduler). The benchmarks build their engines through this
    function too.
    """
    if cfg.lora is not None:
        eng.add_lora(transformer, cfg.lora)  # freezes the base
        if init_lora is not None and cfg.lora.init_from is not None:  # before initialize: the master weights copy it
            lora_files.load_init_lora(transformer, lora_files.init_lora_state(cfg.lora.init_from, init_lora,
                                                                              transformer, cfg.lora))
    else:
        transformer.requires_grad_(True)
    enable_checkpointing(transformer, cfg.model.gradient_checkpointing)
    compile_blocks(transformer, cfg.model.compile)  # model.compile: the blocks compile on their first forward
    eng.fetch_whole_blocks(transformer, cfg.deepspeed.fetch_blocks)
    o = cfg.optim
    optimizer = torch.optim.AdamW([p for p in transformer.parameters() if p.requires_grad], lr=o.lr,
                                  betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                                  fused=dev.fused_adamw(o.fused))
    warmup = max(o.warmup_steps, 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1)))
    engine, _, _, scheduler = deepspeed.initialize(model=transformer, optimizer=optimizer, lr_scheduler=scheduler,
                                                   config=ds_config)
    return engine, scheduler


class FluxGRPORecipe:
    def __init__(self, cfg: RecipeConfig):
        """Checks everything that can be checked without loading a model, then joins the process group.

        `cfg` comes from grpo.config.load_config, which has already validated every setting on its own."""
        self.cfg = cfg
        self.dist = dev.init_distributed(cfg.faults.comm_timeout_s)
        self.rank, self.world = self.dist.rank, self.dist.world_size
        self.device = self.dist.device
        inputs = check_inputs(cfg, self.world)  # what launch/*.sh check before torchrun: batch, files, output_dir
        self.layout, self.model_path, self.ds_config = inputs.layout, inputs.model_path, inputs.ds_config
        self.family = inputs.family  # FLUX.1 or FLUX.2, from the folder's model_index.json (grpo/models/)
        self.dtype = eng.precision(self.ds_config)
        dev.check_dtype_supported(self.dtype, "deepspeed.config precision")
        self.out = Path(cfg.output_dir)
        # None: fresh start (output_dir must be empty). Every refusal comes before the lock: a refused start leaves
        # output_dir as it was, to its mtime; invalid newer checkpoints are moved aside only once the lock is held.
        self.resume_from = ckpt.resume_point(cfg, self.world, move_aside=False)
        # one job per output_dir: rank 0 holds output_dir/.lock until it exits, taken before anything is written
        self.lock = out_lock.take(self.out, self.rank)
        ckpt.set_aside_newer(cfg, self.resume_from)
        self.show_progress = self.rank == 0 and cfg.logging.progress
        # what is trained and its cost (grpo/rollout_plan.py), and the objective (grpo/objectives/)
        self.plan = RolloutPlan.of(cfg)
        self.objective = self.plan.objective
        dev.seed_everything(cfg.seed + self.rank)

    # ------------------------------------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Loads and wraps the models; output_dir is written only once they are built, so a setting that fails on
        the model (e.g. lora.target_modules) leaves it as it was."""
        cfg = self.cfg
        dev.set_deterministic(cfg.model.deterministic)  # before any kernel of the models runs
        if self.rank == 0:
            self._log_layout()
        self._setup_data()
        # model.zero_init: built inside zero.Init and filled from the safetensors shards, ~one host copy per node
        self.load_transformer = transformer_loader(cfg.model.zero_init, self.ds_config)
        parts = self.family.load_parts(self.model_path, vae_dtype=dev.resolve_dtype(cfg.model.dtype),
                                       transformer_dtype=self.dtype, transformer_loader=self.load_transformer)
        self.vae = parts.vae if cfg.model.offload_vae else parts.vae.to(self.device)  # decode() visits the device
        dev.set_attention_backend(parts.transformer, cfg.model.attention_backend)
        self.sampler = FluxSampler.from_parts(parts, self.vae, cfg.sampling, cfg.seed, self.device, self.dtype)
        self.rewards = build_rewards(cfg.rewards, self.device)
        self.throughput = self._throughput()  # perf/* metrics: one forward's model FLOPs, the device's peak
        # resuming a checkpoint of another world size: DeepSpeed loads it as a universal checkpoint (grpo/checkpoint/)
        self.engine, self.scheduler = build_policy(parts.transformer, cfg,
                                                   ckpt.engine_config(self.ds_config, self.resume_from, self.world),
                                                   init_lora=self.family if self.resume_from is None else None)
        self.reference = self._setup_reference()
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            dump_config(cfg, self.out / "config.yaml")
        self._setup_run_state()  # EMA, checkpoint resume, metrics
        # output_dir/manifest.json: this start's command, code, packages, hosts; later every checkpoint's and
        # export's hashes (grpo/manifest.py); a resumed run appends its segment
        self.manifest = RunManifest.begin(self.out, self.rank, self.world, self.device, self.resume_from,
                                          self.state.step)
        self.profiler = StepProfiler.from_config(cfg, self.out, self.rank, self.device)  # profile.steps; no-op if []

    def _setup_data(self) -> None:
        """Rank 0 encodes missing prompt caches (text encoders freed right after) and source-image caches (the VAE
        alone); every rank then reads them."""
        d, resolution = self.cfg.data, self.cfg.sampling.resolution
        files = {"train": (d.train_prompts, "data.train_prompts")}
        if d.eval_prompts:
            files["eval"] = (d.eval_prompts, "data.eval_prompts")
        caches = {}
        # true CFG's negative prompt (sampling.true_cfg, eval_cfg_scale), encoded once like the prompts; None: no CFG
        if self.rank == 0:
            ensure_negative(self.model_path, self.cfg.sampling, d, self.device)
        for name, (prompt_file, setting) in files.items():
            rows = read_prompt_set(prompt_file, setting)  # prompts and each row's metadata, read fresh every start
            if self.rank == 0:
                ensure_cache(self.model_path, prompt_file, setting, d, self.device, rows)
                ensure_references(self.model_path, prompt_file, rows, d.cache_dir, resolution, self.device)
            dist.barrier()
            caches[name] = load_cache(ensure_cache(self.model_path, prompt_file, setting, d, self.device, rows), rows,
                                      ensure_references(self.model_path, prompt_file, rows, d.cache_dir, resolution,
                                                        self.device),
                                      ensure_negative(self.model_path, self.cfg.sampling, d, self.device))
        self.train_prompts = caches["train"]
        self.eval_prompts = caches.get("eval")

    def _throughput(self) -> perf.Throughput:
        """One transformer forward's model FLOPs per image at this run's shapes (the noisy tokens, a row's reference
        images' tokens, the cached prompts' length), counted on the meta device, and the device's peak
        (grpo/perf.py)."""
        cache = self.train_prompts
        refs = 0 if cache.references is None else cache.reference_index.shape[1] * cache.references.shape[1]
        flops = perf.forward_flops(self.family, self.model_path, (self.sampler.latent_size // 2) ** 2 + refs,
                                   cache.embeds["prompt_embeds"].shape[1])
        peak, source = perf.peak_tflops(device_name(self.device), self.cfg.perf.peak_tflops)
        throughput = perf.Throughput(flops, peak, self.world)
        if self.rank == 0:
            log.info(throughput.describe(source))
        return throughput

    def _setup_run_state(self) -> None:
        """EMA, the lagging policy (nft, awm), the checkpoint to resume from (weights, optimizer, RNG, counters, the
        objective's own state), metrics, run control."""
        cfg = self.cfg
        self.ema = ShardedEMA(self.engine, cfg.ema.decay) if cfg.ema.decay else None
        # nft samples with it and mixes it into its implicit policies; awm anchors to it (grpo/matching.py)
        self.lagging = ShardedEMA(self.engine, 0.0, prefix="lag/") if self.objective.uses_lagging else None
        self.models = Models(self.engine, self.sampler, self.lagging, self._inference,  # what the objective uses
                             prompts=self.train_prompts, layout=self.layout)
        self.checkpoints = ckpt.Checkpointer(cfg, self.rank, self.world)
        # the best held-out eval so far (grpo/best.py): its weights are in best/; None without held-out prompts
        self.best = Best(definition(self.eval_prompts.prompts, cfg)) if self.eval_prompts is not None else None
        self.state = ckpt.RunState(step=0)
        if self.resume_from is not None:
            self.state = self.checkpoints.load(self.resume_from, self.engine, self._stateful())
            if self.rank == 0:
                log.info("resumed from %s: continuing at step %d", self.resume_from, self.state.step)
        self.skips = health.SkipCounter(cfg.faults.max_consecutive_skips, self.state.consecutive_skips,
                                        self.state.total_skips)
        self.metrics = MetricsLogger(self.out, self.rank == 0, cfg.logging.tensorboard,
                                     resume_step=self.state.step if self.resume_from is not None else None,
                                     wandb=cfg.logging.wandb, config=to_dict(cfg))
        # stop signals, when evals and checkpoints are due, saving when a dependency is down (grpo/run_control.py)
        self.control = run_control.RunControl(cfg, self.device, self.rank, self.world, self.checkpoints,
                                              self.metrics, self.skips, save=self.save_checkpoint,
                                              evaluate=self.evaluate)

    def _setup_reference(self):
        """None when kl_coef = 0; the policy itself with adapters disabled for LoRA; else a sharded frozen copy."""
        if self.objective.kl_coef == 0 or self.cfg.lora is not None:
            return None
        transformer = self.load_transformer(self.model_path, self.dtype)
        dev.set_attention_backend(transformer, self.cfg.model.attention_backend)  # the policy's kernels, or the KL
        eng.fetch_whole_blocks(transformer, self.cfg.deepspeed.fetch_blocks)     # would measure their difference
        return eng.build_reference(transformer, self.ds_config)

    def _log_layout(self) -> None:
        lay = self.layout
        log.info(
            "world %d | images/step %d (%d prompts x %d) | per rank %d | micro-batch %d (rollout %d) | "
            "updates/step %d | trained transitions/trajectory %d of %d | backward passes per optimizer step %d",
            lay.world_size, lay.samples_per_step, self.cfg.batch.prompts_per_step, self.cfg.sampling.group_size,
            lay.samples_per_rank, lay.micro_batch_size, lay.rollout_micro_batch_size, lay.updates_per_step,
            lay.trained_transitions, self.cfg.sampling.num_steps - 1, lay.grad_accum_steps,
        )

    # ------------------------------------------------------------------------------------------------ train
    def train(self) -> None:
        """Run steps state.step .. max_steps-1; SIGTERM/SIGINT: finish the step, save, return (exit 0)."""
        cfg, run, first = self.cfg, self.control, self.state.step
        if run.start(first):  # the held-out eval at step 0, or the one the resumed run owed
            return run.stopped(first)
        with run.signals():
            for step in range(first, cfg.max_steps):
                if step > first and run.stopped_before(step):  # signalled during the last eval or save: saved
                    return run.stopped(step)
                self.profiler.start(step)
                with run.saved_if_a_dependency_is_down(steps_done=step):
                    result = self.step(step)
                too_many_skips = self.skips.record(result.stats["skipped_updates"] > 0)
                stats = {**result.stats, "skipped_total": self.skips.total}
                self.profiler.stop()
                # rank 0 writes alone: a file system that refuses it (read-only, permissions) ends every rank at once
                with agreed_outside_failure(self.device), writes_under(self.out, f"metrics and samples of step {step}"):
                    self.metrics.log(step, stats)
                    if self.rank == 0:
                        log.info(self.objective.health_line(step, stats))
                    if cfg.logging.sample_every and step % cfg.logging.sample_every == 0 and self.rank == 0:
                        save_grid(result.images, self.out / "samples" / f"step_{step:05d}.png",
                                  cfg.sampling.group_size)
                if run.after_step(step + 1, too_many_skips):  # eval and checkpoint when due; True: stop here
                    return run.stopped(step + 1)
        self.save_final()

    def step(self, step: int, phase=None) -> StepResult:
        """One training step: rollout -> reward -> advantage -> reference -> update (-> EMA, lagging policy) ->
        remember (what the objective keeps for later steps).

        `phase(name)`, when given, returns a context held around the "rollout", "reward" and "train" parts (the
        tools' recording windows); the parts are timed either way.
        """
        clock = PhaseClock(phase)
        compiling = compile_seconds()
        with clock("rollout"):
            starts = self.preview(step)  # with candidate selection: which candidates are the groups
            chunks = self.rollout(step, starts)
        with clock("reward"):
            rewards, reward_stats = self.score(chunks, step)
            advantages, adv_stats = self.advantages(rewards)
            reward_stats.update(self.objective.scored(self.models, step, rewards, self.rewards.weights))
        with clock("train"):
            self.objective.fixed_targets(self.models, chunks, step)
            if torch.isfinite(rewards).all():
                update = self.update(step, chunks, advantages)
            else:  # a NaN reward would poison every advantage of the step: skip the update, keep the count
                update = UpdateStats(skipped_updates=float(self.layout.updates_per_step),
                                     lr=self.scheduler.get_last_lr()[0])
            if update.skipped_updates < self.layout.updates_per_step + update.extra_blocks:
                self._update_averages()
            self.objective.remember(self.models, step, chunks, advantages)
        n = self.layout.samples_per_step
        timings = {"time/rollout_s": clock.seconds["rollout"], "time/reward_s": clock.seconds["reward"],
                   "time/update_s": clock.seconds["train"], "step_time_s": clock.total,
                   "samples_per_s": n / clock.total,
                   # each phase's throughput, over every rank (the rollout with its preview and decode, the update
                   # with its reference forwards): where a step's time goes, per image
                   "time/rollout_images_per_s": n / clock.seconds["rollout"],
                   "time/update_images_per_s": n / clock.seconds["train"]}
        if self.cfg.model.compile:  # compile time is part of the phases' times above; reported apart
            timings["time/compile_s"] = compile_seconds() - compiling
        # Transformer compute per image in forward-equivalents (a backward counts 2) per phase: what strategies
        # trade, and with one forward's FLOPs each phase's model TFLOP/s and MFU (grpo/perf.py)
        forwards = self.plan.phase_forwards(step, extra_blocks=update.extra_blocks)
        timings.update(self.throughput.metrics(forwards, n, {"rollout": clock.seconds["rollout"],
                                                             "update": clock.seconds["train"]}))
        return StepResult(chunks, rewards, advantages, {**starts.stats, **reward_stats, **adv_stats, **update.metrics(),
                                                        **timings, "forwards_per_image": float(sum(forwards.values()))})

    # ---------------------------------------------------------------------------------------------- rollout
    @torch.no_grad()
    def preview(self, step: int) -> Starts:
        """Where each sample of the step starts. Candidate selection (sampling.candidates, grpo/candidates.py): this
        rank's share of every prompt's pool, previewed with the rollout's weights in fewer ODE steps from each
        candidate's own noise, scored; every rank keeps the same best and worst of each pool from the gathered
        scores. The ODE makes a preview the noise's own outcome: with ODE rollouts (nft, awm) the kept sample is the
        same trajectory at the full steps; an SDE rollout (grpo) adds its own noise from there."""
        cfg, c, lay = self.cfg, self.cfg.sampling.candidates, self.layout
        if c is None:
            return Starts.own(lay.samples_per_step, cfg.sampling.group_size, cfg.sampling.init_same_noise)
        prompt_of_slot = prompts_for_step(len(self.train_prompts), cfg.batch.prompts_per_step, cfg.seed, step)
        previewer = self.sampler.with_steps(c.preview_steps)
        batches = []
        with (self.objective.rollout_weights(self.models),
              eng.inference_module(self.engine, cfg.deepspeed.gather_for_rollout) as model):
            for ids in progress(micro_batches(lay.rank_pool_ids(self.rank), lay.rollout_micro_batch_size),
                                f"preview {step}", self.show_progress):
                prompt_idx = [prompt_of_slot[i // c.pool] for i in ids]
                cond = self.sampler.conditioning(self.train_prompts, prompt_idx)
                traj = previewer.sample(model, cond, self.sampler.initial_latents(step, ids, POOL_NOISE), eta=0.0)
                batches.append((ids, prompt_idx, traj.x0))
        # decoded batch by batch as they are scored: a pool's images at once would be pool / group_size times the
        # step's
        local, ids = self._rewards_of((i, p, self.sampler.decode(x0)) for i, p, x0 in batches)
        components = gather_by_index(local, ids, lay.pool_per_step)
        return Starts.selected(mix(components, self.rewards.weights.to(components.device)), c.pool, c.keep_top,
                               c.keep_bottom)

    @torch.no_grad()
    def rollout(self, step: int, starts: Starts) -> list[Chunk]:
        """Sample this rank's trajectories from their `starts`, rollout micro-batch by rollout micro-batch, cut them
        into the update's micro-batches (the unit of everything after), and decode x0 predicted at the last step."""
        cfg, g, lay = self.cfg, self.cfg.sampling.group_size, self.layout
        prompt_of_slot = prompts_for_step(len(self.train_prompts), cfg.batch.prompts_per_step, cfg.seed, step)
        chunks = []
        with (self.objective.rollout_weights(self.models),
              eng.inference_module(self.engine, cfg.deepspeed.gather_for_rollout) as model):
            for ids in progress(micro_batches(lay.rank_sample_ids(self.rank), lay.rollout_micro_batch_size),
                                f"rollout {step}", self.show_progress):
                prompt_idx = [prompt_of_slot[s // g] for s in ids]
                window = self.plan.window(step, ids[0])  # None: every step SDE, a random share trained per chunk
                cond = self.sampler.conditioning(self.train_prompts, prompt_idx)
                init = self.sampler.initial_latents(step, [starts.init_keys[s] for s in ids], starts.init_stream)
                noise = [step_noise_generator(cfg.seed, step, starts.sde_keys[s], starts.sde_stream) for s in ids]
                traj = self.sampler.sample(model, cond, init, noise, window, **self.objective.rollout_records())
                for i in range(0, len(ids), lay.micro_batch_size):
                    rows = slice(i, i + lay.micro_batch_size)
                    trained = self.plan.trained(step, window, ids[rows][0])
                    chunks.append(Chunk(ids[rows], prompt_idx[rows], cond.select(rows), traj.select(rows), trained))
        for c in chunks:  # decode after the gathered weights are released
            c.images = self.sampler.decode(c.traj.x0)
        return chunks

    # ----------------------------------------------------------------------------------------------- reward
    @torch.no_grad()
    def score(self, chunks: list[Chunk], step: int) -> tuple[torch.Tensor, dict]:
        """Score own images, gather the per-reward scores with their global index, mix them. Returns [N] rewards."""
        local, ids = self._rewards_of([(c.ids, c.prompt_idx, c.images) for c in chunks])
        components = gather_by_index(local, ids, self.layout.samples_per_step)
        nonfinite = finite_check(components, self.rewards.names)  # over every rank's images
        total = mix(components, self.rewards.weights.to(components.device))
        stats = {"reward_mean": total.mean().item(), "reward_std": total.std().item()}
        for i, name in enumerate(self.rewards.names):
            stats[f"reward/{name}_mean"] = components[:, i].mean().item()
        stats.update({f"nonfinite/{k}": float(v) for k, v in nonfinite.items()})
        return components, stats

    def _rewards_of(self, batches: Iterable[tuple[list[int], list[int], torch.Tensor]]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's per-reward scores [n, R] of (global indices, prompt rows, images) batches, and the indices."""
        local, ids = [], []
        with agreed_outside_failure(self.device), self.rewards.on_device():  # e.g. a reward server that went away
            for batch_ids, prompt_idx, images in batches:
                prompts = [self.train_prompts.prompts[i] for i in prompt_idx]
                metadata = [self.train_prompts.metadata[i] for i in prompt_idx]  # its dataset row, like the prompt
                local.append(self.rewards(images, prompts, metadata).float())
                ids.extend(batch_ids)
        local = torch.cat(local)
        return local, torch.tensor(ids, device=local.device)

    # -------------------------------------------------------------------------------------------- advantage
    def advantages(self, components: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """[N] group advantages, or with a tree [N, num_steps + 1]: column d for the edges into depth d."""
        return self.plan.advantages(components, self.rewards.weights.to(components.device))

    # -------------------------------------------------------------------------------------------- reference
    @contextlib.contextmanager
    def _inference(self, reference: bool = False):
        """A no-grad forward module: the policy (its lagging weights inside lagging.applied()), or the reference
        (LoRA: the policy with its adapters switched off; full fine-tune: the frozen reference engine)."""
        lora = self.reference is None
        gather = self.cfg.deepspeed.gather_for_rollout and (lora or not reference)
        with eng.inference_module(self.reference if reference and not lora else self.engine, gather) as model:
            if reference and lora:
                model.disable_adapters()
            try:
                yield model
            finally:
                if reference and lora:
                    model.enable_adapters()

    def _update_averages(self) -> None:
        """After a step that updated the weights: the eval EMA, and the lagging policy at its scheduled decay."""
        if self.ema is not None:
            self.ema.update()
        if self.lagging is not None:
            self.lagging.update(self.objective.lagging_decay(self.engine.global_steps))

    # ----------------------------------------------------------------------------------------------- update
    def update(self, step: int, chunks: list[Chunk], advantages: torch.Tensor) -> UpdateStats:
        """Accumulate the objective's loss over the trained points (transitions or noise levels) of each update
        block, then step; then the objective's extra blocks (grpo with replay: its replay block), if any."""
        sums = LossSums(points=self.cfg.sampling.num_steps, per_point=self.objective.stats_per_point())
        skipped_before = self.engine.skipped_steps
        adv = [advantages[torch.tensor(c.ids, device=advantages.device)] for c in chunks]
        self._accumulate(step, chunks, adv, sums, on_policy=self.layout.micro_batches_per_update)
        # drawn with the weights the on-policy blocks left, so their first pass stays exactly on-policy; summed
        # apart, so that loss, ratio and clip statistics stay the on-policy blocks' own
        extra = self.objective.extra_blocks(self.models, step)
        extra_sums = LossSums(points=self.cfg.sampling.num_steps, per_point=self.objective.stats_per_point())
        if extra.chunks:  # every rank has extra blocks or none
            self._accumulate(step, extra.chunks, [c.advantages for c in extra.chunks], extra_sums,
                             on_policy=len(extra.chunks))
        stats = sums.reduce(self.device)
        if extra.chunks:
            r = extra_sums.reduce(self.device)
            stats.nonfinite_loss += r.nonfinite_loss
            stats.extra_blocks = len(extra.chunks) // self.layout.micro_batches_per_update
            extra.stats.update({f"{extra.name}/{k}": v for k, v in r.metrics().items()
                                if k not in ("nonfinite/loss", "skipped_updates") and not k.startswith("ratio_dev/")})
        skipped = self.engine.skipped_steps - skipped_before  # identical on all ranks (global grad norm)
        if stats.nonfinite_loss > 0 and skipped == 0:
            raise RuntimeError("a non-finite loss reached the optimizer and DeepSpeed did not skip the step; "
                               "use deepspeed>=0.19.3 (ZeRO-3 skips steps with a non-finite gradient norm)")
        # The last optimizer step's norm (DeepSpeed keeps only that one)
        stats.grad_norm = float(self.engine.get_global_grad_norm() or 0.0)
        stats.lr = self.scheduler.get_last_lr()[0]
        stats.skipped_updates = float(skipped)
        stats.nonfinite_grad = float(skipped if stats.nonfinite_loss == 0 else 0)
        stats.extra.update(extra.stats)
        return stats

    def _accumulate(self, step: int, chunks: list[Chunk], advantages: list[torch.Tensor], sums: LossSums,
                    on_policy: int) -> None:
        """Backward and (accumulating) optimizer step of every trained point of `chunks`, with each chunk's
        advantages, into `sums`; the first `on_policy` chunks are an exactly on-policy block."""
        for n, (c, adv) in enumerate(progress(list(zip(chunks, advantages)), f"update {step}", self.show_progress)):
            for j in c.trained:
                loss, st = self.objective.loss(self.models, c, j, adv)
                loss = poison_nonfinite(loss)  # ZeRO-3 then skips the optimizer step (non-finite grad norm)
                self.engine.backward(loss)
                self.engine.step()
                sums.add(loss, st, on_policy=n < on_policy, point=j)

    # --------------------------------------------------------------------------------------------- evaluate
    @torch.no_grad()
    def evaluate(self, step: int) -> str | None:
        """ODE (eta = 0) samples of the held-out prompts with fixed noise, scored; logs eval/reward_mean. A new best
        eval's weights go to best/; an eval too far below the best raises the collapse alarm (grpo/best.py).

        Shares its sampling and scoring with `python -m tools.eval` (grpo/eval.py); uses the EMA weights when on.
        Returns the alarm's line when it stops the run (logging.collapse_alarm.stop), else None.
        """
        if self.eval_prompts is None:
            return None
        n = evals.eval_images(self.eval_prompts, self.cfg)
        ids = list(range(self.rank, n, self.world))
        micro, sampler = self.layout.rollout_micro_batch_size, self.sampler.for_eval()
        with self._trained_weights(), eng.inference_module(self.engine, self.cfg.deepspeed.gather_for_rollout) as m:
            x0 = evals.sample_heldout(m, sampler, self.eval_prompts, ids, micro)
        with agreed_outside_failure(self.device):
            images, local = evals.score_heldout(sampler, self.rewards, self.eval_prompts, ids, x0, micro)
        with agreed_outside_failure(self.device), writes_under(self.out, f"the eval grid of step {step}"):
            if self.rank == 0 and ids:  # this rank's share: prompts 0, world, 2*world, ...
                save_grid(images, self.out / "samples" / f"eval_step_{step:05d}.png", min(len(ids), 8))
        components = gather_by_index(local, torch.tensor(ids, device=self.device, dtype=torch.long), n)
        total = mix(components, self.rewards.weights.to(components.device), None, False)
        # every rank gathered every image's reward: each takes the same decisions
        now = HeldOut(step, total.float().cpu())
        drop = self.best.drop(now)  # image by image against the best before it; None at the first eval
        best_before = self.best.held
        with agreed_outside_failure(self.device), writes_under(self.out, f"the eval metrics of step {step}"):
            self.metrics.log(step, {"eval/reward_mean": total.mean().item(), "eval/reward_se": now.se,
                                    **({"eval/vs_best": drop.mean, "eval/vs_best_se": drop.se} if drop else {})})
        if self.rank == 0:
            log.info("eval at step %d: held-out reward %.4f +- %.4f over %d prompts x %d seeds", step,
                     total.mean().item(), now.se, len(self.eval_prompts), self.cfg.logging.eval_seeds)
        if self.best.observe(now):
            self.save_best()
        alarm = self.cfg.logging.collapse_alarm
        if drop is None or alarm is None or not below_best(drop, alarm.sigmas):
            return None
        line = health.collapse_line(step, now.mean, best_before.step, best_before.mean, drop.sigmas, alarm.sigmas,
                                    alarm.stop)
        if self.rank == 0:
            log.warning(line)
        return line if alarm.stop else None

    # ------------------------------------------------------------------------------------------------- save
    def _trained_weights(self):
        """The weights eval and export use: the EMA's while the block runs (when on), else the training ones."""
        return self.ema.applied() if self.ema is not None else contextlib.nullcontext()

    def _stateful(self) -> dict:
        """What a checkpoint holds besides DeepSpeed's state, by name (None: not in this run)."""
        return {"ema": self.ema, "lagging": self.lagging, "objective": self.objective, "best": self.best}

    def save_checkpoint(self, steps_done: int) -> None:
        """Collective: a resumable checkpoint (grpo/checkpoint/) after `steps_done` completed steps."""
        state = ckpt.RunState(steps_done, self.skips.consecutive, self.skips.total)
        path = self.checkpoints.save(self.engine, state, self._stateful())
        with agreed_outside_failure(self.device), writes_under(self.out, "the manifest"):
            self.manifest.update()  # before the line: once it is logged, everything of the checkpoint is written
        if self.rank == 0:
            log.info("checkpoint %s", path)

    def _export(self, folder: Path, what: str) -> None:
        """Collective: the weights evals use, as a diffusers LoRA (folder/lora) or the full transformer
        (folder/transformer); every rank takes part in gathering the shards, rank 0 writes."""
        with self._trained_weights():
            if self.cfg.lora is not None:
                state = eng.lora_state_dict(self.engine)  # rank 0 only, else None
                with agreed_outside_failure(self.device), writes_under(self.out, f"{what} LoRA"):
                    if state is not None:
                        export.write_lora(self.family, state, dataclasses.asdict(self.cfg.lora), folder / "lora",
                                          self.cfg.export.formats, self.model_path)
            else:
                with writes_under(self.out, f"{what} transformer"):  # gathers inside: rank 0 may fail alone
                    eng.save_full(self.engine, folder / "transformer")

    def save_best(self) -> None:
        """Collective: best/, as final/ is written, with best.json (the eval's step, mean and standard error), put in
        place whole (export.publish): written into .tmp-best/ first, which a kill leaves behind and this removes."""
        tmp = self.out / ".tmp-best"
        with agreed_outside_failure(self.device), writes_under(self.out, "the best weights"):
            if self.rank == 0 and tmp.exists():
                shutil.rmtree(tmp)
        self._export(tmp, "the best")
        with agreed_outside_failure(self.device), writes_under(self.out, "the best weights"):
            if self.rank == 0:
                (tmp / "best.json").write_text(json.dumps(self.best.summary(), indent=1) + "\n")
                export.publish(tmp, self.out / "best")
                self.manifest.update()  # best/'s hashes
                log.info("best held-out eval so far (step %d): its weights in %s", self.best.held.step,
                         self.out / "best")

    def save_final(self) -> None:
        """Collective: every rank takes part in gathering the shards; rank 0 writes."""
        self._export(self.out / "final", "the final")
        dist.barrier()
        with agreed_outside_failure(self.device), writes_under(self.out, "the reward curve"):
            self.metrics.close()
        with agreed_outside_failure(self.device), writes_under(self.out, "the manifest"):
            self.manifest.update(finished=True)


def main(argv: list[str] | None = None, recipe_class: type | None = None) -> int:
    """Train a preset; returns the exit code (grpo/run_control.py). `recipe_class`: a FluxGRPORecipe subclass."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML preset, e.g. recipes/configs/tiny/grpo_lora.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. max_steps=10")
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    recipe = recipe_class or FluxGRPORecipe
    return run_control.main(lambda: recipe(load_config(args.config, args.overrides)))


if __name__ == "__main__":
    end_process(main())
