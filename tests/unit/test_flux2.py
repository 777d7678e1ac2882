"""The sampler on FLUX.2 [klein] against diffusers' own Flux2KleinPipeline (the tiny FLUX.2 world), through the
same model-family layer and preset path the recipe uses."""

import pytest
import torch
from diffusers import Flux2KleinPipeline

from grpo.config import load_config
from grpo.models import family_of
from grpo.models.flux2 import FLUX2_KLEIN
from grpo.prompts import PromptCache
from grpo.rollout import FluxSampler
from grpo.settings import TrueCFGConfig
from tests import ROOT, TINY_FLUX2, attention_backends, true_cfg_sampler

pytestmark = pytest.mark.skipif(not (TINY_FLUX2 / "model_index.json").exists(), reason="tiny FLUX.2 not built")
PROMPTS = ["a red circle on a blue background", "a green square on a yellow background",
           "a cyan triangle on the left on a magenta background"]


@pytest.fixture(scope="module")
def setup():
    cfg = load_config(ROOT / "recipes/configs/tiny_flux2/grpo_lora.yaml", ["sampling.shift=dynamic"])
    parts = FLUX2_KLEIN.load_parts(str(TINY_FLUX2))
    sampler = FluxSampler.from_parts(parts, parts.vae, cfg.sampling, cfg.seed, torch.device("cpu"), torch.float32)
    cache = PromptCache(PROMPTS, FLUX2_KLEIN.encode_prompts(str(TINY_FLUX2), PROMPTS, cfg.data.max_sequence_length,
                                                            torch.device("cpu")))
    return cfg, parts, sampler, cache


def test_the_folder_is_flux2():
    assert family_of(TINY_FLUX2) is FLUX2_KLEIN


def test_ode_rollout_reproduces_flux2_klein_pipeline(setup):
    cfg, parts, sampler, cache = setup
    ids = list(range(len(PROMPTS)))
    init = sampler.initial_latents(0, ids)
    traj = sampler.sample(parts.transformer, sampler.conditioning(cache, ids), init, eta=0.0)
    ours = sampler.decode(traj.x0)
    # The pipeline draws its noise patchified, [B, 4C, h/2, w/2]: the same numbers, unpacked.
    side = sampler.latent_size // 2
    noise = init.cpu().permute(0, 2, 1).reshape(len(ids), -1, side, side)
    pipe = Flux2KleinPipeline.from_pretrained(str(TINY_FLUX2), dtype=torch.float32)
    with torch.no_grad():
        expected = pipe(prompt_embeds=cache.embeds["prompt_embeds"], latents=noise, height=64, width=64,
                        num_inference_steps=cfg.sampling.num_steps, guidance_scale=1.0, output_type="pt").images
    assert ours.shape == expected.shape == (3, 3, 64, 64)
    torch.testing.assert_close(ours, expected.float(), atol=1e-5, rtol=0)


def test_ode_rollout_with_true_cfg_reproduces_flux2_klein_pipeline_at_guidance_4(setup, tmp_path):
    """sampling.true_cfg.scale=4 on the non-distilled tiny FLUX.2: Flux2KleinPipeline's true CFG at its default
    guidance_scale 4.0, negative prompt "" (encoded here through the recipe's cache, there by the pipeline), the two
    branches two calls here as there. Without CFG the same rollout is another image."""
    cfg, parts, sampler, cache = setup
    guided, cfg_cache = true_cfg_sampler(cfg, parts, cache, TINY_FLUX2, tmp_path, 4.0)
    ids = list(range(len(PROMPTS)))
    init = guided.initial_latents(0, ids)
    ours = guided.decode(guided.sample(parts.transformer, guided.conditioning(cfg_cache, ids), init, eta=0.0).x0)
    side = guided.latent_size // 2
    noise = init.cpu().permute(0, 2, 1).reshape(len(ids), -1, side, side)
    pipe = Flux2KleinPipeline.from_pretrained(str(TINY_FLUX2), dtype=torch.float32)
    assert pipe.config.is_distilled is False
    with torch.no_grad():
        expected = pipe(prompt=PROMPTS, latents=noise, height=64, width=64, num_inference_steps=cfg.sampling.num_steps,
                        guidance_scale=4.0, max_sequence_length=cfg.data.max_sequence_length,
                        output_type="pt").images
    torch.testing.assert_close(ours, expected.float(), atol=1e-5, rtol=0)
    plain = sampler.decode(sampler.sample(parts.transformer, sampler.conditioning(cache, ids), init, eta=0.0).x0)
    assert (plain - expected).abs().max() > 0.05


