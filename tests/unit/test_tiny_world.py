"""The synthetic world: prompts, rendering and the programmatic reward."""

import math

import pytest
import torch

from grpo.tiny import world


def _swap(prompt: str, *, color: str | None = None, shape: str | None = None) -> str:
    c, s, b = world.parse(prompt)
    return world.TEMPLATE.format(color=color or c, shape=shape or s, background=b)


def _other_color(prompt: str) -> str:
    c, _, b = world.parse(prompt)
    return next(n for n in world.COLORS if n not in (c, b))


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return world.all_prompts()


@pytest.fixture(scope="module")
def images(prompts) -> torch.Tensor:
    return world.render(prompts, 64, torch.Generator().manual_seed(0))


def test_prompts_cover_every_combination_once(prompts):
    n = len(world.COLORS)
    assert len(prompts) == n * len(world.SHAPES) * (n - 1)
    assert len(set(prompts)) == len(prompts)
    for p in prompts:
        c, s, b = world.parse(p)
        assert p == f"a {c} {s} on a {b} background" and c != b


@pytest.mark.parametrize(
    "bad",
    ["a red circle on a red background", "a pink circle on a blue background", "a red hexagon on a blue background",
     "red circle on blue", ""],
)
def test_parse_rejects_prompts_outside_the_world(bad):
    with pytest.raises(ValueError, match="not of the tiny world") as err:
        world.parse(bad)
    assert repr(bad) in str(err.value) and "\n" not in str(err.value)


def test_split_is_a_partition_and_train_covers_every_part(prompts):
    train, heldout = world.split_prompts()
    assert sorted(train + heldout) == sorted(prompts) and not set(train) & set(heldout)
    assert 0.15 <= len(heldout) / len(prompts) <= 0.25
    parts = [world.parse(p) for p in train]
    assert {c for c, _, _ in parts} == set(world.COLORS)
    assert {s for _, s, _ in parts} == set(world.SHAPES)
    assert {b for _, _, b in parts} == set(world.COLORS)
    assert world.split_prompts() == (train, heldout)


def test_prompt_files_match_the_split():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "assets" / "prompts"
    train, heldout = world.split_prompts()
    assert (root / "tiny_train.txt").read_text().splitlines() == train
    assert (root / "tiny_heldout.txt").read_text().splitlines() == heldout


def test_render_draws_two_colours_with_the_shape_inside_the_border(prompts, images):
    assert images.shape == (len(prompts), 3, 64, 64) and images.dtype == torch.float32
    assert images.min() >= 0 and images.max() <= 1
    for img, p in zip(images, prompts):
        c, s, b = world.parse(p)
        fg = torch.tensor(world.COLORS[c]).view(3, 1, 1)
        bg = torch.tensor(world.COLORS[b]).view(3, 1, 1)
        is_fg = (img == fg).all(0)
        assert (is_fg | (img == bg).all(0)).all()
        # Closed-form area bounds of each shape for half-extents in [RADIUS_MIN, RADIUS_MAX] (plus pixel slack).
        factor = {"circle": math.pi, "square": 4.0, "triangle": 2.0}[s]
        area = is_fg.float().mean().item()
        assert factor * world.RADIUS_MIN**2 - 0.01 <= area <= factor * world.RADIUS_MAX**2 + 0.01, (p, area)
        ring = torch.ones(64, 64, dtype=torch.bool)
        ring[4:-4, 4:-4] = False
        assert not is_fg[ring].any()


