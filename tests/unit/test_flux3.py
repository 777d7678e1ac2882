"""The sampler on FLUX.3 against diffusers' own Flux3ModularPipeline (the tiny FLUX.3 world), through the same
model-family layer and preset path the recipe uses: with eta 0 and the pipeline's schedule (its constant shift 6.93),
the same noise and the same embeddings, the images agree within 1e-5 in fp32, without CFG (guidance 1: the guider
off) and with true CFG 4 (the pipeline's ClassifierFreeGuidance, negative prompt "")."""

import dataclasses
import json
import shutil

import pytest
import torch

from grpo.config import load_config
from grpo.errors import ConfigError
from grpo.models import family_of
from grpo.models.flux3 import FLUX3
from grpo.prompts import PromptCache
from grpo.rollout import FluxSampler
from tests import EDITS, ROOT, TINY_FLUX3, attention_backends, true_cfg_sampler

pytestmark = pytest.mark.skipif(not (TINY_FLUX3 / "modular_model_index.json").exists(),
                                reason="tiny FLUX.3 not built")
EDITS_DIR = EDITS.parent / "tiny_edit"  # the tiny edit set's source images, 64 px
PROMPTS = ["a red circle on a blue background", "a green square on a yellow background",
           "a cyan triangle on the left on a magenta background"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = load_config(ROOT / "recipes/configs/tiny_flux3/grpo_lora.yaml",
                      [f"model.path={TINY_FLUX3}", "sampling.shift=dynamic"])
    parts = FLUX3.load_parts(str(TINY_FLUX3))
    sampler = FluxSampler.from_parts(parts, parts.vae, cfg.sampling, cfg.seed, torch.device("cpu"), torch.float32)
    cache = PromptCache(PROMPTS, FLUX3.encode_prompts(str(TINY_FLUX3), PROMPTS, cfg.data.max_sequence_length,
                                                      torch.device("cpu")))
    return cfg, parts, sampler, cache


def pipeline_images(noise: torch.Tensor, steps: int, guidance: float,
                    references: list[str] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Flux3ModularPipeline's images of PROMPTS (one prompt a call, as its text-encoder step takes them) from `noise`
    [B, C, h, w], each given its reference image if `references` names them, and the prompt embeddings its
    text-encoder step made."""
    from PIL import Image

    from maintainer.tiny_worlds.flux3 import sampling_pipeline

    pipe = sampling_pipeline(TINY_FLUX3, guidance)
    images, embeds = [], []
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS[: len(noise)]):
            image = {} if references is None else {"image": Image.open(references[i]).convert("RGB")}
            out = pipe(prompt=prompt, latents=noise[i : i + 1], height=64, width=64, num_inference_steps=steps,
                       output_type="pt", output=["images", "prompt_embeds"], **image)
            images.append(out["images"])
            embeds.append(out["prompt_embeds"])
    return torch.cat(images).float(), embeds


def guided(setup, tmp_path, guidance: float) -> tuple[FluxSampler, PromptCache]:
    """The setup's sampler and cache at guidance 1; at guidance > 1 a sampler with true CFG and the cache with the
    negative prompt's embeddings (tests.true_cfg_sampler)."""
    cfg, parts, plain, cache = setup
    return (plain, cache) if guidance == 1.0 else true_cfg_sampler(cfg, parts, cache, TINY_FLUX3, tmp_path, guidance)


def test_the_folder_is_flux3():
    assert family_of(TINY_FLUX3) is FLUX3
    index = json.loads((TINY_FLUX3 / "modular_model_index.json").read_text())
    assert index["_class_name"] == "Flux3ModularPipeline"


def test_the_schedule_is_the_pipelines_constant_shift(setup):
    cfg, parts, sampler, _ = setup
    assert parts.scheduler_config["shift"] == pytest.approx(6.93)
    assert not parts.scheduler_config["use_dynamic_shifting"]
    n = cfg.sampling.num_steps
    u = torch.linspace(1.0, 1 / n, n, dtype=torch.float64)
    expected = torch.cat([6.93 * u / (1 + 5.93 * u), torch.zeros(1, dtype=torch.float64)]).float()
    torch.testing.assert_close(sampler.sigmas.cpu(), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_ode_rollout_reproduces_flux3_modular_pipeline(setup, tmp_path, guidance):
    """Guidance 1: one call a step, the conditional velocity; guidance 4: the sampler's true CFG (sampling.true_cfg,
    negative prompt "" through the recipe's cache) against the pipeline's ClassifierFreeGuidance. The pipeline
    encodes the prompts itself: its embeddings are the cache's too."""
    cfg, parts, plain, cache = setup
    ids = list(range(len(PROMPTS)))
    sampler, cond_cache = guided(setup, tmp_path, guidance)
    init = sampler.initial_latents(0, ids)
    # One row a call, as the pipeline samples: the same bits (0.0 at guidance 1 and 4 on the 3000-step world,
    # 2026-12-07), where the recipe's batch of three rows rounds 2.5e-6 / 9.3e-6 apart, at the tolerance's edge.
    ours = torch.cat([sampler.decode(sampler.sample(parts.transformer, sampler.conditioning(cond_cache, [i]),
                                                    init[i : i + 1], eta=0.0).x0) for i in ids])
    # The pipeline draws its noise as [B, 4C, h/2, w/2] and flattens it to tokens: the same numbers, unflattened.
    side = sampler.latent_size // 2
    noise = init.cpu().transpose(1, 2).reshape(len(ids), -1, side, side)
    expected, embeds = pipeline_images(noise, cfg.sampling.num_steps, guidance)
    torch.testing.assert_close(torch.cat(embeds), cache.embeds["prompt_embeds"], atol=0, rtol=0)
    assert ours.shape == expected.shape == (3, 3, 64, 64)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)
    if guidance != 1.0:  # CFG is another image: the test would catch a guider that did nothing
        plain_images = plain.decode(plain.sample(parts.transformer, plain.conditioning(cache, ids), init, eta=0.0).x0)
        assert (plain_images - ours).abs().max() > 1e-2


def test_the_flow_map_is_refused_in_one_line(tmp_path):
    """The step-distilled FLUX.3 (transformer flow_map: true) is refused from its config, before any weight."""
    folder = tmp_path / "distilled"
    (folder / "transformer").mkdir(parents=True)
    index = json.loads((TINY_FLUX3 / "modular_model_index.json").read_text())
    (folder / "modular_model_index.json").write_text(json.dumps({**index, "_class_name":
                                                                 "Flux3DistilledModularPipeline"}))
    config = json.loads((TINY_FLUX3 / "transformer" / "config.json").read_text())
    (folder / "transformer" / "config.json").write_text(json.dumps({**config, "flow_map": True}))
    with pytest.raises(ConfigError, match="flow_map: true") as err:
        family_of(folder)
    assert "\n" not in str(err.value)
    shutil.rmtree(folder)


def test_the_attention_backend_reaches_every_flux3_processor():
    """model.attention_backend (_native_npu on Ascend; _native_math stands in on the CPU, as for FLUX.2) goes
    through diffusers' dispatcher: every attention of FLUX.3's per-mode blocks (image, reference images, text) and
    joint single blocks is a Flux3AttnProcessor, and each takes it. The transformer passes no attention mask, so
    npu_fusion_attention gets none to convert."""
    from grpo.device import set_attention_backend

    model = FLUX3.load_transformer(str(TINY_FLUX3))
    attentions = [m for m in model.modules() if hasattr(m, "processor")]
    modes = [*model.mode_blocks.values(), model.txt_mode_blocks]  # image, image_cond; text
    assert len(attentions) == sum(map(len, modes)) + len(model.single_transformer_blocks) == 7
    assert set_attention_backend(model, "_native_math") == "_native_math"
    assert attention_backends(model) == {"Flux3AttnProcessor": "_native_math"}


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_ode_rollout_with_a_reference_image_reproduces_flux3_modular_pipeline(setup, tmp_path, guidance):
    """Editing: each prompt with a reference image (the tiny edit set's 64 px renders), encoded once by
    FLUX3.encode_references (the pipeline's Flux3VaeEncoderStep) and sampled with its ids at L = -1, against
    Flux3ModularPipeline given the same image (its image-conditioned workflow), fp32, without CFG and with CFG 4 (the
    negative branch sees the row's reference too, as the pipeline's guider passes it to both). Two prompts, sampled
    one a call as the pipeline samples them: the same math then gives the same bits (0.0 here, 2026-12-07), while a
    batch of two rows rounds differently (8.9e-6 at CFG 4, the edge of the tolerance)."""
    cfg, parts, _, _ = setup
    sampler, cache = guided(setup, tmp_path, guidance)
    ids = [0, 1]
    paths = [str(EDITS_DIR / f"{i:03d}.png") for i in ids]
    refs = FLUX3.encode_references(parts.vae, paths, cfg.sampling.resolution, torch.device("cpu"))
    assert refs.shape == (2, (sampler.latent_size // 2) ** 2, parts.transformer.config.cond_in_channels)
    edit = dataclasses.replace(cache, references=refs, reference_index=torch.tensor([[0], [1], [0]]))
    assert sampler.conditioning(edit, ids).ref_ids[:, 3].unique().tolist() == [-1.0]
    init = sampler.initial_latents(0, ids)
    ours = torch.cat([sampler.decode(sampler.sample(parts.transformer, sampler.conditioning(edit, [i]), init[i : i + 1],
                                                    eta=0.0).x0) for i in ids])
    side = sampler.latent_size // 2
    noise = init.cpu().transpose(1, 2).reshape(len(ids), -1, side, side)
    expected, _ = pipeline_images(noise, cfg.sampling.num_steps, guidance, references=paths)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)
    blind = sampler.decode(sampler.sample(parts.transformer, sampler.conditioning(cache, ids), init, eta=0.0).x0)
    assert (blind - ours).abs().max() > 1e-2  # the reference changes the image: a dropped one would fail


def test_two_references_take_l_minus_one_and_minus_two(setup):
    """Several references a row: one token sequence, the i-th image's ids at L = -(1 + i), as
    Flux3PrepareImageCondLatentsStep packs them; its H and W on the noisy grid's scaled positions."""
    _, _, sampler, _ = setup
    ids = FLUX3.reference_ids(sampler.latent_size, 2, torch.device("cpu"))
    tokens = (sampler.latent_size // 2) ** 2
    assert ids.shape == (2 * tokens, 4) and ids.dtype == torch.float32
    assert ids[:tokens, 3].unique().tolist() == [-1.0] and ids[tokens:, 3].unique().tolist() == [-2.0]
    torch.testing.assert_close(ids[:tokens, :3], FLUX3.image_ids(sampler.latent_size, torch.device("cpu"))[:, :3])
