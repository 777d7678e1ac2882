"""Checks of a loaded recipe config that need no files and no world size: single-field ranges and cross-field
consistency (algorithm, SDE window, solver, run control), each failing with one line naming the setting and the fix.
grpo.config.load_config runs them once per start; the checks that need files or the world size are grpo/inputs.py's.
"""

from __future__ import annotations

from grpo.errors import ConfigError
from grpo.objectives import OBJECTIVES
from grpo.settings import RecipeSettings


def _positive(value: float, key: str, fix: str) -> None:
    if not value > 0:
        raise ConfigError(f"{key}: must be > 0, got {value}; {fix}")


def validate(cfg: RecipeSettings) -> None:
    """Single-field and cross-field checks that need no files and no world size."""
    _positive(cfg.max_steps, "max_steps", "set max_steps to the number of GRPO steps to run")
    s, b, a = cfg.sampling, cfg.batch, cfg.advantage
    if s.group_size < 2:
        raise ConfigError(f"sampling.group_size: {s.group_size} gives no group statistics; use at least 2")
    if s.num_steps < 2:
        raise ConfigError(f"sampling.num_steps: {s.num_steps} leaves no trainable transition; use at least 2")
    if s.eval_num_steps is not None and s.eval_num_steps < 1:
        raise ConfigError(f"sampling.eval_num_steps: {s.eval_num_steps}; use at least 1, or null for num_steps")
    if s.eta < 0:
        raise ConfigError(f"sampling.eta: {s.eta} is negative; use eta >= 0 (0 = ODE)")
    if s.sde == "cps" and s.eta > 1:
        raise ConfigError(f"sampling.eta: {s.eta} is above 1, the largest CPS noise level; Flow-GRPO uses 0.8")
    _validate_strategy(cfg)
    if isinstance(s.shift, str) and s.shift != "dynamic":
        raise ConfigError(f"sampling.shift: {s.shift!r}; use a number (e.g. 3.0) or dynamic")
    if not isinstance(s.shift, str):
        _positive(s.shift, "sampling.shift", "use a positive time shift such as 3.0")
    if s.guidance < 0:
        raise ConfigError(f"sampling.guidance: {s.guidance} is negative; FLUX.1-dev's distilled guidance is e.g. 3.5")
    if s.true_cfg is not None and s.true_cfg.scale <= 1:
        raise ConfigError(f"sampling.true_cfg.scale: {s.true_cfg.scale} is no guidance (the pipelines guide only "
                          "above 1); use e.g. 4.0 (Flux2KleinPipeline's default), or sampling.true_cfg=null for off")
    if s.true_cfg is not None and cfg.algorithm == "grpo" and not s.true_cfg.trains_guided:
        raise ConfigError("sampling.true_cfg.train: conditional, but grpo's ratio is between log-probs of the guided "
                          "transition the rollout sampled; set sampling.true_cfg.train=guided (or null)")
    if s.true_cfg is not None and cfg.algorithm != "grpo" and s.true_cfg.train is None:
        # both are sound on the forward process and the sources differ: the choice is the user's, not a default
        raise ConfigError(f"sampling.true_cfg.train: {cfg.algorithm} with true CFG trains either velocity; set "
                          "sampling.true_cfg.train=conditional (the conditional branch on guided samples; AWM's "
                          "train.cfg False) or guided (neg + scale*(cond - neg), AWM's train.cfg True)")
    if s.eval_cfg_scale is not None and s.eval_cfg_scale < 1:
        raise ConfigError(f"sampling.eval_cfg_scale: {s.eval_cfg_scale}; use 1.0 (evals without CFG), a scale above "
                          "1 (e.g. 4.0, Flux2KleinPipeline's default), or null (the rollouts' true CFG)")
    if s.resolution % 16:
        raise ConfigError(f"sampling.resolution: {s.resolution} must be a multiple of 16 (VAE x 2x2 packing)")
    for key, value in (
        ("batch.prompts_per_step", b.prompts_per_step),
        ("batch.micro_batch_size", b.micro_batch_size),
        ("batch.updates_per_step", b.updates_per_step),
    ):
        _positive(value, key, "use a positive integer")
    if b.rollout_micro_batch_size is not None:
        _positive(b.rollout_micro_batch_size, "batch.rollout_micro_batch_size",
                  "use a multiple of micro_batch_size, or null")
    _positive(a.clip, "advantage.clip", "DanceGRPO uses 5.0")
    _positive(a.eps, "advantage.eps", "Flow-GRPO uses 1e-4, DanceGRPO 1e-8")
    _validate_algorithm(cfg)
    _validate_optim_lora(cfg)
    if not cfg.rewards:
        raise ConfigError("rewards: empty; give at least one {name: weight}, e.g. {tiny_world: 1.0}")
    if cfg.data.max_sequence_length < 1:
        raise ConfigError("data.max_sequence_length: must be >= 1 (FLUX.1-dev uses 512)")
    _validate_text_encoder_placement(cfg)
    gc = cfg.model.gradient_checkpointing
    if not isinstance(gc, bool) and gc < 0:
        raise ConfigError(f"model.gradient_checkpointing: {gc}; use true (all blocks), false, or k >= 1 (every k-th)")
    if cfg.model.dtype not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"model.dtype: {cfg.model.dtype!r}; use fp32, bf16 or fp16")
    if cfg.model.compile:
        _check_cpp_compiler()
    _validate_run_control(cfg)
    _validate_profile(cfg)


