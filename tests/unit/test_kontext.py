"""FLUX.1-Kontext through the model-family layer: the tiny Kontext folder, its edit set, the source-image cache, the
start-up checks, the planner's reference tokens, and the sampler against diffusers' own FluxKontextPipeline."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from diffusers import FluxKontextPipeline
from diffusers.utils import load_image

from grpo.config import load_config
from grpo.errors import ConfigError
from grpo.models import family_of
from grpo.models.flux1 import FLUX1, FLUX1_KONTEXT
from grpo.prompts import PromptCache, ensure_references, load_cache, read_prompt_set
from grpo.rollout import FluxSampler
from grpo.tiny import world
from tests import EDITS, EDITS_HELDOUT, ROOT, TINY, TINY_KONTEXT

pytestmark = pytest.mark.skipif(not (TINY_KONTEXT / "model_index.json").exists(), reason="tiny Kontext not built")
PRESET = ROOT / "recipes/configs/tiny_kontext/grpo_lora.yaml"
ROWS = [0, 1, 2]


@pytest.fixture(scope="module")
def setup():
    cfg = load_config(PRESET, ["sampling.shift=dynamic"])  # the pipeline's own schedule
    rows = read_prompt_set(EDITS)
    parts = FLUX1_KONTEXT.load_parts(str(TINY_KONTEXT))
    sampler = FluxSampler.from_parts(parts, parts.vae, cfg.sampling, cfg.seed, torch.device("cpu"), torch.float32)
    prompts = [rows.prompts[i] for i in ROWS]
    paths = [rows.metadata[i]["image"] for i in ROWS]
    embeds = FLUX1_KONTEXT.encode_prompts(str(TINY_KONTEXT), prompts, cfg.data.max_sequence_length,
                                          torch.device("cpu"))
    refs = FLUX1_KONTEXT.encode_references(parts.vae, paths, cfg.sampling.resolution, torch.device("cpu"))
    cache = PromptCache(prompts, embeds, references=refs, reference_index=torch.arange(len(ROWS))[:, None])
    return cfg, parts, sampler, cache, paths


def test_the_folder_is_kontext_and_the_builders():
    assert family_of(TINY_KONTEXT) is FLUX1_KONTEXT and family_of(TINY) is FLUX1
    index = json.loads((TINY_KONTEXT / "model_index.json").read_text())
    source = json.loads((TINY / "model_index.json").read_text())
    assert index == {**source, "_class_name": "FluxKontextPipeline"}
    for name in ("vae", "text_encoder", "text_encoder_2", "tokenizer", "scheduler"):  # the tiny FLUX.1's very files
        assert (TINY_KONTEXT / name).resolve() == (TINY / name).resolve()
    # its own transformer, trained to edit (maintainer/tiny_worlds/kontext.py)
    assert not (TINY_KONTEXT / "transformer").is_symlink()
    info = json.loads((TINY_KONTEXT / "build_info.json").read_text())
    assert info["transformer_steps"] > 0 and info["eval"]["edit_score_mean"] > info["eval"]["unchanged_source_score_mean"]


@pytest.mark.parametrize("copy", [False, True])
def test_the_builder_writes_a_folder_kontext_loads(tmp_path, copy):
    from maintainer.tiny_worlds.cli import main

    out = tmp_path / "kontext"
    main(["--family", "flux1-kontext", "--out", str(out), "--init-from", str(TINY), *(["--copy"] if copy else [])])
    assert (out / "transformer").is_symlink() is not copy
    pipe = FluxKontextPipeline.from_pretrained(str(out), local_files_only=True)
    assert type(pipe).__name__ == "FluxKontextPipeline" and family_of(out) is FLUX1_KONTEXT
    with pytest.raises(SystemExit, match="--vae-steps: --family flux1-kontext trains the transformer only"):
        main(["--family", "flux1-kontext", "--out", str(out), "--vae-steps", "5"])


def test_the_builder_trains_a_copy_of_the_transformer_to_edit(tmp_path):
    from safetensors.torch import load_file

    from maintainer.tiny_worlds.cli import main

    out = tmp_path / "kontext"
    main(["--family", "flux1-kontext", "--out", str(out), "--init-from", str(TINY), "--transformer-steps", "2",
          "--transformer-batch", "4", "--images-per-prompt", "1", "--eval-seeds", "0"])
    assert (out / "vae").is_symlink() and not (out / "transformer").is_symlink()
    trained = load_file(out / "transformer/diffusion_pytorch_model.safetensors")
    source = load_file(TINY / "transformer/diffusion_pytorch_model.safetensors")
    assert trained.keys() == source.keys() and any(not torch.equal(trained[k], source[k]) for k in source)
    info = json.loads((out / "build_info.json").read_text())
    assert info["transformer_steps"] == 2 and "eval" not in info
    assert FluxKontextPipeline.from_pretrained(str(out), local_files_only=True).transformer is not None


def test_ode_rollout_reproduces_flux_kontext_pipeline(setup):
    """eta 0 and the pipeline's dynamic schedule: the sampler's images are FluxKontextPipeline's from the same noise
    and source image (one pipeline call a row; the sampler batches them). The reference tokens matter: the same
    rollout without them is another image."""
    cfg, parts, sampler, cache, paths = setup
    init = sampler.initial_latents(0, ROWS)
    cond = sampler.conditioning(cache, ROWS)
    ours = sampler.decode(sampler.sample(parts.transformer, cond, init, eta=0.0).x0)
    pipe = FluxKontextPipeline.from_pretrained(str(TINY_KONTEXT), dtype=torch.float32)
    res = cfg.sampling.resolution
    with torch.no_grad():
        expected = torch.cat([pipe(image=load_image(paths[i]), prompt_embeds=cache.embeds["prompt_embeds"][i:i + 1],
                                   pooled_prompt_embeds=cache.embeds["pooled"][i:i + 1], latents=init[i:i + 1],
                                   height=res, width=res, max_area=res * res, _auto_resize=False,
                                   num_inference_steps=cfg.sampling.num_steps, guidance_scale=cfg.sampling.guidance,
                                   output_type="pt").images for i in range(len(ROWS))])
    assert ours.shape == expected.shape == (3, 3, res, res)
    torch.testing.assert_close(ours, expected.float(), atol=1e-5, rtol=0)
    blind = sampler.decode(sampler.sample(parts.transformer, replace(cond, ref_latents=None, ref_ids=None), init,
                                          eta=0.0).x0)
    assert (blind - expected).abs().max() > 0.1


def test_the_reference_tokens_are_the_pipelines(setup):
    """encode_references and reference_ids are FluxKontextPipeline.prepare_latents' image_latents and image_ids."""
    cfg, parts, sampler, cache, paths = setup
    pipe = FLUX1_KONTEXT.vae_pipeline(parts.vae)
    res = cfg.sampling.resolution
    image = pipe.image_processor.preprocess(pipe.image_processor.resize(load_image(paths[1]), res, res), res, res)
    _, image_latents, latent_ids, image_ids = pipe.prepare_latents(image, 1, 4, res, res, torch.float32,
                                                                   torch.device("cpu"))
    assert torch.equal(cache.references[1], image_latents[0])
    cond = sampler.conditioning(cache, [1, 1, 0])  # a group shares its prompt's image
    assert torch.equal(cond.ref_ids, image_ids) and torch.equal(cond.img_ids, latent_ids)
    assert torch.equal(cond.ref_latents[0], cond.ref_latents[1]) and not torch.equal(cond.ref_latents[0],
                                                                                      cond.ref_latents[2])
    picked = cond.select(torch.tensor([2]))
    assert torch.equal(picked.ref_latents[0], cache.references[0]) and picked.ref_ids is cond.ref_ids


