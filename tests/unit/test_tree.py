"""BranchGRPO's trees (grpo/tree.py): the tree's shape, the per-depth advantages against a transcription of the
source's node recursion, and the node-once rollout against the same tree computed row by row."""

import pytest
import torch

from grpo.config import load_config
from grpo.errors import ConfigError
from grpo.models.flux1 import FLUX1
from grpo.layout import derive_layout
from grpo.rollout import SDEParams, sample, timestep, transition
from grpo.sde import gaussian_log_prob, sde_mean_std
from grpo.tree import Tree, depth_advantages
from tests import ROOT, TINY

TREE = Tree(splits=(0, 2), factor=2, noise_scale=2.0, num_steps=6)


def test_tree_shape():
    assert [TREE.nodes(d) for d in range(7)] == [1, 2, 2, 4, 4, 4, 4]
    assert TREE.leaves == 4 and TREE.span(1) == 2 and TREE.span(0) == 4
    assert TREE.heads(8, 1).tolist() == [0, 2, 4, 6]
    assert TREE.owner(8, 1).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert TREE.heads(8, 0).tolist() == [0, 4]
    assert TREE.trained() == [0, 1, 2, 3, 4]
    assert Tree((2, 3), 2, 1.0, 6).trained() == [2, 3, 4]  # the edges into the one-node depths carry A = 0
    assert (TREE.std_scale(0), TREE.std_scale(1), TREE.std_scale(2)) == (2.0, 1.0, 2.0)
    # rollout 1+2+2+4+4+4 = 17 calls a tree, update 3 x (1+2+2+4+4) = 39, over 4 leaves
    assert TREE.forwards_per_image(TREE.trained(), 3) == (17 + 39) / 4


def _source_advantages(rewards: torch.Tensor, tree: Tree) -> dict[tuple[int, int], float]:
    """BranchGRPO's compute_node_rewards_from_leaves + compute_hierarchical_advantages_by_depth, transcribed on
    explicit nodes: {(leaf, depth): A of the leaf's ancestor at depth}, for one tree."""
    nodes = [[(0, list(range(tree.leaves)))]]  # per depth: (node id, its leaves)
    for d in range(tree.num_steps):
        children = []
        for _, leaves in nodes[-1]:
            k = tree.factor if d in tree.splits else 1
            part = len(leaves) // k
            children += [(len(children), leaves[i * part:(i + 1) * part]) for i in range(k)]
        nodes.append(children)
    out = {}
    for d, level in enumerate(nodes):
        r = torch.stack([rewards[leaves].mean() for _, leaves in level])
        if len(level) <= 1:
            a = torch.zeros_like(r)
        else:
            std = r.std()
            a = torch.zeros_like(r) if std < 1e-6 else (r - r.mean()) / (std + 1e-8)
        for (_, leaves), value in zip(level, a):
            for leaf in leaves:
                out[leaf, d] = float(value)
    return out


@pytest.mark.parametrize("tree", [TREE, Tree((1,), 2, 1.0, 4), Tree((0, 1, 3), 2, 4.0, 6), Tree((1,), 3, 1.0, 4)])
def test_depth_advantages_match_the_source(tree):
    torch.manual_seed(0)
    rewards = torch.rand(3 * tree.leaves)
    rewards[2 * tree.leaves:] = 0.5  # a tree whose leaves all score the same: no advantage anywhere
    adv, stats = depth_advantages(rewards, tree, clip=None)
    assert adv.shape == (3 * tree.leaves, tree.num_steps + 1)
    for t in range(3):
        expected = _source_advantages(rewards[t * tree.leaves:(t + 1) * tree.leaves], tree)
        for (leaf, d), a in expected.items():
            assert adv[t * tree.leaves + leaf, d].item() == pytest.approx(a, abs=1e-6), (t, leaf, d)
    assert adv[2 * tree.leaves:].abs().max() == 0
    assert stats["zero_std_frac"].item() == pytest.approx(1 / 3)
    assert depth_advantages(rewards, tree, clip=0.5)[0].abs().max() <= 0.5