def _validate_text_encoder_placement(cfg: RecipeSettings) -> None:
    caps = cfg.data.text_encoder_max_memory
    if caps is None:
        return
    if cfg.data.text_encoder_device_map is None:
        raise ConfigError("data.text_encoder_max_memory: caps only what data.text_encoder_device_map places; set "
                          "data.text_encoder_device_map=auto or data.text_encoder_max_memory=null")
    from accelerate.utils import convert_file_size_to_int  # the parser the caps are given to

    for name, size in (("device", caps.device), ("cpu", caps.cpu)):
        try:
            convert_file_size_to_int(0 if size is None else size)
        except ValueError:
            raise ConfigError(f"data.text_encoder_max_memory.{name}: {size!r} is not a size; write it like 16GiB, "
                              "500MiB or 40GB") from None


def _check_cpp_compiler() -> None:
    """model.compile: inductor builds its CPU kernels (and its wrappers on accelerators) with a C++ compiler at run
    time; without one the first forward would fail after the models are loaded."""
    import os
    import shutil

    if not any(shutil.which(c) for c in (os.environ.get("CXX"), "g++", "clang++", "c++") if c):
        raise ConfigError("model.compile: true needs a C++ compiler for torch.compile (none of $CXX, g++, clang++, c++ "
                          "is on PATH); install g++ or set model.compile=false")


def _validate_optim_lora(cfg: RecipeSettings) -> None:
    """AdamW, gradient clipping and the LoRA adapters' numbers (finiteness is the schema's)."""
    o = cfg.optim
    _positive(o.lr, "optim.lr", "e.g. 1e-5 full fine-tune, 3e-4 LoRA")
    _positive(o.max_grad_norm, "optim.max_grad_norm", "DanceGRPO uses 1.0")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        raise ConfigError(f"optim.betas: expected two numbers in [0, 1), got {o.betas}; e.g. [0.9, 0.999]")
    # eps divides the update by sqrt(v) + eps: 0 gives inf/nan on a parameter with no gradient yet
    _positive(o.eps, "optim.eps", "e.g. 1e-8")
    if o.weight_decay < 0:
        raise ConfigError(f"optim.weight_decay: {o.weight_decay} is negative (it would grow the weights); use 0 or "
                          "e.g. 1e-4")
    if o.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps: {o.warmup_steps} is negative; use 0 (off) or a number of optimizer "
                          "steps")
    if cfg.lora is not None:
        _positive(cfg.lora.rank, "lora.rank", "e.g. 8 (tiny) or 128 (FLUX.1-dev)")
        _positive(cfg.lora.alpha, "lora.alpha", "the update scale is alpha / rank; e.g. alpha = rank")
        if not 0 <= cfg.lora.dropout < 1:
            raise ConfigError(f"lora.dropout: {cfg.lora.dropout} must be in [0, 1); 0 = off")
        if not cfg.lora.target_modules:
            raise ConfigError("lora.target_modules: empty; list module names such as to_q, to_k, to_v, to_out.0")


def _validate_algorithm(cfg: RecipeSettings) -> None:
    """The section `algorithm` names is given and no other objective's; then the objective's own checks."""
    for name in OBJECTIVES:
        if name != cfg.algorithm and getattr(cfg, name) is not None:
            raise ConfigError(f"{name}: settings of algorithm {name}, but this preset's algorithm is {cfg.algorithm}; "
                              f"remove the {name} section (or set algorithm: {name})")
    if getattr(cfg, cfg.algorithm) is None:
        raise ConfigError(f"{cfg.algorithm}: required with algorithm {cfg.algorithm}; add the section (python -m "
                          "tools.check --help lists its keys)")
    objective = OBJECTIVES[cfg.algorithm]
    objective.check(cfg)
    if not objective.trains_transitions and cfg.sampling.window is not None:
        raise ConfigError(f"sampling.window: selects GRPO's trained transitions; set null for {cfg.algorithm}")