def test_text_to_image_conditioning_has_no_reference_tokens():
    """FLUX.1's calls stay what they were: no reference fields, the transformer sees the noisy tokens only."""
    embeds = {"prompt_embeds": torch.zeros(2, 4, 8), "pooled": torch.zeros(2, 8)}
    cond = FLUX1.conditioning(embeds, 8, 3.5, True, torch.device("cpu"), torch.float32)
    assert cond.ref_latents is None and cond.ref_ids is None and cond.select(slice(0, 1)).ref_latents is None
    seen = {}

    def model(hidden_states, img_ids, **kw):
        seen.update(hidden=hidden_states.shape, ids=img_ids.shape)
        return (hidden_states * 2,)

    x = torch.randn(2, 16, 16)
    assert torch.equal(FLUX1.velocity(model, x, torch.ones(2), cond), x * 2)
    assert seen == {"hidden": (2, 16, 16), "ids": (16, 3)}
    refs = replace(cond, ref_latents=torch.randn(2, 16, 16), ref_ids=torch.ones(16, 3))
    assert torch.equal(FLUX1_KONTEXT.velocity(model, x, torch.ones(2), refs), x * 2)  # cut back to the noisy tokens
    assert seen == {"hidden": (2, 32, 16), "ids": (32, 3)}
    with pytest.raises(RuntimeError, match="without source-image latents"):
        FLUX1_KONTEXT.conditioning(embeds, 8, 3.5, True, torch.device("cpu"), torch.float32)


