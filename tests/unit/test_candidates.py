"""Candidate selection (grpo/candidates.py): Sol-RL's best/worst rule, a selection that is a pure function of the
gathered scores, its settings, its layout and its cost; the preview is the sampler's own ODE on fewer steps."""

import pytest
import torch

from grpo.candidates import Starts, select_extremes
from grpo.config import load_config
from grpo.data import POOL_NOISE, POOL_STEP_NOISE
from grpo.errors import ConfigError
from grpo.layout import derive_layout
from grpo.rollout_plan import RolloutPlan
from tests import ROOT, TINY

TINY_PRESETS = ROOT / "recipes" / "configs" / "tiny"
GRPO = ROOT / "recipes" / "configs" / "experimental" / "tiny_grpo_candidates_lora.yaml"
NFT = TINY_PRESETS / "nft_candidates_lora.yaml"


def sol_rl_best_worst(rewards: torch.Tensor, target_count: int) -> torch.Tensor:
    """NVlabs/Sana@06af561 train_scripts/sol_rl/train_utils.py select_indices_by_mode(rewards, target_count,
    "best_worst"), the mode its presets use (configs/sol_rl/sana.py stage1_select_mode), restated."""
    target_count = max(1, min(int(target_count), rewards.shape[0]))
    n_best = target_count // 2
    n_worst = target_count - n_best
    best = torch.topk(rewards, n_best, largest=True).indices if n_best > 0 else torch.empty(0, dtype=torch.long)
    worst = torch.topk(rewards, n_worst, largest=False).indices if n_worst > 0 else torch.empty(0, dtype=torch.long)
    return torch.cat([best, worst])


@pytest.mark.parametrize("pool, keep", [(96, 24), (16, 5), (8, 4), (5, 1)])
def test_keeping_half_best_half_worst_is_sol_rls_rule(pool, keep):
    """With distinct scores (ties aside) the kept candidates, and their order, are the source's."""
    g = torch.Generator().manual_seed(pool)
    scores = torch.rand(7, pool, generator=g)
    kept = select_extremes(scores, keep // 2, keep - keep // 2)
    for row, k in zip(scores, kept):
        assert k.tolist() == sol_rl_best_worst(row, keep).tolist()


def test_ties_go_by_candidate_index_and_the_ends_never_overlap():
    kept = select_extremes(torch.zeros(2, 6), 3, 3)
    assert kept.tolist() == [[0, 1, 2, 5, 4, 3]] * 2
    scores = torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0]])
    assert select_extremes(scores, 2, 2).tolist() == [[1, 2, 3, 0]]  # the lowest first
    assert select_extremes(scores, 1, 0).tolist() == [[1]]


def test_a_non_finite_preview_score_ranks_lowest():
    scores = torch.tensor([[0.5, float("nan"), 0.2, 0.9]])
    assert select_extremes(scores, 1, 1).tolist() == [[3, 1]]