@pytest.fixture(scope="module")
def tiny():
    if not (TINY / "model_index.json").exists():
        pytest.skip("tiny model not built")
    parts = FLUX1.load_parts(str(TINY))
    size = parts.latent_size(64)
    torch.manual_seed(1)
    embeds, pooled = torch.randn(2, 8, parts.transformer.config.joint_attention_dim), torch.randn(2, 32)
    rows = [0, 0, 0, 0, 1, 1, 1, 1]  # two trees of 4 leaves, one prompt each
    pooled = pooled[rows][:, :parts.transformer.config.pooled_projection_dim]
    cond = FLUX1.conditioning({"prompt_embeds": embeds[rows], "pooled": pooled}, size, 3.5, True,
                              torch.device("cpu"), torch.float32)
    roots = torch.randn(2, parts.transformer.config.in_channels // 4, size, size)
    sigmas = FLUX1.dynamic_sigmas(6, (size // 2) ** 2, parts.scheduler_config)
    return parts.transformer, cond, FLUX1.pack(roots[rows]), sigmas


def _gens():
    return [torch.Generator().manual_seed(300 + i) for i in range(8)]


def test_tree_rollout_is_the_tree_computed_row_by_row(tiny):
    """Every row computed on its own (no sharing) with its node's noise gives the same latents and log-probs;
    siblings are identical until their split and differ after it."""
    model, cond, init, sigmas = tiny
    sde = SDEParams(0.7, "dance")
    traj = sample(FLUX1.velocity_of(model), cond, init, sigmas, sde, _gens(), tree=TREE)
    gens, x = _gens(), init.clone()
    for i in range(6):
        v = FLUX1.velocity(model, x, timestep(sigmas, i, 8), cond)
        mean, std = sde_mean_std(x, v, float(sigmas[i]), float(sigmas[i + 1]), eta=0.7, kind="dance",
                                 sigma_max=float(sigmas[1]))
        heads = TREE.heads(8, i + 1).tolist()  # each node's noise comes from its first row's generator
        node_noise = torch.stack([torch.randn(x.shape[1:], generator=gens[k]) for k in heads])
        noise = node_noise[TREE.owner(8, i + 1)]
        std = std * TREE.std_scale(i)
        nxt = mean + std * noise
        torch.testing.assert_close(traj.latents[:, i + 1], nxt, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(traj.log_probs[:, i], gaussian_log_prob(nxt, mean, std), atol=2e-5, rtol=1e-5)
        x = traj.latents[:, i + 1]  # continue from the tree's own states, so errors do not compound
    lat = traj.latents
    # rows 0 and 1: one node until the split at step 2 makes x_3; rows 0 and 3: apart from the split at step 0
    assert all(torch.equal(lat[0, d], lat[1, d]) for d in range(3)) and not torch.equal(lat[0, 3], lat[1, 3])
    assert torch.equal(lat[0, 0], lat[3, 0]) and not torch.equal(lat[0, 1], lat[3, 1])
    assert not torch.equal(traj.x0[0], traj.x0[1])


def test_tree_update_recomputes_the_rollout_log_prob_exactly(tiny):
    """One row per edge, from one model call per node, as in the rollout: the first-pass ratio is exactly 1."""
    model, cond, init, sigmas = tiny
    sde = SDEParams(0.7, "dance")
    traj = sample(FLUX1.velocity_of(model), cond, init, sigmas, sde, _gens(), tree=TREE)
    for j in TREE.trained():
        out = transition(FLUX1.velocity_of(model), cond, traj.latents, sigmas, j, sde, TREE)
        edges = TREE.heads(8, j + 1)
        assert out.log_prob.shape == (len(edges),)
        assert torch.equal(out.log_prob, traj.log_probs[edges, j])
        assert out.velocity.shape[0] == len(TREE.heads(8, j))  # one velocity per node at depth j (drift stats)


@pytest.mark.parametrize("overrides, needle", [
    (["sampling.group_size=8"], "sampling.group_size: 8; a tree with 2 splits of factor 2 has 4 leaves"),
    (["sampling.init_same_noise=false"], "sampling.init_same_noise"),
    (["sampling.branch.splits=[2,0]"], "sampling.branch.splits"),
    (["sampling.branch.splits=[0,5]"], "sampling.branch.splits"),
    (["sampling.sde=cps"], "sampling.branch: needs Gaussian SDE steps"),
    (["advantage.std_scope=batch"], "advantage.std_scope: group"),
    (["batch.micro_batch_size=2"], "batch.micro_batch_size: 2; tree rollouts need whole trees"),
])
def test_bad_tree_settings_name_the_setting(overrides, needle):
    with pytest.raises(ConfigError) as e:
        derive_layout(load_config(ROOT / "recipes/configs/tiny/branchgrpo_lora.yaml", overrides), 2)
    assert needle in str(e.value) and "\n" not in str(e.value)