def test_the_source_images_are_encoded_once_and_keyed_on_their_bytes(tmp_path):
    data = tmp_path / "edits"
    (data / "img").mkdir(parents=True)
    shutil.copy(EDITS.parent / "tiny_edit/000.png", data / "img/a.png")
    shutil.copy(EDITS.parent / "tiny_edit/001.png", data / "img/b.png")
    rows_file = data / "edits.jsonl"
    rows_file.write_text("".join(json.dumps({"prompt": p, "image": i}) + "\n" for p, i in
                                 (("a red circle on a blue background", "img/a.png"),
                                  ("a red square on a blue background", "img/b.png"),
                                  ("a blue circle on a red background", "img/a.png"))))
    rows = read_prompt_set(rows_file)
    cache_dir, cpu = tmp_path / "cache", torch.device("cpu")
    path = ensure_references(str(TINY_KONTEXT), str(rows_file), rows, cache_dir, 64, cpu)
    latents, index = load_references_of(path, rows)
    assert latents.shape == (2, 64, 16) and index.tolist() == [[0], [1], [0]]  # two distinct images, 8 x 8 tokens
    mtime = path.stat().st_mtime_ns
    assert ensure_references(str(TINY_KONTEXT), str(rows_file), rows, cache_dir, 64, cpu) == path
    assert path.stat().st_mtime_ns == mtime  # read back, not encoded again
    moved = tmp_path / "moved"
    shutil.copytree(data, moved)  # the same bytes elsewhere: the same cache
    assert ensure_references(str(TINY_KONTEXT), str(moved / "edits.jsonl"), read_prompt_set(moved / "edits.jsonl"),
                             cache_dir, 64, cpu) == path
    assert ensure_references(str(TINY_KONTEXT), str(rows_file), rows, cache_dir, 32, cpu) != path  # resolution
    # the same distinct images and file name, but the last row gets b: another index, another cache
    swapped = tmp_path / "swapped" / "edits.jsonl"
    swapped.parent.mkdir()
    swapped.write_text("".join(json.dumps({"prompt": r, "image": f"../edits/{i}"}) + "\n" for r, i in
                               zip(rows.prompts, ("img/a.png", "img/b.png", "img/b.png"))))
    other = ensure_references(str(TINY_KONTEXT), str(swapped), read_prompt_set(swapped), cache_dir, 64, cpu)
    assert other != path and load_references_of(other, read_prompt_set(swapped))[1].tolist() == [[0], [1], [1]]
    shutil.copy(EDITS.parent / "tiny_edit/002.png", data / "img/b.png")  # an edited image: a new cache
    assert ensure_references(str(TINY_KONTEXT), str(rows_file), rows, cache_dir, 64, cpu) != path
    text_only = read_prompt_set(ROOT / "assets/prompts/tiny_train.txt")
    assert ensure_references(str(TINY), "tiny_train.txt", text_only, cache_dir, 64, cpu) is None


def load_references_of(path, rows):
    from grpo.references import load_references

    return load_references(path, rows)


def test_load_cache_attaches_the_references(tmp_path):
    cfg = load_config(PRESET, [f"data.cache_dir={tmp_path}"])
    from grpo.prompts import ensure_cache

    rows = read_prompt_set(EDITS_HELDOUT, "data.eval_prompts")
    refs = ensure_references(str(TINY_KONTEXT), str(EDITS_HELDOUT), rows, tmp_path, 64, torch.device("cpu"))
    cache = load_cache(ensure_cache(str(TINY_KONTEXT), str(EDITS_HELDOUT), "data.eval_prompts", cfg.data,
                                    torch.device("cpu"), rows), rows, refs)
    got = cache.rows([3, 3, 5])
    assert got["ref_latents"].shape == (3, 64, 16) and torch.equal(got["ref_latents"][0], got["ref_latents"][1])
    assert torch.equal(got["ref_latents"][2], cache.references[cache.reference_index[5, 0]])


