"""The recipe's settings sections: typed dataclasses whose fields carry their help and rules (grpo/schema.py's
`setting`), and nothing else.

A leaf of the import graph: it imports the schema alone (no objective, no torch), so any module can annotate with
these classes without an import circle (tests/unit/test_layering.py). grpo/config.py assembles the recipe's settings
from them, RecipeConfig: RecipeSettings plus one section per objective of the registry (grpo/objectives/: cfg.grpo,
cfg.nft, cfg.awm), and loads, checks and dumps it. Code that runs below the registry (the objectives, the checks,
the sampler) annotates a recipe config with RecipeSettings; at run time it is a RecipeConfig.

Presets state *global* quantities (prompts per step, group size); everything per rank is derived from the world size
(grpo/layout.py), so one preset runs on 1, 2, 8 or 64 processes. Only switches that are off have defaults; every
tuning value is required, so a preset shows everything it uses. `python -m tools.check --help` lists every setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from grpo.schema import setting

FREE = "free"  # may differ between a run and its resumption: where and how long it runs, logging, checkpoints, faults


@dataclass(kw_only=True)
class ModelConfig:
    path: str = setting(help="hub id (black-forest-labs/FLUX.1-dev) or a local folder in diffusers layout", path=True)
    revision: str | None = setting(None, help="hub revision of model.path; null = the default branch")
    dtype: str = setting(help="frozen parts (VAE) and rollout activations: fp32, bf16 or fp16; the policy follows "
                              "the DeepSpeed precision")
    attention_backend: str = setting(help="diffusers attention backend: native (SDPA), _native_npu, flash, ...")
    gradient_checkpointing: bool | int = setting(
        False, resume=FREE, help="recompute activations in the update: true = every block, k = every k-th, false = none")
    zero_init: bool = setting(
        resume=FREE, help="build the transformer in deepspeed.zero.Init and fill it from the shards (a node holds ~one "
                          "host copy); false = from_pretrained on every process")
    offload_vae: bool = setting(False, resume=FREE, help="keep the VAE on the CPU except while decoding")
    compile: bool = setting(
        False, resume=FREE,
        help="torch.compile each FLUX transformer block (regional compilation, diffusers' compile_repeated_blocks) "
             "for the rollout and the update; compile time is logged apart as time/compile_s")
    deterministic: bool = setting(
        True, resume=FREE,
        help="NPU/CUDA: deterministic kernels (torch.use_deterministic_algorithms, warn_only), so that the first "
             "pass's ratio is 1 to within clip_range; no effect on CPU, whose kernels are already run-to-run exact")


@dataclass(kw_only=True)
class LoraConfig:
    rank: int = setting(help="LoRA rank r, e.g. 16 (tiny) or 128 (FLUX.1-dev)")
    alpha: float = setting(help="LoRA scale numerator: updates are scaled by alpha / rank")
    dropout: float = setting(0.0, help="dropout on the LoRA input; 0 = off")
    init: str = setting(help="PEFT init_lora_weights, e.g. gaussian")
    target_modules: list[str] = setting(help="transformer module names that get adapters, e.g. [to_q, to_k, to_v, "
                                             "to_out.0]")
    # free: it sets the adapters of step 0 only; a resumed run's come from its checkpoint
    init_from: str | None = setting(
        None, resume=FREE, path=True,
        help="start from an existing LoRA: a diffusers LoRA file or folder, or a ComfyUI/kohya .safetensors, of the "
             "same rank, alpha and targets; null = PEFT's init (lora.init)")


@dataclass(kw_only=True)
class MemoryCaps:
    device: str | None = setting(None, help="weights on each accelerator, e.g. 16GiB, leaving the rest for the "
                                            "activations; null = its free memory")
    cpu: str | None = setting(None, help="weights in host RAM, e.g. 100GiB; the layers beyond go to disk; null = the "
                                         "free RAM")


@dataclass(kw_only=True)
class DataConfig:
    train_prompts: str = setting(help="your prompt file: a text file with one training prompt per line, or a dataset "
                                      "with per-sample metadata (.jsonl, .parquet, a datasets folder, a hub id; "
                                      "docs/operations.md) (the presets of real models name none: add "
                                      "data.train_prompts=PATH to the command)",
                                 path=True)
    # Required, no default, as train_prompts: a default file would be the tiny world's, and a real run would report its
    # reward on "a red square" every eval.
    eval_prompts: str | None = setting(resume=FREE, path=True,
                                       help="held-out prompts: a dataset or prompt file, or null for no held-out eval; "
                                            "add data.eval_prompts=PATH (or null) to the command (the presets of real "
                                            "models name none)")
    cache_dir: str = setting(resume=FREE, path=True,
                             help="precomputed prompt embeddings (safetensors), keyed by model + prompts")
    max_sequence_length: int = setting(help="text-encoder tokens per prompt (T5 for FLUX.1, Qwen3/Mistral for FLUX.2); "
                                            "the pipelines use 512")
    text_encoder_dtype: str = setting(choices=("fp32", "bf16", "fp16"),
                                      help="dtype the prompts are encoded in (once, into the cache): bf16 for FLUX.2 "
                                           "[dev]'s 24 B encoder (48 GB instead of 96)")
    text_encoder_device_map: str | None = setting(
        None, resume=FREE, choices=("auto", "balanced", "sequential"),
        help="tools.prompts: each text encoder spread over the visible accelerators, then host RAM, then disk, by "
             "transformers' device_map (auto = balanced; sequential fills one device first); null = all of it on the "
             "recipe's device. Not in the cache key: the same embeddings")
    text_encoder_max_memory: MemoryCaps | None = setting(
        None, resume=FREE, help="caps for text_encoder_device_map, e.g. {device: 16GiB, cpu: 100GiB}; null = "
                                "accelerate's defaults (what is free; auto and balanced leave 10% of a lone "
                                "accelerator)")


@dataclass(kw_only=True)
class WindowConfig:
    placement: str = setting(choices=("progressive", "random", "group"),
                             help="progressive: the window slides over the steps as training goes on (MixGRPO); "
                                  "random: a new seeded start every GRPO step (Flow-GRPO-Fast); group: a seeded "
                                  "start per prompt group, shared by its samples (Flash-GRPO: size 1)")
    size: int = setting(help="SDE steps per rollout, all of them trained (MixGRPO: 4; Flow-GRPO-Fast: 3)")
    shift_every: int | None = setting(None, help="progressive: GRPO steps before the window moves (MixGRPO tau: 25)")
    stride: int | None = setting(None, help="progressive: steps the window moves each time (MixGRPO: 1); 0 = fixed "
                                            "at the first steps (MixGRPO-Flash*)")
    high: int | None = setting(None, help="random, group: starts are drawn from [0, high - size] (Flow-GRPO-Fast "
                                          "and Flash-GRPO: num_steps // 2)")


@dataclass(kw_only=True)
class BranchConfig:
    splits: list[int] = setting(help="steps at which every node branches, increasing, in 0 .. num_steps - 2 "
                                     "(BranchGRPO: 0, 3, 6, 9 of 20); group_size = factor ** len(splits)")
    factor: int = setting(help="children per node at a split (BranchGRPO: 2)")
    noise_scale: float = setting(help="std multiplier at split steps, for sampling and log-prob alike "
                                      "(BranchGRPO's split_noise_scale: 4.0 with eta 0.3)")


@dataclass(kw_only=True)
class CandidatesConfig:
    pool: int = setting(help="candidates rolled out per prompt by the preview, each from its own starting noise "
                             "(Sol-RL: 96)")
    keep_top: int = setting(help="highest-scoring candidates of a prompt's pool kept and trained (Sol-RL: 12)")
    keep_bottom: int = setting(help="lowest-scoring candidates kept and trained (Sol-RL: 12); keep_top + "
                                    "keep_bottom = group_size")
    preview_steps: int = setting(help="ODE steps of the preview that scores the pool, at most num_steps (Sol-RL: 6 "
                                      "of 10)")


@dataclass(kw_only=True)
class TrueCFGConfig:
    scale: float = setting(help="the guidance w, above 1 (Flux2KleinPipeline's guidance_scale: 4.0 by default)")
    negative_prompt: str = setting("", help="the negative prompt, encoded once like the prompts (Flux2KleinPipeline's "
                                            "is \"\")")
    train: str | None = setting(
        None, choices=(None, "guided", "conditional"),
        help="the velocity the update trains: guided = neg + scale * (cond - neg), both branches under grad (grpo "
             "always: its log-probs are the guided transition's; AWM's train.cfg: True); conditional = the "
             "conditional branch alone, on samples rolled out with CFG (AWM's train.cfg: False; DiffusionNFT trains "
             "it too, and rolls out without CFG). nft and awm must choose; null = guided for grpo")

    @property
    def trains_guided(self) -> bool:
        return self.train != "conditional"


@dataclass(kw_only=True)
class SamplingConfig:
    resolution: int = setting(help="image side in pixels, a multiple of 16")
    num_steps: int = setting(help="denoising steps per rollout")
    eval_num_steps: int | None = setting(
        None, resume=FREE, help="steps of the held-out evals (eta 0, the same shift); null = num_steps. Fewer rollout "
                                "steps than eval steps is Flow-GRPO's denoising reduction (10 for training, "
                                "eval_num_steps 40)")
    eta: float = setting(help="SDE noise of the rollouts: > 0 for grpo; 0 (ODE rollouts) or more for nft/awm; eval "
                              "always uses 0 (deterministic ODE)")
    sde: str = setting(choices=("dance", "flow", "cps"),
                       help="dance: g = eta (DanceGRPO); flow: g = eta*sqrt(sigma/(1-sigma)) (Flow-GRPO); cps: "
                            "coefficients-preserving sampling, eta = noise level in (0, 1] (Flow-GRPO's CPS)")
    shift: float | str = setting(help="static SD3 time shift, or dynamic for diffusers' resolution-dependent shift")
    guidance: float = setting(help="FLUX.1-dev distilled guidance embedding")
    true_cfg: TrueCFGConfig | None = setting(
        None, help="true classifier-free guidance: every velocity of the rollouts and the evals (and of the update, "
                   "with train: guided) is neg + scale * (cond - neg), the two branches two calls, as "
                   "Flux2KleinPipeline guides a non-distilled model; null = off (one conditional forward). Models "
                   "without a guidance embedding only")
    eval_cfg_scale: float | None = setting(
        None, resume=FREE, help="the held-out evals' true CFG, the inference setting a user samples with: null = the "
                                "rollouts' (true_cfg's scale, or none); 1.0 = none; above 1 = that scale, with "
                                "true_cfg's negative prompt (\"\" when true_cfg is null)")
    group_size: int = setting(help="images per prompt (G), at least 2")
    init_same_noise: bool = setting(help="a group shares its initial noise (DanceGRPO's init_same_noise)")
    window: WindowConfig | None = setting(
        None, help="SDE window: only its steps are stochastic and trained, the others deterministic ODE steps "
                   "(MixGRPO, Flow-GRPO-Fast); null = every step SDE, grpo.timestep_fraction of them trained")
    tail: str = setting("euler", choices=("euler", "dpm2"),
                        help="steps after the window (nft/awm: after the rollout's first step): euler (the "
                             "schedule's own steps) or dpm2 (MixGRPO-Flash's tail, DiffusionNFT's rollout solver: "
                             "DPM-Solver++(2M) on a schedule compressed by compress_ratio); evals keep the schedule")
    compress_ratio: float | None = setting(None, help="dpm2: the tail keeps floor((num_steps - L) * ratio) points, "
                                                      "at least 2 (MixGRPO-Flash: 0.4)")
    branch: BranchConfig | None = setting(
        None, help="BranchGRPO's tree rollouts: each group is one tree from a shared root, computed once per node; "
                   "per-depth advantages; every edge trained; null = independent trajectories")
    candidates: CandidatesConfig | None = setting(
        None, help="candidate selection (Sol-RL): per prompt a pool of candidates previewed with fewer ODE steps and "
                   "scored; the best and worst become the group, rolled out in full from their own noise and trained; "
                   "null = the group is rolled out directly")

    @property
    def negative_prompt(self) -> str | None:
        """The negative prompt that must be encoded: true CFG's, in the rollouts or the evals; None = none guides."""
        if self.true_cfg is not None:
            return self.true_cfg.negative_prompt
        return "" if self.eval_cfg_scale is not None and self.eval_cfg_scale > 1 else None

    @property
    def sampled_calls(self) -> int:
        """Transformer calls per velocity of the rollouts and previews: true CFG's two branches, or one."""
        return 1 if self.true_cfg is None else 2

    @property
    def trained_calls(self) -> int:
        """Transformer calls per velocity the update trains (and the reference and lagging velocities it compares
        with): two when true CFG trains the guided velocity (grpo always; nft/awm with train: guided), else one."""
        return 2 if self.true_cfg is not None and self.true_cfg.trains_guided else 1

    @property
    def eval_true_cfg(self) -> TrueCFGConfig | None:
        """The held-out evals' true CFG (eval_cfg_scale): the rollouts', none, or that scale."""
        if self.eval_cfg_scale is None:
            return self.true_cfg
        if self.eval_cfg_scale == 1:
            return None
        return TrueCFGConfig(scale=self.eval_cfg_scale, negative_prompt=self.negative_prompt)