def _validate_strategy(cfg: RecipeSettings) -> None:
    """The SDE window, the solver after it and RatioNorm must fit the schedule and each other."""
    s, w = cfg.sampling, cfg.sampling.window
    if w is not None:
        bound = s.num_steps - 2  # the last two transitions are never trained (MixGRPO's max_timesteps)
        if not 1 <= w.size <= bound:
            raise ConfigError(f"sampling.window.size: {w.size}; use 1 .. num_steps - 2 = {bound}")
        keys = {"progressive": ("shift_every", "stride"), "random": ("high",), "group": ("high",)}
        for key in keys[w.placement]:
            if getattr(w, key) is None:
                raise ConfigError(f"sampling.window.{key}: required with placement {w.placement} (see --help)")
        for key in {"shift_every", "stride", "high"} - set(keys[w.placement]):
            if getattr(w, key) is not None:
                raise ConfigError(f"sampling.window.{key}: not read by placement {w.placement}; remove it")
        if w.placement == "progressive" and (w.shift_every < 1 or w.stride < 0):
            raise ConfigError(f"sampling.window: shift_every {w.shift_every} must be >= 1 and stride {w.stride} "
                              ">= 0 (MixGRPO: 25 and 1)")
        if w.placement != "progressive" and not w.size <= w.high <= s.num_steps - 1:
            raise ConfigError(f"sampling.window.high: {w.high}; use size .. num_steps - 1 = {s.num_steps - 1} "
                              f"(Flow-GRPO-Fast, Flash-GRPO: num_steps // 2)")
        if w.placement == "group":
            _validate_group_window(cfg)
    if s.tail == "dpm2":
        if w is None and _trains_transitions(cfg):
            raise ConfigError("sampling.tail: dpm2 replaces the steps after an SDE window (or, for nft and awm, the "
                              "ODE rollout's steps after its first); set sampling.window")
        if isinstance(s.shift, str):
            raise ConfigError("sampling.tail: dpm2 compresses a static schedule; set a numeric sampling.shift (e.g. 3)")
        if s.compress_ratio is None or not 0 < s.compress_ratio <= 1:
            raise ConfigError(f"sampling.compress_ratio: {s.compress_ratio}; dpm2 needs a ratio in (0, 1] "
                              "(MixGRPO-Flash: 0.4)")
    elif s.compress_ratio is not None:
        raise ConfigError("sampling.compress_ratio: only for sampling.tail: dpm2; remove it or set tail: dpm2")
    if s.candidates is not None:
        _validate_candidates(cfg)
    if s.branch is not None:
        _validate_branch(cfg)


def _validate_group_window(cfg: RecipeSettings) -> None:
    """A rollout micro-batch runs one schedule of SDE and ODE steps, so it must not cut a group's samples apart
    from their window: it holds whole groups or lies inside one."""
    s, rollout = cfg.sampling, cfg.batch.rollout_micro_batch
    if rollout % s.group_size and s.group_size % rollout:
        raise ConfigError(f"batch.rollout_micro_batch_size: {rollout} with sampling.window.placement group (one window "
                          f"per group): make it a multiple or a divisor of group_size {s.group_size}")
    if s.tail == "dpm2":
        raise ConfigError("sampling.tail: dpm2 after a window per group would give each group its own cost; use "
                          "tail: euler with placement group")


def _trains_transitions(cfg: RecipeSettings) -> bool:
    return OBJECTIVES[cfg.algorithm].trains_transitions


def _validate_branch(cfg: RecipeSettings) -> None:
    """BranchGRPO's tree: a group is one tree of Gaussian SDE steps from one root, every edge trained."""
    s, b = cfg.sampling, cfg.sampling.branch
    if not _trains_transitions(cfg) or s.window is not None:
        raise ConfigError("sampling.branch: tree rollouts are GRPO's over every SDE step; set algorithm: grpo and "
                          "sampling.window: null, or branch: null")
    if s.sde == "cps":
        raise ConfigError("sampling.branch: needs Gaussian SDE steps (sde dance or flow) without grpo.ratio_norm")
    ordered = bool(b.splits) and list(b.splits) == sorted(set(b.splits))
    if not ordered or not 0 <= b.splits[0] <= b.splits[-1] <= s.num_steps - 2:
        raise ConfigError(f"sampling.branch.splits: {b.splits}; list increasing steps in 0 .. num_steps - 2 = "
                          f"{s.num_steps - 2}, e.g. [0, 2]")
    if b.factor < 2 or s.group_size != b.factor ** len(b.splits):
        raise ConfigError(f"sampling.group_size: {s.group_size}; a tree with {len(b.splits)} splits of factor "
                          f"{b.factor} has {b.factor ** len(b.splits)} leaves (factor >= 2); make them equal")
    if not b.noise_scale > 0:
        raise ConfigError(f"sampling.branch.noise_scale: {b.noise_scale}; use a positive number, e.g. 1 (none) or 4")
    if not s.init_same_noise:
        raise ConfigError("sampling.init_same_noise: false, but a tree grows from one root per group; set true")
    if cfg.advantage.std_scope != "group" or cfg.advantage.per_reward:
        raise ConfigError("sampling.branch: advantages are normalised per tree and depth; set advantage.std_scope: "
                          "group and advantage.per_reward: false")