@pytest.mark.parametrize("model, prompts, words", [
    (TINY_KONTEXT, "assets/prompts/tiny_train.jsonl",
     "data.train_prompts: assets/prompts/tiny_train.jsonl line 1 has no source image, but model.path "
     f"{TINY_KONTEXT} is a FluxKontextPipeline, which edits one; give every row an \"image\""),
    (TINY, "assets/prompts/tiny_edit_train.jsonl",
     "data.train_prompts: assets/prompts/tiny_edit_train.jsonl line 1 gives an image, but model.path "
     f"{TINY} is a FluxPipeline (text to image), which takes none; drop the image/images fields"),
])
def test_images_that_do_not_fit_the_family_are_one_line_at_start_up(model, prompts, words, tmp_path):
    from grpo.inputs import check_inputs

    cfg = load_config(PRESET, [f"model.path={model}", f"data.train_prompts={prompts}", "data.eval_prompts=null",
                               f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError) as e:
        check_inputs(cfg, 1)
    assert str(e.value).startswith(words) and "\n" not in str(e.value)


def test_two_images_a_row_are_refused_for_kontext(tmp_path):
    (tmp_path / "two.jsonl").write_text(json.dumps(
        {"prompt": "a red circle on a blue background",
         "images": [str(EDITS.parent / "tiny_edit/000.png"), str(EDITS.parent / "tiny_edit/001.png")]}) + "\n")
    with pytest.raises(ConfigError, match=r"line 1 gives 2 images, but a FluxKontextPipeline takes at most 1; keep 1"):
        FLUX1_KONTEXT.check_references(read_prompt_set(tmp_path / "two.jsonl"), "data.train_prompts", "two.jsonl",
                                       str(TINY_KONTEXT))


def test_the_edit_set_is_the_worlds_own():
    """assets/prompts/tiny_edit_* are what python -m maintainer.tiny_worlds.prompts writes; every row is an edit of
    one part, its prompt and metadata the target scene, held-out targets never trained on."""
    files = world.edit_files()
    for name, data in files.items():
        assert (EDITS.parent / name).read_bytes() == data, (
            f"{name}: regenerate with python -m maintainer.tiny_worlds.prompts")
    assert sum(len(d) for d in files.values()) < 200_000
    train, heldout = read_prompt_set(EDITS), read_prompt_set(EDITS_HELDOUT)
    assert (len(train), len(heldout)) == (73, 17)
    assert not set(train.prompts) & set(heldout.prompts)
    for rows in (train, heldout):
        for prompt, meta in zip(rows.prompts, rows.metadata):
            target, source = world.parse(prompt), world.parse(meta["source"])
            assert world.scene(meta) == target
            changed = [f for f, a, b in zip(world.SCENE_FIELDS, source, target) if a != b]
            assert changed == [meta["edit"]]


def test_the_planner_counts_the_reference_tokens():
    from tools.plan import model_family, model_configs, plan

    kontext = load_config(ROOT / "recipes/configs/flux1_kontext_dev/grpo_lora.yaml",
                          ["data.train_prompts=assets/prompts/tiny_edit_train.jsonl", "data.eval_prompts=null"])
    t, v = model_configs(kontext.model.path)
    assert model_family(kontext.model.path, t) is FLUX1_KONTEXT
    assert model_family("black-forest-labs/FLUX.1-dev", t) is FLUX1 and model_family(str(TINY_KONTEXT), t) is \
        FLUX1_KONTEXT
    # the tiny preset traces in a second (FLUX.1-Kontext-dev's 12 B parameters take a minute on the meta device)
    tiny = load_config(PRESET)
    with_refs = plan(tiny, 2)
    without = plan(tiny, 2, family=FLUX1)
    assert with_refs.image_tokens == 2 * without.image_tokens == 2 * 64
    assert with_refs.phases["update"]["activations"] > 1.5 * without.phases["update"]["activations"]
    assert any("64 noisy + 64 reference" in n for n in with_refs.notes)
    # FLUX.2 [klein] takes reference images when its dataset gives them, and counts them then only
    from grpo.models.flux2 import FLUX2_KLEIN

    klein = load_config(ROOT / "recipes/configs/tiny_flux2/grpo_lora.yaml")
    assert plan(klein, 2).image_tokens == 64
    assert plan(load_config(ROOT / "recipes/configs/tiny_flux2/grpo_lora.yaml",
                            [f"data.train_prompts={EDITS}"]), 2, family=FLUX2_KLEIN).image_tokens == 128
    # the real klein editing preset: 512 px, 1024 noisy + 1024 reference tokens (configs shipped in tools/)
    edit = load_config(ROOT / "recipes/configs/experimental/flux2_klein_edit_nft_lora.yaml",
                       [f"data.train_prompts={EDITS}", "data.eval_prompts=null"])
    assert plan(edit, 8, family=FLUX2_KLEIN).image_tokens == 2 * 1024


def test_the_tiny_grpo_preset_on_the_kontext_base_is_the_kontext_preset():
    """tiny_kontext/grpo_lora.yaml is tiny/grpo_lora.yaml with the tiny Kontext model base in place of the tiny FLUX.1
    one (grpo.schema.read_preset's swap): editing changes the model base only, not the objective."""
    from grpo.schema import merge, read_preset

    configs = ROOT / "recipes/configs"
    laid = read_preset(configs / "tiny/grpo_lora.yaml",
                       swap={configs / "tiny/base.yaml": configs / "tiny_kontext/base.yaml"})
    assert merge(laid, {"output_dir": "runs/tiny_kontext_grpo_lora"}) == read_preset(PRESET)


def test_the_held_out_eval_samples_each_edit_from_its_source_image(tmp_path):
    """tools.eval on the Kontext preset: its edits' source images are encoded into the cache and condition the eval
    samples (the first edit's eval image is the sampler's with that row's image; another row's image changes it)."""
    from tools.eval import evaluate_checkpoint

    cfg = load_config(PRESET, [f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'run'}",
                               "logging.eval_seeds=1"])
    got = evaluate_checkpoint(cfg, None, out_dir=tmp_path / "eval")
    assert got["images"]["base"].shape == (17, 3, 64, 64) and len(list((tmp_path / "cache").glob("*-ref-*"))) == 1
    rows = read_prompt_set(EDITS_HELDOUT)
    parts = FLUX1_KONTEXT.load_parts(str(TINY_KONTEXT))
    sampler = FluxSampler.from_parts(parts, parts.vae, cfg.sampling, cfg.seed, torch.device("cpu"), torch.float32)
    embeds = FLUX1_KONTEXT.encode_prompts(str(TINY_KONTEXT), rows.prompts[:1], 32, torch.device("cpu"))
    paths = [rows.metadata[0]["image"], rows.metadata[1]["image"]]
    refs = FLUX1_KONTEXT.encode_references(parts.vae, paths, 64, torch.device("cpu"))
    from grpo.eval import sample_heldout

    diffs = []
    for k in (0, 1):  # row 0's own image, then row 1's
        cache = PromptCache(rows.prompts[:1], embeds, references=refs, reference_index=torch.tensor([[k]]))
        image = sampler.decode(sample_heldout(parts.transformer, sampler, cache, [0], 1)[0])
        diffs.append((image - got["images"]["base"][:1]).abs().max().item())
    assert diffs[0] < 1e-5 and diffs[1] > 0.1, diffs  # 1e-5: the eval decodes 8 images a batch, here 1


