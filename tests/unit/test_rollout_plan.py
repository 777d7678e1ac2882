"""The rollout plan (grpo/rollout_plan.py): one cost model for the recipe, the planner and time_to_reward, checked
against the transformer calls the sampler really makes; and the objectives as parts (grpo/objectives/)."""

import ast

import pytest
import torch

from grpo.config import load_config
from grpo.models.flux1 import FLUX1
from grpo.objectives import OBJECTIVES
from grpo.rollout import FluxSampler
from grpo.rollout_plan import RolloutPlan
from tests import ROOT, TINY

TINY_PRESETS = ROOT / "recipes" / "configs" / "tiny"
CASES = {  # preset, overrides
    "dancegrpo": ("grpo_lora.yaml", []),
    "mixgrpo": ("mixgrpo_lora.yaml", []),
    "flash": ("mixgrpo_flash_lora.yaml", []),
    "flash_frozen": ("../experimental/tiny_mixgrpo_flash_frozen_lora.yaml", []),
    "flowgrpo_fast": ("flowgrpo_fast_lora.yaml", []),
    "nft": ("nft_lora.yaml", []),
    "nft_dpm": ("nft_lora.yaml", ["sampling.tail=dpm2", "sampling.compress_ratio=0.5"]),
    "awm": ("awm_lora.yaml", []),
}