@dataclass(kw_only=True)
class BatchConfig:
    prompts_per_step: int = setting(help="prompts per GRPO step, global over all processes")
    micro_batch_size: int = setting(help="per process: the update's micro-batch (and the rollout's unless set)")
    rollout_micro_batch_size: int | None = setting(
        None, help="rollout/eval micro-batch per process, a multiple of micro_batch_size; null = micro_batch_size, "
                   "which keeps the first-pass ratio exactly 1 (a larger one only up to rounding)")
    updates_per_step: int = setting(help="optimizer steps per GRPO step; the first one is exactly on-policy")

    @property
    def rollout_micro_batch(self) -> int:
        return self.rollout_micro_batch_size or self.micro_batch_size


@dataclass(kw_only=True)
class AdvantageConfig:
    clip: float = setting(help="advantages are clipped to [-clip, clip] (DanceGRPO, Flow-GRPO adv_clip_max: 5.0); nft "
                               "and awm also scale by it")
    std_scope: str = setting(choices=("group", "batch"),
                             help="divide by the std of the prompt's group (DanceGRPO), or of the whole batch "
                                  "(Flow-GRPO's global_std, DiffusionNFT, AWM); both ddof=1 here, where Flow-GRPO's "
                                  "global and per-prompt std are np.std (ddof=0)")
    eps: float = setting(help="added to the std (Flow-GRPO, DiffusionNFT, AWM: 1e-4; DanceGRPO: 1e-8)")
    per_reward: bool = setting(
        False, help="MixGRPO's aggregation: each reward's in-group z-score, weighted and summed, is the advantage "
                    "(no second normalisation); false = the weighted sum of the raw rewards is normalised")