def _validate_candidates(cfg: RecipeSettings) -> None:
    """Candidate selection: the kept candidates are the group, each previewed from its own starting noise."""
    s, c = cfg.sampling, cfg.sampling.candidates
    if s.branch is not None:
        raise ConfigError("sampling.candidates: a tree grows its group from one root, there is no pool to select "
                          "from; set candidates: null or branch: null")
    if c.keep_top < 0 or c.keep_bottom < 0 or c.keep_top + c.keep_bottom != s.group_size:
        raise ConfigError(f"sampling.candidates: keep_top {c.keep_top} + keep_bottom {c.keep_bottom} must be "
                          f"group_size {s.group_size} (the kept candidates are the group); e.g. "
                          f"keep_top={s.group_size // 2}, keep_bottom={s.group_size - s.group_size // 2}")
    if c.pool <= s.group_size:
        raise ConfigError(f"sampling.candidates.pool: {c.pool} leaves nothing to select from {s.group_size} kept; "
                          f"use more, e.g. {4 * s.group_size} (Sol-RL keeps 24 of 96), or candidates: null")
    if not 1 <= c.preview_steps <= s.num_steps:
        raise ConfigError(f"sampling.candidates.preview_steps: {c.preview_steps}; use 1 .. num_steps = "
                          f"{s.num_steps} (Sol-RL: 6 of 10)")
    if s.init_same_noise:
        # one shared start would make every candidate's preview the same image (the preview is an ODE)
        raise ConfigError("sampling.init_same_noise: true, but candidate selection ranks candidates by their own "
                          "starting noise; set false")


def _validate_profile(cfg: RecipeSettings) -> None:
    """Profiled steps must be steps the run reaches."""
    bad = [s for s in cfg.profile.steps if not 0 <= s < cfg.max_steps]
    if bad:
        raise ConfigError(f"profile.steps: {bad[0]} is not a step of this run (0..{cfg.max_steps - 1}); "
                          "choose steps after the first, e.g. [2, 3]")
    if cfg.profile.ranks is not None and any(r < 0 for r in cfg.profile.ranks):
        raise ConfigError(f"profile.ranks: {cfg.profile.ranks} holds a negative rank; list ranks from 0, or null "
                          "for every rank")
    if not cfg.profile.dir.strip():
        raise ConfigError("profile.dir: empty; give a folder name under output_dir, e.g. profile")


def _validate_run_control(cfg: RecipeSettings) -> None:
    """Logging, checkpoint, EMA and fault settings."""
    for key, value in (("logging.sample_every", cfg.logging.sample_every),
                       ("logging.eval_every", cfg.logging.eval_every), ("checkpoint.every", cfg.checkpoint.every)):
        if value < 0:
            raise ConfigError(f"{key}: {value} is negative; use a number of steps (0 = never)")
    if cfg.logging.eval_seeds < 1:
        raise ConfigError(f"logging.eval_seeds: {cfg.logging.eval_seeds}; use at least 1 image per held-out prompt")
    if cfg.logging.collapse_alarm is not None:
        _positive(cfg.logging.collapse_alarm.sigmas, "logging.collapse_alarm.sigmas", "e.g. 3.0; or "
                  "logging.collapse_alarm=null for no alarm")
    if cfg.checkpoint.keep < 1:
        raise ConfigError(f"checkpoint.keep: {cfg.checkpoint.keep}; keep at least 1 checkpoint")
    if cfg.checkpoint.resume is not None and not cfg.checkpoint.resume.strip():
        raise ConfigError("checkpoint.resume: empty; use null (new run), auto, or a checkpoint folder")
    if cfg.perf.peak_tflops is not None:
        _positive(cfg.perf.peak_tflops, "perf.peak_tflops", "the device's dense TFLOP/s, e.g. 989.4 (H100 SXM, bf16); "
                  "or null for the table's")
    if cfg.ema.decay is not None and not 0 < cfg.ema.decay < 1:
        raise ConfigError(f"ema.decay: {cfg.ema.decay} must be in (0, 1), e.g. 0.99; or null for no EMA")
    if cfg.faults.max_consecutive_skips < 1:
        raise ConfigError(f"faults.max_consecutive_skips: {cfg.faults.max_consecutive_skips}; use at least 1")
    _positive(cfg.faults.comm_timeout_s, "faults.comm_timeout_s", "e.g. 1800 (seconds)")