class CountingModel(torch.nn.Module):
    """Wraps the transformer and counts its calls."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.calls, self.config = inner, 0, inner.config

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


@pytest.fixture(scope="module")
def parts():
    if not (TINY / "model_index.json").exists():
        pytest.skip("tiny model not built")
    return FLUX1.load_parts(str(TINY))


@pytest.mark.parametrize("name", list(CASES))
def test_the_plans_rollout_cost_is_the_samplers_calls(parts, name):
    preset, overrides = CASES[name]
    cfg = load_config(TINY_PRESETS / preset, overrides)
    plan = RolloutPlan.of(cfg)
    sampler = FluxSampler.from_parts(parts, parts.vae, cfg.sampling, cfg.seed, torch.device("cpu"), torch.float32)
    size = sampler.latent_size
    embeds = {"prompt_embeds": torch.zeros(1, 32, parts.transformer.config.joint_attention_dim),
              "pooled": torch.zeros(1, parts.transformer.config.pooled_projection_dim)}
    cond = FLUX1.conditioning(embeds, size, 3.5, True, torch.device("cpu"), torch.float32)
    model = CountingModel(parts.transformer)
    for step in (0, 7):
        window = plan.window(step)
        model.calls = 0
        gens = [torch.Generator().manual_seed(1)]
        traj = sampler.sample(model, cond, FLUX1.pack(torch.randn(1, sampler.latent_channels, size, size)), gens, window)
        assert model.calls == traj.nfe == plan.rollout_calls(window), name
        trained = plan.trained(step, window, first_id=0)
        assert len(trained) == plan.trained_per_trajectory
        cost = traj.nfe + len(trained) * plan.objective.forwards_per_point()
        assert plan.forwards_per_image(step) == cost


def test_the_trained_points_are_the_objectives_draw():
    """grpo draws K of the N-1 transitions, nft/awm K of the N schedule points, each a pure function of
    (seed, step, first sample) and increasing."""
    grpo = RolloutPlan.of(load_config(TINY_PRESETS / "grpo_lora.yaml", ["grpo.timestep_fraction=0.6"]))
    nft = RolloutPlan.of(load_config(TINY_PRESETS / "nft_lora.yaml"))
    for plan, points, k in ((grpo, range(5), 3), (nft, range(6), 2)):
        drawn = [plan.trained(step, None, first) for step in range(4) for first in (0, 8)]
        assert all(len(d) == k and d == sorted(d) and set(d) <= set(points) for d in drawn)
        assert drawn == [plan.trained(step, None, first) for step in range(4) for first in (0, 8)]
        assert len({tuple(d) for d in drawn}) > 1


def test_the_recipe_does_not_branch_on_the_objective():
    """The recipe holds one objective and never asks which one it is: no `algorithm`, no objective's section and
    no objective's name appear in its code (docstrings aside), nor grpo's replay (the objective's extra block)."""
    source = (ROOT / "recipes" / "flux_grpo.py").read_text()
    tree = ast.parse(source)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    names = set(OBJECTIVES) | {"algorithm", "matching", "replay", "buffer"}  # replay: the grpo objective's own
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            assert node.attr not in names, f"line {node.lineno}: .{node.attr}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            assert node.value not in names, f"line {node.lineno}: {node.value!r}"
            assert "replay" not in node.value, f"line {node.lineno}: {node.value!r}"
        if isinstance(node, (ast.Name, ast.FunctionDef, ast.alias)):
            name = getattr(node, "id", None) or getattr(node, "name", None)
            assert name not in names and "replay" not in name, f"line {node.lineno}: {name}"


def test_awm_draws_its_noise_levels_as_awm():
    """awm.timestep_draw discrete_wo_init (AWM's): one point from each of 2 strata of 1..4 of the 6, never sigma 1
    (point 0) nor the last; uniform (DiffusionNFT's, and AWM's here before) may draw both."""
    awm = RolloutPlan.of(load_config(TINY_PRESETS / "awm_lora.yaml"))
    drawn = [awm.trained(step, None, first) for step in range(20) for first in (0, 8, 16)]
    assert all(d[0] in (1, 2) and d[1] in (3, 4) for d in drawn) and len({tuple(d) for d in drawn}) > 1
    uniform = RolloutPlan.of(load_config(TINY_PRESETS / "awm_lora.yaml", ["awm.timestep_draw=uniform"]))
    assert {0, 5} <= {j for step in range(20) for j in uniform.trained(step, None, 0)}


def test_advantages_per_reward_or_of_the_mixed_reward():
    """advantage.per_reward: MixGRPO's sum of per-reward z-scores is the advantage; otherwise the weighted sum of
    the raw rewards is normalised in its group."""
    from grpo.advantages import group_advantages, per_reward_advantages

    torch.manual_seed(0)
    scores, weights = torch.rand(16, 2), torch.tensor([1.0, 0.5])
    groups = torch.arange(16) // 4
    plain = RolloutPlan.of(load_config(TINY_PRESETS / "grpo_lora.yaml"))
    adv, _ = plain.advantages(scores, weights)
    expected, _ = group_advantages((scores * weights).sum(1), groups, std_scope="group", clip=5.0, eps=1e-4)
    assert torch.equal(adv, expected)
    mixed = RolloutPlan.of(load_config(TINY_PRESETS / "grpo_lora.yaml", ["advantage.per_reward=true"]))
    adv, _ = mixed.advantages(scores, weights)
    assert torch.equal(adv, per_reward_advantages(scores, weights, groups, eps=1e-4, clip=5.0)[0])
    assert not torch.allclose(adv, expected)


def test_true_cfg_counts_two_forward_equivalents_per_sampler_call():
    """sampling.true_cfg: each velocity of the sampler runs the conditional and the negative branch, two calls on
    the same rows, rollout and update alike, so grpo's plan costs twice as many forward-equivalents per image."""
    from grpo.models.flux2 import FLUX2_KLEIN
    from grpo.prompts import PromptCache
    from tests import TINY_FLUX2

    if not (TINY_FLUX2 / "model_index.json").exists():
        pytest.skip("tiny FLUX.2 not built")
    preset = ROOT / "recipes/configs/tiny_flux2/grpo_lora.yaml"
    off, on = load_config(preset), load_config(preset, ["sampling.true_cfg.scale=4.0"])
    for step in (0, 7):
        assert RolloutPlan.of(on).forwards_per_image(step) == 2 * RolloutPlan.of(off).forwards_per_image(step)
    # nft/awm: the rollout guides (two calls a step); the update's calls double only when it trains the guided one
    nft = ROOT / "recipes/configs/tiny_flux2/nft_lora.yaml"
    plain = RolloutPlan.of(load_config(nft))
    conditional, guided = (RolloutPlan.of(load_config(nft, ["sampling.true_cfg.scale=4.0",
                                                            f"sampling.true_cfg.train={t}"]))
                           for t in ("conditional", "guided"))
    assert conditional.forwards_per_image(0) == plain.forwards_per_image(0) + plain.rollout_calls(None)
    assert guided.forwards_per_image(0) == 2 * plain.forwards_per_image(0)
    parts = FLUX2_KLEIN.load_parts(str(TINY_FLUX2))
    rows = []

    class RowCounting(CountingModel):
        def forward(self, *args, **kwargs):
            rows.append(len(kwargs["hidden_states"]))
            return super().forward(*args, **kwargs)

    sampler = FluxSampler.from_parts(parts, parts.vae, on.sampling, on.seed, torch.device("cpu"), torch.float32)
    embeds = {"prompt_embeds": torch.zeros(1, 32, parts.transformer.config.joint_attention_dim)}
    cache = PromptCache(["p"], embeds, negative={"prompt_embeds": torch.ones(1, 32, embeds["prompt_embeds"].shape[2])})
    cond = sampler.conditioning(cache, [0, 0])
    traj = sampler.sample(RowCounting(parts.transformer), cond, sampler.initial_latents(0, [0, 1]),
                          [torch.Generator().manual_seed(k) for k in range(2)])
    assert rows == [2] * (2 * traj.nfe)  # 2 images, two calls a step: the conditional and the negative branch