@dataclass(kw_only=True)
class OptimConfig:
    lr: float = setting(help="AdamW learning rate, e.g. 1e-5 full fine-tune, 3e-4 LoRA")
    weight_decay: float = setting(help="AdamW weight decay")
    betas: list[float] = setting(help="AdamW betas, two numbers in [0, 1)")
    eps: float = setting(help="AdamW epsilon")
    max_grad_norm: float = setting(help="gradient clipping norm (DanceGRPO: 1.0)")
    warmup_steps: int = setting(0, help="linear LR warm-up in optimizer steps; 0 = off")
    fused: bool | None = setting(
        None, resume=FREE, help="torch's fused AdamW kernel (one pass per tensor, no temporaries); null = on for CPU "
                                "and CUDA, off for NPU, where torch_npu's support depends on its version (set true "
                                "to try it)")


@dataclass(kw_only=True)
class DeepSpeedConfig:
    config: str = setting(path=True, help="ds_configs/*.json: sharding, offload and precision; the recipe fills in "
                                          "the batch fields")
    gather_for_rollout: bool = setting(
        resume=FREE, help="gather the full weights once per rollout/eval phase instead of layer by layer at every "
                          "denoising step: much faster, but each device briefly holds one full copy")
    fetch_blocks: bool = setting(
        resume=FREE, help="ZeRO-3 gathers each FLUX block's weights at once instead of module by module (DeepSpeed "
                          "leaf modules): fewer hooks, the same math up to rounding, one block in flight")