def test_the_encoding_is_the_pipelines_at_the_presets_length(setup):
    cfg, parts, sampler, cache = setup
    pipe = Flux2KleinPipeline.from_pretrained(str(TINY_FLUX2), transformer=None, vae=None, dtype=torch.float32)
    embeds, text_ids = pipe.encode_prompt(PROMPTS, device=torch.device("cpu"),
                                          max_sequence_length=cfg.data.max_sequence_length)
    assert torch.equal(cache.embeds["prompt_embeds"], embeds)
    cond = sampler.conditioning(cache, [0, 1])
    assert torch.equal(cond.txt_ids, text_ids[0]) and cond.pooled is None and cond.guidance is None


def test_a_guidance_the_model_cannot_take_is_refused():
    from grpo.errors import ConfigError
    from grpo.inputs import check_guidance
    from tests import TINY

    check_guidance(str(TINY_FLUX2), 1.0)
    check_guidance(str(TINY), 3.5)  # FLUX.1's guidance embedding takes it
    with pytest.raises(ConfigError, match=r"^sampling.guidance: 3.5, but .* has no guidance embedding .* set "
                                          r"sampling.guidance=1.0$"):
        check_guidance(str(TINY_FLUX2), 3.5)


def test_true_cfg_on_a_step_distilled_klein_is_refused(tmp_path):
    """Flux2KleinPipeline ignores guidance_scale on a step-distilled klein (model_index.json is_distilled: true): true
    CFG there is refused in one line; on klein base (the tiny FLUX.2 folder, is_distilled: false) it is allowed."""
    import json
    import shutil

    from grpo.errors import ConfigError
    from grpo.inputs import check_guidance

    check_guidance(str(TINY_FLUX2), 1.0, true_cfg=True)
    distilled = tmp_path / "klein"
    shutil.copytree(TINY_FLUX2 / "transformer", distilled / "transformer")
    index = json.loads((TINY_FLUX2 / "model_index.json").read_text())
    (distilled / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    check_guidance(str(distilled), 1.0)  # without CFG, as Black Forest Labs samples it
    with pytest.raises(ConfigError, match=r"^sampling.true_cfg: .* is step-distilled .* ignores guidance on it; set "
                                          r"sampling.true_cfg=null .*\(recipes/configs/flux2_klein_base/\)$"):
        check_guidance(str(distilled), 1.0, true_cfg=True)


def test_the_attention_backend_reaches_every_flux2_processor():
    """model.attention_backend (e.g. _native_npu on Ascend) goes through diffusers' dispatcher: FLUX.2's double-block
    and fused single-block attention both take it."""
    from grpo.device import set_attention_backend

    model = FLUX2_KLEIN.load_transformer(str(TINY_FLUX2))
    assert set_attention_backend(model, "_native_math") == "_native_math"
    assert attention_backends(model) == {"Flux2AttnProcessor": "_native_math",
                                         "Flux2ParallelSelfAttnProcessor": "_native_math"}


def test_the_encoding_dtype_keys_the_cache(tmp_path):
    """data.text_encoder_dtype: a bf16 encoding (FLUX.2 [dev]'s 24 B encoder) is its own cache file; fp32 keeps the
    file name it had before the setting existed."""
    import dataclasses
    import hashlib
    import json

    from grpo.prompts import cache_file, ensure_cache, load_cache

    cfg = load_config(ROOT / "recipes/configs/tiny_flux2/grpo_lora.yaml", [f"data.cache_dir={tmp_path}"])
    prompts_file = tmp_path / "p.txt"
    prompts_file.write_text("\n".join(PROMPTS) + "\n")
    fp32 = ensure_cache(str(TINY_FLUX2), str(prompts_file), "data.train_prompts", cfg.data, torch.device("cpu"))
    bf16_data = dataclasses.replace(cfg.data, text_encoder_dtype="bf16")
    bf16 = ensure_cache(str(TINY_FLUX2), str(prompts_file), "data.train_prompts", bf16_data, torch.device("cpu"))
    assert fp32 != bf16 and fp32 == cache_file(tmp_path, str(TINY_FLUX2), PROMPTS, 32, "p")
    stats = sorted((str(f.relative_to(TINY_FLUX2)), f.stat().st_size, f.stat().st_mtime_ns)
                   for f in (TINY_FLUX2 / "text_encoder").glob("*") if f.is_file())
    key = json.dumps([str(TINY_FLUX2), 32, PROMPTS, stats]).encode()  # the key before text_encoder_dtype
    assert fp32.name == f"p-{hashlib.sha256(key).hexdigest()[:12]}.safetensors"
    a, b = load_cache(fp32).embeds["prompt_embeds"], load_cache(bf16).embeds["prompt_embeds"]
    assert a.dtype == b.dtype == torch.float32 and not torch.equal(a, b)
    torch.testing.assert_close(b, a, rtol=5e-2, atol=5e-2)


def _with_references(family, parts, sampler, cache, rows):
    """`cache` with one source image of the tiny edit set a prompt, encoded as the pipeline encodes its `image`."""
    from tests import EDITS

    paths = [str(EDITS.parent / "tiny_edit" / f"{i:03d}.png") for i in rows]
    refs = family.encode_references(parts.vae, paths, sampler.sampling.resolution, torch.device("cpu"))
    return PromptCache(cache.prompts, cache.embeds, references=refs,
                       reference_index=torch.arange(len(rows))[:, None]), paths


def test_ode_rollout_with_a_reference_image_reproduces_flux2_klein_pipeline(setup):
    """Flux2KleinPipeline(image=...): each prompt's reference image's tokens after the noisy ones, ids at T = 10. The
    same rollout without them is another image, so a reference lost on the way would fail."""
    from dataclasses import replace

    from diffusers.utils import load_image

    cfg, parts, sampler, cache = setup
    ids = list(range(len(PROMPTS)))
    refs, paths = _with_references(FLUX2_KLEIN, parts, sampler, cache, [0, 1, 2])
    init = sampler.initial_latents(0, ids)
    cond = sampler.conditioning(refs, ids)
    assert cond.ref_ids[:, 0].unique().tolist() == [10] and cond.ref_latents.shape == (3, 64, 16)
    ours = sampler.decode(sampler.sample(parts.transformer, cond, init, eta=0.0).x0)
    side = sampler.latent_size // 2
    noise = init.cpu().permute(0, 2, 1).reshape(len(ids), -1, side, side)
    pipe = Flux2KleinPipeline.from_pretrained(str(TINY_FLUX2), dtype=torch.float32)
    with torch.no_grad():
        expected = torch.cat([pipe(image=[load_image(paths[i])], prompt_embeds=cache.embeds["prompt_embeds"][i:i + 1],
                                   latents=noise[i:i + 1], height=64, width=64,
                                   num_inference_steps=cfg.sampling.num_steps, guidance_scale=1.0,
                                   output_type="pt").images for i in ids])
    torch.testing.assert_close(ours, expected.float(), atol=1e-5, rtol=0)
    blind = sampler.decode(sampler.sample(parts.transformer, replace(cond, ref_latents=None, ref_ids=None), init,
                                          eta=0.0).x0)
    assert (blind - expected).abs().max() > 0.1


def test_two_reference_images_get_their_own_time_offsets(setup):
    cfg, parts, sampler, cache = setup
    refs, _ = _with_references(FLUX2_KLEIN, parts, sampler, cache, [0, 1, 2])
    two = PromptCache(refs.prompts, refs.embeds, references=refs.references,
                      reference_index=torch.tensor([[0, 1], [1, 2], [2, 0]]))
    cond = sampler.conditioning(two, [1])
    assert cond.ref_latents.shape == (1, 128, 16) and cond.ref_ids[:, 0].unique().tolist() == [10, 20]
    assert torch.equal(cond.ref_latents[0, 64:], refs.references[2])


def test_a_flux2_dataset_gives_every_row_as_many_images(tmp_path):
    import json

    from grpo.errors import ConfigError
    from grpo.prompts import read_prompt_set
    from tests import EDITS

    image = str(EDITS.parent / "tiny_edit" / "000.png")
    (tmp_path / "mixed.jsonl").write_text(json.dumps({"prompt": "a red circle on a green background", "image": image})
                                          + "\n" + json.dumps({"prompt": "a red square"}) + "\n")
    with pytest.raises(ConfigError, match=r"^data.train_prompts: m.jsonl line 2 gives 0 images, line 1 gives 1; give "
                                          r"every row the same number of images$"):
        FLUX2_KLEIN.check_references(read_prompt_set(tmp_path / "mixed.jsonl"), "data.train_prompts", "m.jsonl",
                                     str(TINY_FLUX2))
    FLUX2_KLEIN.check_references(read_prompt_set(EDITS), "data.train_prompts", str(EDITS), str(TINY_FLUX2))


def test_true_cfg_keeps_the_first_pass_ratio_exactly_1_on_every_transition(setup):
    """grpo with sampling.true_cfg: the rollout records the guided transition's log-prob, and the update's
    recomputation (FluxSampler.transition, which the update, the reference and replay call) gives it back bit for bit
    on every transition: the ratio is exactly 1 with the gradient on, as the update runs it. Without CFG the sampler's
    velocity is the family's own call, nothing added."""
    import dataclasses

    cfg, parts, sampler, cache = setup
    assert sampler.velocity(parts.transformer).func == FLUX2_KLEIN.velocity  # cfg off: not one operation more
    s = dataclasses.replace(cfg.sampling, true_cfg=TrueCFGConfig(scale=4.0))
    guided = FluxSampler.from_parts(parts, parts.vae, s, cfg.seed, torch.device("cpu"), torch.float32)
    negative = FLUX2_KLEIN.encode_prompts(str(TINY_FLUX2), [""], cfg.data.max_sequence_length, torch.device("cpu"))
    ids = [0, 0, 1, 1]
    cond = guided.conditioning(PromptCache(cache.prompts, cache.embeds, negative=negative), ids)
    assert cond.negative.prompt_embeds.shape == cond.prompt_embeds.shape
    gens = [torch.Generator().manual_seed(300 + k) for k in range(len(ids))]
    traj = guided.sample(parts.transformer, cond, guided.initial_latents(0, ids), gens)
    plain = sampler.sample(parts.transformer, sampler.conditioning(cache, ids), guided.initial_latents(0, ids),
                           [torch.Generator().manual_seed(300 + k) for k in range(len(ids))])
    assert not torch.equal(traj.log_probs, plain.log_probs)  # the guided transitions are other transitions
    for j in range(s.num_steps):
        out = guided.transition(parts.transformer, cond, traj.latents, j)
        assert out.log_prob.requires_grad and torch.equal(out.log_prob.detach(), traj.log_probs[:, j]), j
        assert torch.equal(torch.exp(out.log_prob.detach() - traj.log_probs[:, j]), torch.ones(len(ids)))

    # BranchGRPO's trees: one guided call per node (the negative rows selected with their nodes), every edge exact
    from grpo.rollout import sample, transition
    from grpo.tree import Tree

    tree, rows = Tree(splits=(0, 2), factor=2, noise_scale=2.0, num_steps=s.num_steps), [0] * 4 + [1] * 4
    cond = guided.conditioning(PromptCache(cache.prompts, cache.embeds, negative=negative), rows)
    velocity = guided.velocity(parts.transformer)
    traj = sample(velocity, cond, guided.initial_latents(0, rows), guided.sigmas, guided.sde,
                  [torch.Generator().manual_seed(300 + k) for k in range(len(rows))], tree=tree)
    for j in tree.trained():
        out = transition(velocity, cond, traj.latents, guided.sigmas, j, guided.sde, tree)
        assert torch.equal(out.log_prob.detach(), traj.log_probs[tree.heads(len(rows), j + 1), j]), j


def test_nft_and_awm_train_the_velocity_their_setting_names_and_evals_guide_at_the_eval_scale(setup):
    """sampling.true_cfg.train: the forward-process objectives' velocity (FluxSampler.velocity_at, which the update,
    the lagging and the reference call) is the guided one with `guided` and the conditional call alone with
    `conditional`, while the rollouts guide either way. sampling.eval_cfg_scale: the evals' sampler guides at that
    scale with the same negative prompt (1.0: not at all), whatever the rollouts do."""
    import dataclasses

    cfg, parts, sampler, cache = setup
    negative = FLUX2_KLEIN.encode_prompts(str(TINY_FLUX2), [""], cfg.data.max_sequence_length, torch.device("cpu"))
    with_negative = PromptCache(cache.prompts, cache.embeds, negative=negative)
    ids = [0, 1]
    x, model = sampler.initial_latents(0, ids), parts.transformer

    def at(**kw):
        s = dataclasses.replace(cfg.sampling, **kw)
        built = FluxSampler.from_parts(parts, parts.vae, s, cfg.seed, torch.device("cpu"), torch.float32)
        with torch.no_grad():
            return built, built.velocity_at(model, x, 2, built.conditioning(with_negative, ids))

    plain = at()[1]
    guided_sampler, guided = at(true_cfg=TrueCFGConfig(scale=4.0, train="guided"))
    conditional_sampler, conditional = at(true_cfg=TrueCFGConfig(scale=4.0, train="conditional"))
    assert torch.equal(conditional, plain) and (guided - plain).abs().max() > 1e-2
    assert conditional_sampler.velocity(model).__name__ == "v"  # its rollouts still guide
    # evals: the rollouts' guidance by default; 1.0 = none; 4.0 on a run without CFG = the guided evals
    assert guided_sampler.for_eval().sampling.true_cfg.scale == 4.0
    assert at(true_cfg=TrueCFGConfig(scale=4.0, train="guided"), eval_cfg_scale=1.0)[0].for_eval().sampling.true_cfg \
        is None
    evaluated = at(eval_cfg_scale=4.0)[0].for_eval()
    assert evaluated.sampling.true_cfg == TrueCFGConfig(scale=4.0, negative_prompt="")
    init = evaluated.initial_latents(0, ids)
    ours = evaluated.sample(model, evaluated.conditioning(with_negative, ids), init, eta=0.0).x0
    theirs = guided_sampler.sample(model, guided_sampler.conditioning(with_negative, ids), init, eta=0.0).x0
    assert torch.equal(ours, theirs)