def test_render_is_reproducible_and_random(prompts):
    a = world.render(prompts[:8], 64, torch.Generator().manual_seed(3))
    b = world.render(prompts[:8], 64, torch.Generator().manual_seed(3))
    c = world.render(prompts[:8], 64, torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_ground_truth_scores_high(prompts, images):
    s = world.score(images, prompts)
    assert s.dtype == torch.float32 and s.shape == (len(prompts),)
    assert s.min() > 0.9


def test_wrong_colour_and_wrong_shape_score_lower(prompts, images):
    truth = world.score(images, prompts)
    wrong_color = world.score(images, [_swap(p, color=_other_color(p)) for p in prompts])
    assert (wrong_color < truth - 0.5).all()
    for shift in (1, 2):
        other = [_swap(p, shape=world.SHAPES[(world.SHAPES.index(world.parse(p)[1]) + shift) % 3]) for p in prompts]
        assert (world.score(images, other) < truth - 0.15).all()


def test_upside_down_triangle_scores_lower():
    p = ["a red triangle on a blue background"] * 4
    x = world.render(p, 64, torch.Generator().manual_seed(0))
    assert (world.score(x.flip(-2), p) < world.score(x, p) - 0.1).all()


def test_blank_noise_and_blur_are_ordered(prompts, images):
    truth = world.score(images, prompts)
    backgrounds = torch.tensor([world.COLORS[world.parse(p)[2]] for p in prompts])
    blank = backgrounds.view(-1, 3, 1, 1).expand(-1, 3, 64, 64)
    noise = torch.rand(images.shape, generator=torch.Generator().manual_seed(0))
    blurred = torch.nn.functional.avg_pool2d(images, 5, 1, 2, count_include_pad=False)
    s_blank, s_noise, s_blur = (world.score(x, prompts) for x in (blank, noise, blurred))
    assert (s_blank < 0.4).all() and (s_noise < 0.4).all()
    # Soft: a blur costs a little on average (single images may gain: it can round a small circle), not everything.
    assert 0.7 < s_blur.mean() < truth.mean() - 0.05


def test_score_in_unit_range_for_arbitrary_inputs(prompts):
    g = torch.Generator().manual_seed(1)
    for x in (torch.rand(len(prompts), 3, 64, 64, generator=g) * 3 - 1, torch.zeros(len(prompts), 3, 64, 64),
              torch.ones(len(prompts), 3, 64, 64)):
        s = world.score(x, prompts)
        assert torch.isfinite(s).all() and s.min() >= 0 and s.max() <= 1


def test_score_batched_equals_one_by_one_and_other_sizes(prompts, images):
    idx = list(range(0, len(prompts), 7))
    batch = world.score(images[idx], [prompts[i] for i in idx])
    single = torch.cat([world.score(images[i : i + 1], [prompts[i]]) for i in idx])
    torch.testing.assert_close(batch, single, rtol=0, atol=1e-6)
    big = world.render(prompts[:6], 128, torch.Generator().manual_seed(0))
    assert world.score(big, prompts[:6]).min() > 0.9


def test_score_has_no_gradient_and_checks_shapes(prompts, images):
    x = images[:2].clone().requires_grad_(True)
    assert not world.score(x, prompts[:2]).requires_grad
    with pytest.raises(ValueError, match="do not match"):
        world.score(images[:2], prompts[:3])


def test_every_edit_changes_one_part_and_the_held_out_targets_are_never_trained():
    edits = world.all_edits()
    assert len(edits) == len(world.all_prompts()) * len(world.EDIT_KINDS)
    for source, kind, target in edits:
        changed = [f for f, a, b in zip(world.SCENE_FIELDS, world.parse(source), world.parse(target)) if a != b]
        assert changed == [kind]
    train, heldout = map(set, world.split_prompts())
    assert sum(t in heldout for *_, t in edits) == 54 and sum(t in train for *_, t in edits) == 216


def test_an_edit_pair_shares_its_placement_and_placement_reads_it_back():
    sources, kinds, targets = zip(*world.all_edits()[:60])
    s, t = world.render_edits(list(sources), list(targets), 64, torch.Generator().manual_seed(1))
    cx, cy, r = world._placements(60, torch.Generator().manual_seed(1), "cpu")
    for images, prompts in ((s, sources), (t, targets)):
        got = world.placement(images, [world.parse(p)[0] for p in prompts])
        for a, b in zip(got, (cx, cy, r)):
            assert (a - b).abs().max() <= 1.5 / 64  # within a pixel and a half at 64 px
    # the source of a pair is the plain render of its prompt from the same generator state
    assert torch.equal(s, world.render(list(sources), 64, torch.Generator().manual_seed(1)))


def test_the_edit_score_grades_following_the_instruction_and_keeping_the_placement():
    sources, kinds, targets = map(list, zip(*world.all_edits()))
    s, t = world.render_edits(sources, targets, 64, torch.Generator().manual_seed(2))
    scenes, source_scenes = [world.parse(p) for p in targets], [world.parse(p) for p in sources]
    right = world.edit_score(t, scenes, s, source_scenes)
    unchanged = world.edit_score(s, scenes, s, source_scenes)
    moved = world.edit_score(world.render(targets, 64, torch.Generator().manual_seed(3)), scenes, s, source_scenes)
    assert right.min() > 0.9 and right.mean() > 0.97
    by_kind = {k: unchanged[[i for i, x in enumerate(kinds) if x == k]].mean().item() for k in world.EDIT_KINDS}
    assert by_kind["color"] < 0.3 and 0.55 < by_kind["shape"] < 0.7 and 0.7 < by_kind["background"] < 0.8
    assert (moved < right).float().mean() > 0.9 and moved.mean() < right.mean() - 0.08  # the right scene elsewhere
    terms = world.edit_terms(t, scenes, s, source_scenes)
    assert set(terms) == {"background", "presence", "form", "placement"}
    assert torch.allclose(sum(terms.values()) / 4, right)
    # the source may come at another size: it is resized to the edit's
    big = torch.nn.functional.interpolate(s, scale_factor=2, mode="nearest")
    assert torch.allclose(world.edit_score(t, scenes, big, source_scenes), right, atol=0.02)