@dataclass(kw_only=True)
class CollapseAlarmConfig:
    sigmas: float = setting(3.0, help="warn when a held-out eval falls below the best one by more than this many "
                                      "paired standard errors (image by image: the evals share their images' noise)")
    stop: bool = setting(False, help="also stop there: save a checkpoint and end the run (exit 0), best/ holding the "
                                     "best eval's weights")


@dataclass(kw_only=True)
class LoggingConfig:
    sample_every: int = setting(help="a grid of rollout images every N steps; 0 = never")
    eval_every: int = setting(help="held-out eval (eta 0, fixed noise) every N steps, and before step 0 and after "
                                   "the last")
    eval_seeds: int = setting(help="images per held-out prompt, each from its own fixed noise")
    collapse_alarm: CollapseAlarmConfig | None = setting(
        factory=CollapseAlarmConfig, help="the collapse alarm on the held-out evals (grpo/best.py), e.g. {sigmas: 3.0, "
                                          "stop: false}; null = off")
    tensorboard: bool = setting(help="write TensorBoard event files under output_dir")
    wandb: bool = setting(False, help="also log to Weights & Biases (pip install wandb; project from WANDB_PROJECT)")
    progress: bool = setting(help="tqdm bars on rank 0 for the rollout and update phases")


@dataclass(kw_only=True)
class CheckpointConfig:
    every: int = setting(help="resumable checkpoint every N steps and after the last")
    keep: int = setting(help="newest complete checkpoints kept; older ones are deleted once a newer one is complete")
    resume: str | None = setting(None, path=True, help="null = a new run (output_dir absent or empty); auto = the "
                                                       "newest valid checkpoint under output_dir; or a checkpoint folder")