def test_the_kept_candidates_are_the_groups_and_key_their_own_noise():
    pool = 8
    scores = torch.rand(3 * pool, generator=torch.Generator().manual_seed(0))
    starts = Starts.selected(scores, pool, 2, 2)
    kept = select_extremes(scores.view(3, pool), 2, 2)
    assert starts.init_keys == starts.sde_keys == [p * pool + c for p in range(3) for c in kept[p].tolist()]
    assert (starts.init_stream, starts.sde_stream) == (POOL_NOISE, POOL_STEP_NOISE)
    # a prompt's group is drawn from its own pool only
    assert all(p * pool <= k < (p + 1) * pool for i, k in enumerate(starts.init_keys) for p in [i // 4])
    # the same scores select the same, whichever process holds what: a pure function of the gathered scores
    assert Starts.selected(scores.clone(), pool, 2, 2) == starts
    assert starts.stats["candidates/kept_preview_spread"] > 0


def test_without_candidates_a_sample_starts_from_its_own_noise():
    assert Starts.own(6, 3, False).init_keys == [0, 1, 2, 3, 4, 5]
    assert Starts.own(6, 3, True).init_keys == [0, 0, 0, 1, 1, 1]
    assert Starts.own(6, 3, True).sde_keys == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("overrides, needle", [
    (["sampling.candidates.keep_top=3"], "sampling.candidates: keep_top 3 + keep_bottom 2 must be group_size 4"),
    (["sampling.candidates.pool=4"], "sampling.candidates.pool: 4 leaves nothing"),
    (["sampling.candidates.preview_steps=7"], "sampling.candidates.preview_steps: 7; use 1 .. num_steps = 6"),
    (["sampling.candidates.preview_steps=0"], "sampling.candidates.preview_steps: 0"),
    (["sampling.init_same_noise=true"], "sampling.init_same_noise: true, but candidate selection"),
    (["sampling.candidates.pool=eight"], "sampling.candidates.pool: expected an integer"),
    (["sampling.candidates.keep=2"], "sampling.candidates.keep: unknown setting"),
])
def test_bad_candidate_settings_are_one_line_errors(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(GRPO, overrides)
    assert str(e.value).startswith(needle), str(e.value)
    assert "\n" not in str(e.value)


def test_a_tree_has_no_pool_to_select_from():
    with pytest.raises(ConfigError, match="sampling.candidates: a tree grows"):
        load_config(TINY_PRESETS / "branchgrpo_lora.yaml", ["sampling.candidates={pool: 8, keep_top: 2, "
                                                             "keep_bottom: 2, preview_steps: 3}"])


def test_the_pool_splits_over_processes_into_whole_preview_batches():
    cfg = load_config(GRPO)
    for world in (1, 2, 8):
        lay = derive_layout(cfg, world)
        ids = [i for r in range(world) for i in lay.rank_pool_ids(r)]
        assert ids == list(range(16 * 8)) and lay.pool_per_step == 128
        assert len(lay.rank_pool_ids(0)) % lay.rollout_micro_batch_size == 0
    with pytest.raises(ConfigError, match="sampling.candidates.pool: 16 prompts x pool 9 = 144 candidates do not "
                                          "split over 8 processes"):
        derive_layout(load_config(GRPO, ["sampling.candidates.pool=9"]), 8)


def test_the_preview_counts_in_the_cost():
    """Per trained image: pool / group_size previews of preview_steps calls, on top of the preset it extends."""
    for preset, base in ((GRPO, "grpo_lora.yaml"), (NFT, "nft_lora.yaml")):
        plain = RolloutPlan.of(load_config(TINY_PRESETS / base, ["sampling.init_same_noise=false"]))
        plan = RolloutPlan.of(load_config(preset))
        assert plan.preview_calls() == 8 * 3 / 4
        assert plan.forwards_per_image(0) == plain.forwards_per_image(0) + 6
    assert RolloutPlan.of(load_config(GRPO)).forwards_per_image(0) == 6 + 6 + 5 * 3
    assert RolloutPlan.of(load_config(NFT)).forwards_per_image(0) == 6 + 6 + 2 * (3 + 1)


@pytest.fixture(scope="module")
def parts():
    if not (TINY / "model_index.json").exists():
        pytest.skip("tiny model not built")
    from grpo.models.flux1 import FLUX1

    return FLUX1.load_parts(str(TINY))


def test_the_preview_is_the_rollouts_ode_on_fewer_steps(parts):
    """At full steps the preview of a candidate is its ODE rollout (nft's), from the same noise; on fewer steps it is
    the sampler's own schedule for that many steps."""
    from grpo.models.flux1 import FLUX1
    from grpo.rollout import FluxSampler, schedule

    cfg = load_config(NFT)
    s = cfg.sampling
    sampler = FluxSampler.from_parts(parts, parts.vae, s, cfg.seed, torch.device("cpu"), torch.float32)
    embeds = {"prompt_embeds": torch.zeros(1, 32, parts.transformer.config.joint_attention_dim),
              "pooled": torch.zeros(1, parts.transformer.config.pooled_projection_dim)}
    cond = FLUX1.conditioning(embeds, sampler.latent_size, 3.5, True, torch.device("cpu"), torch.float32)
    init = sampler.initial_latents(0, [5], POOL_NOISE)
    full = sampler.sample(parts.transformer, cond, init)
    same = sampler.with_steps(s.num_steps).sample(parts.transformer, cond, init, eta=0.0)
    assert torch.equal(full.x0, same.x0)
    preview = sampler.with_steps(3)
    assert torch.equal(preview.sigmas, schedule(preview.sampling, FLUX1, sampler.latent_size, {}))
    assert len(preview.sigmas) == 4 and preview.sample(parts.transformer, cond, init, eta=0.0).nfe == 3


def test_a_checkpoint_from_before_the_setting_resumes_only_with_selection_off():
    from grpo.compat import config_differences
    from grpo.config import to_dict

    before = to_dict(load_config(TINY_PRESETS / "grpo_lora.yaml"))
    del before["sampling"]["candidates"]
    assert config_differences(before, to_dict(load_config(TINY_PRESETS / "grpo_lora.yaml"))) == []
    on = config_differences(before, to_dict(load_config(GRPO, ["output_dir=runs/tiny_grpo_lora"])))
    assert any(d.startswith("sampling.candidates.pool=") for d in on), on