def test_the_tiny_edit_reward_reads_each_rows_target_scene_and_source_image(tmp_path):
    from grpo.prompt_sets import read_image, row_images
    from grpo.rewards import build_rewards, check_reward_metadata

    rows = read_prompt_set(EDITS)
    check_reward_metadata({"tiny_edit": 1.0}, rows, "data.train_prompts", str(EDITS))
    reward = build_rewards({"tiny_edit": 1.0}, torch.device("cpu")).rewards["tiny_edit"]
    sources, right = [], []
    for prompt, meta in zip(rows.prompts, rows.metadata):
        number = int(row_images(meta)[0].split("/")[-1].split(".")[0])  # world.edit_files' seed of the image
        s, t = world.render_edits([meta["source"]], [prompt], 64, torch.Generator().manual_seed(number))
        assert torch.equal(read_image(row_images(meta)[0]), s[0])  # the shipped source is that render, losslessly
        sources.append(s[0])
        right.append(t[0])
    sources, right = torch.stack(sources), torch.stack(right)
    scored = reward(right, rows.prompts, rows.metadata)
    assert scored.min() > 0.9
    expected = world.edit_score(sources, [world.scene(m) for m in rows.metadata], sources,
                                [world.parse(m["source"]) for m in rows.metadata])
    assert torch.equal(reward(sources, rows.prompts, rows.metadata), expected)
    # the prompt text is not read: the target scene comes from the metadata
    assert torch.equal(reward(right, ["a red circle on a blue background"] * len(rows), rows.metadata), scored)
    bad = tmp_path / "bad.jsonl"
    lines = EDITS.read_text().splitlines()
    row = json.loads(lines[1])
    row.pop("source")
    row["image"] = str(EDITS.parent / row["image"])
    bad.write_text(lines[0].replace('"tiny_edit/', f'"{EDITS.parent}/tiny_edit/') + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match=r"^data.train_prompts: \S+bad.jsonl line 2 needs one source image .* which "
                                          r"rewards.tiny_edit reads"):
        check_reward_metadata({"tiny_edit": 1.0}, read_prompt_set(bad), "data.train_prompts", str(bad))