@dataclass(kw_only=True)
class EMAConfig:
    decay: float | None = setting(None, help="EMA of the trained weights, e.g. 0.99; null = off. Eval, the final "
                                             "export and tools.export use the EMA weights")


@dataclass(kw_only=True)
class FaultsConfig:
    max_consecutive_skips: int = setting(help="GRPO steps in a row with a skipped update (non-finite reward, loss or "
                                              "gradient) before the run checkpoints and stops with an error")
    comm_timeout_s: float = setting(help="a collective waiting longer (a dead or hung rank) fails the run; must exceed "
                                         "the longest stretch one rank works alone (eval grids, checkpoint hashing)")


@dataclass(kw_only=True)
class ExportConfig:
    formats: list[str] = setting(["diffusers"], help="the final LoRA's files in final/lora/: diffusers "
                                                     "(pytorch_lora_weights.safetensors) and/or comfyui "
                                                     "(comfyui_lora.safetensors, kohya/BFL keys)")


@dataclass(kw_only=True)
class ProfileConfig:
    steps: list[int] = setting([], help="GRPO steps traced with torch.profiler into output_dir/<dir>/, e.g. [2, 3] "
                                        "(after the warm-up step); [] = off")
    dir: str = setting("profile", help="folder under output_dir for the traces")
    ranks: list[int] | None = setting([0], help="ranks that trace; null = every rank")
    record_shapes: bool = setting(False, help="record operator input shapes")
    profile_memory: bool = setting(False, help="record tensor allocations")
    with_stack: bool = setting(False, help="record Python call stacks (much larger traces)")


@dataclass(kw_only=True)
class PerfConfig:
    peak_tflops: float | None = setting(None, help="the device's peak dense TFLOP/s in the trained precision, for "
                                                   "perf/mfu/*; null = from grpo/perf.py's table of accelerators "
                                                   "(unknown devices and CPUs: MFU is not logged)")


@dataclass(kw_only=True)
class RecipeSettings:
    """Every section of the recipe's settings but the objective's own, which RecipeConfig (grpo/config.py) adds from
    the registry; `algorithm` names that objective (RecipeConfig checks it against the registry)."""

    output_dir: str = setting(resume=FREE, path=True, help="run folder: logs, samples, checkpoints, final weights")
    max_steps: int = setting(resume=FREE, help="GRPO steps to run")
    seed: int = setting(help="every random draw is a function of (seed, step, sample index)")
    model: ModelConfig = setting(help="the FLUX model")
    lora: LoraConfig | None = setting(help="LoRA adapters; null = full fine-tune (lora.rank=N on a full preset "
                                           "switches LoRA on with rank 8, alpha 16, q/k/v/out targets for keys not given)")
    data: DataConfig = setting(help="prompt files and the embedding cache")
    sampling: SamplingConfig = setting(help="rollouts")
    batch: BatchConfig = setting(help="global batch and micro-batches")
    algorithm: str = setting(help="the objective (grpo/objectives/): grpo (clipped ratio of SDE transitions), nft "
                                  "(DiffusionNFT) or awm (advantage-weighted matching); its settings are the section "
                                  "of the same name, everything else is shared")
    rewards: dict[str, Any] = setting(help="{name: weight} or {name: {weight: w, option: value}}; see Reward options")
    advantage: AdvantageConfig = setting(help="group-relative advantages, shared by every objective")
    optim: OptimConfig = setting(help="AdamW and gradient clipping")
    deepspeed: DeepSpeedConfig = setting(help="DeepSpeed ZeRO-3")
    logging: LoggingConfig = setting(resume=FREE, help="metrics, samples and eval")
    checkpoint: CheckpointConfig = setting(resume=FREE, help="resumable checkpoints")
    ema: EMAConfig = setting(resume=FREE, factory=EMAConfig, help="exponential moving average of the weights")
    faults: FaultsConfig = setting(resume=FREE, help="handling of non-finite steps and hung ranks")
    profile: ProfileConfig = setting(resume=FREE, factory=ProfileConfig, help="torch.profiler traces")
    export: ExportConfig = setting(resume=FREE, factory=ExportConfig, help="the final weights' file formats")
    perf: PerfConfig = setting(resume=FREE, factory=PerfConfig, help="model FLOPs utilisation (grpo/perf.py)")
