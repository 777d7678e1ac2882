"""The recipe under ZeRO-3 on 1 and 2 CPU processes (gloo): on-policy ratio, world-size invariance, references.

Each case runs one GRPO step of the real recipe through torchrun (tests/recipe/one_step.py) on the embedded tiny FLUX.
"""

import pytest
import torch

from tests import ROOT, TINY
from tests.recipe.launch import run_recipe

SMALL = [
    f"model.path={TINY}",
    "batch.prompts_per_step=4", "sampling.group_size=4", "batch.micro_batch_size=4",  # 16 images, micro-batch 4
    "sampling.num_steps=4", "grpo.timestep_fraction=1.0",
    "data.eval_prompts=null", "logging.tensorboard=false", "logging.sample_every=0",
    "deepspeed.config=ds_configs/zero3_fp32.json", "seed=3",
]


def one_step(tmp_path, nproc: int, config: str, extra: list[str]) -> dict:
    out = tmp_path / f"step_{nproc}.pt"
    proc = run_recipe(str(ROOT / config), [*SMALL, f"output_dir={tmp_path / f'run{nproc}'}",
                                           f"data.cache_dir={tmp_path / 'cache'}", *extra],
                      nproc, script=[str(ROOT / "tests" / "recipe" / "one_step.py"), str(out)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    return {n: one_step(tmp, n, "recipes/configs/tiny/grpo_lora.yaml", ["optim.lr=1e-2"]) for n in (1, 2)}


class _Runs(dict):
    """nproc -> the step's result, each run made when a test first asks for it."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, nproc: int) -> dict:
        self[nproc] = self.make(nproc)
        return self[nproc]


@pytest.fixture(scope="module")
def full_kl_runs(tmp_path_factory):
    """Full fine-tune with a sharded reference; ZeRO-3 fetches whole blocks here (deepspeed.fetch_blocks), so the
    invariants below hold for that path too (the LoRA runs keep the module-by-module default). The 1-process run is
    made only by the comparison with 2 (-m slow: CI time; the LoRA runs compare 1 and 2 in the default tier)."""
    tmp = tmp_path_factory.mktemp("full")
    return _Runs(lambda n: one_step(tmp, n, "recipes/configs/tiny/grpo_full.yaml",
                                    ["grpo.kl_coef=0.5", "optim.lr=1e-3", "batch.updates_per_step=2",
                                     "deepspeed.fetch_blocks=true"]))


def test_ratio_is_one_on_the_first_pass_with_batched_rollouts(lora_runs, full_kl_runs):
    for runs in (lora_runs, full_kl_runs):
        assert runs[2]["stats"]["ratio_max_dev"] <= 1e-5, runs[2]["stats"]
    assert lora_runs[2]["stats"]["clip_frac"] == 0.0  # one update per step: every transition is on-policy
    # Per transition too: timestep_fraction 1 trains all three of the 4-step trajectory.
    per_step = {k: v for k, v in lora_runs[2]["stats"].items() if k.startswith("ratio_dev/")}
    assert set(per_step) == {f"ratio_dev/t{j:02d}_{m}" for j in range(3) for m in ("max", "mean")}, per_step
    assert set(per_step.values()) == {0.0}
    assert full_kl_runs[2]["stats"]["clip_frac"] > 0.0  # the second update block is off-policy and gets clipped


def assert_same_step(one: dict, two: dict, rel: float = 1e-5, max_abs: float = 1e-5) -> None:
    """The same rewards, advantages and (up to rounding) updated weights on 1 and on 2 processes."""
    assert two["world"] == 2
    torch.testing.assert_close(two["rewards"], one["rewards"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(two["advantages"], one["advantages"], rtol=1e-5, atol=1e-5)
    # The loss and the gradient it makes agree to float rounding; Adam's first step can amplify rounding (below).
    for key in ("loss", "grad_norm"):
        assert two["stats"][key] == pytest.approx(one["stats"][key], rel=1e-5, abs=1e-9), key
    assert set(one["after"]) == set(two["after"])
    moved = 0
    for name, w1 in one["after"].items():
        w2 = two["after"][name]
        # Relative to the tensor's norm: Adam's first step is ~lr*sign(g), so an element whose gradient is ~0 can
        # move by rounding-level amounts (seen: 7 of 115k elements, 2e-7 absolute, at lr 1e-2).
        assert (w2 - w1).norm() <= rel * w1.norm(), name
        assert (w2 - w1).abs().max() <= max_abs, name  # 1e-5: 0.1% of one Adam step at lr 1e-2
        moved += int(not torch.equal(w1, one["before"][name]))
    assert moved > 0  # the step did update the weights


@pytest.mark.parametrize("which", ["lora", pytest.param("full", marks=pytest.mark.slow)])
def test_same_step_on_one_and_two_processes(lora_runs, full_kl_runs, which):
    runs = lora_runs if which == "lora" else full_kl_runs
    assert_same_step(runs[1], runs[2])


# The strategy and objective presets, each with one more option switched on where it fits: MixGRPO-Flash with
# GRPO-Guard's RatioNorm (Flow-SDE), Flow-GRPO-Fast with CPS and two updates a step (so the second block is
# off-policy), BranchGRPO's trees with a KL to the base model (per edge), DiffusionNFT with its KL to the base model,
# AWM with its EMA anchor, DPM-Solver++(2M) rollouts and one noise per group (group_noise, as nft_candidates). The
# last number is the step's forwards per image: the step-0
# window is [0, 2), so Flash's tail has floor((6 - 1) * 0.5) = 2 points (one solver step after the window); Flash*'s
# window is [0, 1) at every step, with floor(6 * 0.5) = 3 tail points (two solver steps) and one trained transition,
# as AWM's rollout (an Euler step, then two solver steps); a tree of 4 pays per node (17 rollout calls, 13 trained
# edges' parents); nft rolls out all 6 steps; then per noise level 3 + the lagging forward (+ the KL's). Candidate
# selection (Sol-RL) previews a pool of 8 per prompt in 3 ODE steps: 8 x 3 / 4 = 6 more per trained image. Flash-GRPO
# rolls out 6 steps and trains the one SDE step of each group (+ the KL's reference forward), in micro-batches of half
# a group, so each group's window is drawn once and read by two micro-batches.
PRESETS = {
    "mixgrpo_flash": ("recipes/configs/tiny/mixgrpo_flash_lora.yaml", ["grpo.ratio_norm=true"], 3 + 3 * 2),
    "flash_frozen": ("recipes/configs/experimental/tiny_mixgrpo_flash_frozen_lora.yaml", [], 1 + 2 + 3 * 1),
    "flowgrpo_fast": ("recipes/configs/tiny/flowgrpo_fast_lora.yaml", ["batch.updates_per_step=2"], 6 + 3 * 2),
    "branchgrpo": ("recipes/configs/tiny/branchgrpo_lora.yaml", ["grpo.kl_coef=0.1"], (17 + 13 * (3 + 1)) / 4),
    "nft": ("recipes/configs/tiny/nft_lora.yaml", ["nft.kl_coef=1e-4"], 6 + 2 * (3 + 1 + 1)),
    "awm": ("recipes/configs/tiny/awm_lora.yaml", ["sampling.tail=dpm2", "sampling.compress_ratio=0.5",
                                                   "awm.group_noise=true"], 3 + 2 * (3 + 1)),
    "awm_no_anchor": ("recipes/configs/tiny/awm_lora.yaml", ["awm.anchor_coef=0", "awm.timesteps=1"], 6 + 1 * 3),
    "flashgrpo": ("recipes/configs/tiny/flashgrpo_lora.yaml", ["grpo.kl_coef=0.1", "batch.micro_batch_size=2"],
                  6 + 1 * (3 + 1)),
    "grpo_candidates": ("recipes/configs/experimental/tiny_grpo_candidates_lora.yaml", [], 6 + 6 + 5 * 3),
    "nft_candidates": ("recipes/configs/tiny/nft_candidates_lora.yaml", ["nft.group_noise=true"], 6 + 6 + 2 * (3 + 1)),
}
# With -m slow (CI time): the same code paths as another preset's (awm_no_anchor is awm's step less the anchor's
# forward), or as another default-tier run's (nft: tests/recipe/test_matching_runs.py; awm:
# tests/recipe/test_norm_guard_runs.py; MixGRPO-Flash's and Flash-GRPO's windows: the same transition code as
# flowgrpo_fast's window, their own parts in process in tests/unit/test_fast.py and test_flash.py). Their costs: the
# closed forms of tests/unit/test_rollout_plan.py. grpo_candidates: an experimental preset (recipes/configs/experimental/),
# its selection in process in tests/unit/test_candidates.py.
SLOW_PRESETS = ("flash_frozen", "nft_candidates", "awm_no_anchor", "mixgrpo_flash", "flashgrpo", "nft", "awm",
                "grpo_candidates")


# MixGRPO-Flash* is MixGRPO-Flash with its window frozen, nft_candidates grpo_candidates' selection on nft's step.
@pytest.fixture(scope="module", params=[pytest.param(k, marks=pytest.mark.slow) if k in SLOW_PRESETS else k
                                        for k in PRESETS])
def preset_runs(request, tmp_path_factory):
    """The preset's step on 2 processes; the 1-process run is made only by the test that compares them (-m slow)."""
    tmp = tmp_path_factory.mktemp(request.param)
    return request.param, tmp, {2: _preset_step(tmp, request.param, 2)}


def _preset_step(tmp, name: str, nproc: int) -> dict:
    preset, extra, _ = PRESETS[name]
    # SMALL keeps 4 steps; the windows need 6 (two trained, MixGRPO's last two never).
    return one_step(tmp, nproc, preset, ["optim.lr=1e-2", "sampling.num_steps=6", *extra])


def _assert_first_pass(name: str, stats: dict) -> None:
    if not name.startswith(("nft", "awm")):
        assert stats["ratio_max_dev"] == 0.0, stats
    else:
        assert "ratio_max_dev" not in stats  # no transition log-prob: nothing to log


def test_strategies_and_objectives_keep_the_first_pass_ratio_and_their_cost(preset_runs):
    """Windowed SDE (MixGRPO / Flow-GRPO-Fast), the DPM-Solver++ tail, CPS, RatioNorm, DiffusionNFT and AWM (with
    DPM-Solver++ rollouts) on 2 processes: the first-pass ratio is exactly 1 where there is one, and the step costs
    the forwards its plan says."""
    name, _, runs = preset_runs
    _assert_first_pass(name, runs[2]["stats"])
    assert runs[2]["stats"]["forwards_per_image"] == PRESETS[name][2]
    if name == "flowgrpo_fast":
        assert runs[2]["stats"]["clip_frac"] > 0.0  # the second, off-policy block is clipped at 1e-5
    if name.endswith("_candidates"):  # the kept best and worst of each pool are apart in the preview
        assert runs[2]["stats"]["candidates/kept_preview_spread"] > 0.0


# CI time: one more run per preset (~30 s each on 2 cores). The default tier keeps 1 vs 2 processes for plain grpo
# (LoRA, and full with fetch_blocks and a reference) above and for FLUX.2 (tests/recipe/test_flux2_runs.py).
@pytest.mark.slow
def test_strategies_and_objectives_are_the_same_on_one_and_two_processes(preset_runs):
    name, tmp, runs = preset_runs
    runs[1] = _preset_step(tmp, name, 1)
    _assert_first_pass(name, runs[1]["stats"])
    # With RatioNorm the loss and the gradient norm agree to 1e-11, but its 1/dt reweighting makes the gradients
    # ~10x larger and more elements sit near Adam's sign flip: measured 1.1e-5 of the norm (max 5e-6 absolute).
    # NFT on the tiny world v2: one element of a LoRA B whose gradient is ~0 moved 1.6e-5 (0.16% of one Adam step,
    # 3.6e-5 of the tensor's norm), while the loss and the gradient norm agree to rounding.
    # AWM on the EPYC host (AVX2; the one-process run all-reduces, the two-process run reduce-scatters): one LoRA B
    # moved 1.26e-5 of its norm (max 5.6e-6 absolute, 0.06% of one Adam step), with the gradient norm equal to 2.5e-9.
    rel, max_abs = {"mixgrpo_flash": (3e-5, 1e-5), "awm": (3e-5, 1e-5), "nft": (1e-4, 1e-4)}.get(
        name.removesuffix("_candidates").removesuffix("_no_anchor"), (1e-5, 1e-5))  # awm_no_anchor: the same 1.26e-5
    assert_same_step(runs[1], runs[2], rel=rel, max_abs=max_abs)
    # candidate selection: the same previews, so the same candidates kept (the rewards above are theirs)
    for key in (k for k in runs[2]["stats"] if k.startswith("candidates/")):
        assert runs[1]["stats"][key] == runs[2]["stats"][key], key


def test_lora_reference_is_the_base_model(lora_runs):
    r = lora_runs[2]
    torch.testing.assert_close(r["lora_disabled"], r["base"], rtol=0, atol=1e-6)
    assert (r["lora_enabled"] - r["base"]).abs().max() > 1e-6  # the adapter did learn something


def test_full_reference_engine_holds_only_its_shard(full_kl_runs):
    r = full_kl_runs[2]
    # Whole on every rank: only the norms and biases, under stage3_param_persistence_threshold (zero3_fp32.json).
    assert r["ref_visible_numel"] == r["ref_persistent_numel"] < r["ref_full_numel"] / 50
    assert 0 < r["ref_persistent_max"] <= 10_000
    assert r["ref_local_numel"] <= r["ref_full_numel"] / 2 + 1000
    # Policy = reference until the first optimizer step; the second update block sees a real, positive KL.
    assert full_kl_runs[2]["stats"]["kl"] > 0


@pytest.mark.slow  # CI time: an option that is off by default (batch.rollout_micro_batch_size: null)
def test_a_larger_rollout_micro_batch_changes_nothing_but_rounding(tmp_path, lora_runs):
    """batch.rollout_micro_batch_size=8 with update micro-batch 4: the same trajectories, cut into the same update
    micro-batches, so the same rewards and the same step up to the rounding of another matmul shape (~1e-7 in the
    latents: oneDNN in torch 2.14 rounds a batch of 8 and one of 4 differently, as cuBLAS/NPU kernels may)."""
    big = one_step(tmp_path, 2, "recipes/configs/tiny/grpo_lora.yaml",
                   ["optim.lr=1e-2", "batch.rollout_micro_batch_size=8"])
    ref = lora_runs[2]
    assert big["stats"]["ratio_max_dev"] <= 1e-5, big["stats"]
    torch.testing.assert_close(big["rewards"], ref["rewards"], rtol=0, atol=1e-6)
    for name, w in ref["after"].items():
        # Relative to the step's own update: Adam's first step is ~lr*sign(g), so rounding-level differences in
        # near-zero gradients move single elements by up to a full lr (seen with torch 2.14: 1e-3 of the update).
        update = (w - ref["before"][name]).norm()
        assert (big["after"][name] - w).norm() <= 1e-2 * update, name
