"""OP-GRPO's trajectory replay (grpo/replay.py): the selection rule, the FIFO buffer and its checkpoint state, the
sequence-level importance weight against a hand computation, the seeded draws, the cost, the settings' refusals and
the weighted loss."""

import math

import pytest
import torch

from grpo import replay
from grpo.checkpoint import Saved
from grpo.config import load_config
from grpo.errors import ConfigError
from grpo.loss import grpo_loss
from grpo.objectives import objective_of
from grpo.replay import ReplayBuffer
from grpo.rollout_plan import RolloutPlan
from tests import ROOT

TINY_PRESETS = ROOT / "recipes" / "configs" / "tiny"
OPGRPO = ROOT / "recipes" / "configs" / "experimental" / "tiny_opgrpo_lora.yaml"


def test_the_highest_positive_advantages_are_selected_highest_first():
    adv = torch.tensor([0.5, -1.0, 2.0, 0.1, 1.0, -0.3])
    assert replay.select(adv, 3) == [2, 4, 0]
    assert replay.select(adv, 10) == [2, 4, 0, 3]  # only the positive ones: fewer than asked


def test_ties_go_by_sample_index_and_zero_or_non_finite_never_enter():
    assert replay.select(torch.tensor([1.0, 2.0, 1.0, 2.0, 1.0]), 3) == [1, 3, 0]
    assert replay.select(torch.zeros(6), 4) == []  # a group whose rewards are all equal
    assert replay.select(torch.tensor([-1.0, -0.5]), 2) == []
    assert replay.select(torch.tensor([float("nan"), float("inf"), 0.5]), 3) == [2]


def test_the_selection_is_a_pure_function_of_the_gathered_advantages():
    adv = torch.randn(64, generator=torch.Generator().manual_seed(3))
    assert replay.select(adv, 16) == replay.select(adv.clone(), 16)
    assert all(adv[i] > 0 for i in replay.select(adv, 16))


def _entries(n: int, first: float, steps: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """n trajectories of `steps` transitions whose latents are filled with first, first + 1, ..."""
    values = torch.arange(first, first + n).view(n, 1, 1, 1)
    return values.expand(n, steps + 1, 2, 3).clone(), values.view(n, 1).expand(n, steps).clone()


def test_the_buffer_is_fifo_and_keeps_only_the_first_transitions():
    buf = ReplayBuffer(size=5, truncate=2)
    assert len(buf) == 0
    latents, log_probs = _entries(3, 0.0)
    buf.add(latents, log_probs, torch.tensor([1.0, 2.0, 3.0]), [7, 8, 9], born=0)
    latents, log_probs = _entries(4, 10.0)
    buf.add(latents, log_probs, torch.tensor([4.0, 5.0, 6.0, 7.0]), [1, 2, 3, 4], born=1)
    assert len(buf) == 5  # the two oldest went
    b = buf.take([0, 4])
    assert b.latents.shape == (2, 3, 2, 3) and b.log_probs.shape == (2, 2)  # x_0..x_L and transitions 0..L-1
    assert b.latents[:, 0, 0, 0].tolist() == [2.0, 13.0]
    assert b.advantages.tolist() == [3.0, 7.0] and b.prompt_idx == [9, 4] and b.born == [0, 1]
    assert buf.born([0, 1, 2]) == [0, 1, 1]


def test_the_buffer_round_trips_through_its_checkpoint_tensors():
    buf = ReplayBuffer(size=4, truncate=2)
    latents, log_probs = _entries(3, 0.5)
    buf.add(latents, log_probs, torch.tensor([0.1, 0.2, 0.3]), [5, 6, 7], born=4)
    again = ReplayBuffer(size=4, truncate=2)
    again.load(buf.state())
    assert set(buf.state()) == {f"replay/{k}" for k in ReplayBuffer.KEYS}
    assert all(torch.equal(again.state()[k], v) for k, v in buf.state().items())
    empty = ReplayBuffer(size=4, truncate=2)
    assert empty.state() == {}
    empty.load({"rng/torch": torch.zeros(1)})  # a checkpoint without a buffer: empty
    assert len(empty) == 0


def test_the_weight_is_the_exp_of_the_summed_log_ratio_over_the_first_transitions():
    now = torch.tensor([[0.10, -0.20, 5.0], [0.00, 0.30, -7.0]])
    behaviour = torch.tensor([[0.05, -0.10, 0.0], [0.10, 0.10, 0.0]])
    w = replay.sequence_weight(now, behaviour, truncate=2, cap=None)
    # by hand: (0.10 - 0.05) + (-0.20 + 0.10) = -0.05; (0.00 - 0.10) + (0.30 - 0.10) = 0.10; transition 2 left out
    assert w.tolist() == pytest.approx([math.exp(-0.05), math.exp(0.10)], rel=1e-6)
    assert w.dtype == torch.float32 and not w.requires_grad
    capped = replay.sequence_weight(now, behaviour, truncate=2, cap=1.05)
    assert capped.tolist() == pytest.approx([math.exp(-0.05), 1.05], rel=1e-6)
    assert replay.sequence_weight(now, now, truncate=3, cap=None).tolist() == [1.0, 1.0]


def test_the_draws_are_pure_functions_of_seed_and_step():
    a = replay.draw(42, 5, 64, 32)
    assert a == replay.draw(42, 5, 64, 32) and len(set(a)) == 32 and all(0 <= p < 64 for p in a)
    assert a != replay.draw(42, 6, 64, 32) and a != replay.draw(43, 5, 64, 32)
    t = replay.replay_transitions(4, 3, 42, 5, 8)
    assert t == replay.replay_transitions(4, 3, 42, 5, 8) == sorted(set(t)) and all(0 <= j < 4 for j in t)
    assert len(t) == 3


def test_the_weighted_loss_scales_each_samples_policy_term():
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    w = torch.tensor([0.5, 2.0])
    loss, st = grpo_loss(lp, lp.detach(), adv, clip_range=1e-4, weight=w)
    assert loss.item() == pytest.approx((-1.0 * 0.5 + 1.0 * 2.0) / 2)
    assert torch.equal(st["ratio"], torch.ones(2))  # the ratio itself is not weighted: exactly 1 on a first pass
    loss.backward()
    assert lp.grad.tolist() == pytest.approx([-0.25, 1.0])


def test_the_preset_and_its_cost():
    cfg = load_config(OPGRPO)
    r = cfg.grpo.replay
    assert (r.size, r.per_step, r.truncate, r.weight_cap) == (64, 16, 4, 2.0)
    plan = RolloutPlan.of(cfg)
    assert plan.forwards_per_image(0) == 6 + 3 * 3  # the on-policy step is grpo's
    # a replay block of 32 of the step's 64 images: 4 no-grad forwards of the weight + 3 trained transitions each
    assert replay.forwards_per_image(4, 3, plan.objective.forwards_per_point(), 32, 64) == 32 * (4 + 9) / 64
    # in the plan, one cost model: expected from step 2 (16 entries a step fill a block of 32), or as many as ran
    assert [plan.forwards_per_image(s) for s in (1, 2)] == [15, 15 + 32 * (4 + 9) / 64]
    assert plan.forwards_per_image(2, extra_blocks=0) == 15 and plan.forwards_per_image(1, extra_blocks=1) == 21.5
    assert (plan.objective.plan_terms().kept_trajectories, plan.objective.plan_terms().kept_transitions) == (64, 4)
    assert load_config(TINY_PRESETS / "grpo_lora.yaml").grpo.replay is None  # off by default


@pytest.mark.parametrize("preset, overrides, needle", [
    (OPGRPO, ["grpo.replay.per_step=0"], "grpo.replay.per_step: 0; use 1 .. the step's 64 samples"),
    (OPGRPO, ["grpo.replay.per_step=65"], "grpo.replay.per_step: 65; use 1 .. the step's 64 samples"),
    (OPGRPO, ["grpo.replay.size=31"], "grpo.replay.size: 31 is less than one update block's 32 samples"),
    (OPGRPO, ["grpo.replay.truncate=2"], "grpo.replay.truncate: 2; use 3 (the K transitions"),
    (OPGRPO, ["grpo.replay.truncate=6"], "grpo.replay.truncate: 6; use 3 (the K transitions trained per trajectory) "
                                         ".. 5"),
    (OPGRPO, ["grpo.timestep_fraction=1.0"], "grpo.replay.truncate: 4; use 5"),
    (OPGRPO, ["grpo.replay.weight_cap=0"], "grpo.replay.weight_cap: 0"),
    (OPGRPO, ["sampling.window={placement: random, size: 2, high: 3}", "grpo.timestep_fraction=1.0"],
     "grpo.replay: needs every step SDE"),
    (OPGRPO, ["sampling.sde=flow", "grpo.ratio_norm=true"], "grpo.replay: GRPO-Guard's RatioNorm"),
    (TINY_PRESETS / "branchgrpo_lora.yaml",
     ["grpo.replay={size: 64, per_step: 4, truncate: 5, weight_cap: null}"], "grpo.replay: needs every step SDE"),
    (TINY_PRESETS / "nft_lora.yaml", ["grpo={clip_range: 1e-4, timestep_fraction: 0.6, replay: {size: 64, "
                                      "per_step: 4, truncate: 4}}"], "grpo: settings of algorithm grpo, but this "
                                                                     "preset's algorithm is nft"),
    (OPGRPO, ["grpo.replay.keep=2"], "grpo.replay.keep: unknown setting"),
])
def test_bad_replay_settings_are_one_line_errors(preset, overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(preset, overrides)
    assert str(e.value).startswith(needle), str(e.value)
    assert "\n" not in str(e.value)


def test_the_grpo_objective_owns_the_buffer_its_checkpoint_state_and_its_health_line():
    """Replay is the grpo objective's (grpo/objectives/base.py's hooks): its state round-trips through a checkpoint's
    rank-0 tensors under the same "replay/*" names as before; another objective's hooks do nothing."""
    grpo = objective_of(load_config(OPGRPO))
    latents, log_probs = _entries(3, 0.5, steps=5)
    grpo.replay.buffer.add(latents, log_probs, torch.tensor([0.1, 0.2, 0.3]), [5, 6, 7], born=4)
    tensors, meta = grpo.state_dict()
    assert set(tensors) == {f"replay/{k}" for k in ReplayBuffer.KEYS} and meta == {} and grpo.replicated
    again = objective_of(load_config(OPGRPO))
    again.load_state_dict(Saved(tensors, [], resharded=False, rank=0))
    assert all(torch.equal(again.state_dict()[0][k], v) for k, v in tensors.items())
    nft = objective_of(load_config(TINY_PRESETS / "nft_lora.yaml"))
    assert nft.state_dict() == ({}, {}) and nft.extra_forwards_per_image(10) == 0.0 and nft.rollout_records() == {}
    assert nft.extra_blocks(None, 3).chunks == [] and nft.remember(None, 3, [], torch.ones(2)) is None
    drifting = {"ratio_max_dev": 1e-3}  # over 10% of grpo's clip_range 1e-4
    assert "WARNING" in grpo.health_line(1, drifting) and "WARNING" not in nft.health_line(1, drifting)
    assert objective_of(load_config(OPGRPO, ["grpo.replay=null"])).state_dict() == ({}, {})
