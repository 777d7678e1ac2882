"""The tiny worlds' models and prompt files, built offline from the synthetic world (grpo/tiny/world.py).

    python -m maintainer.tiny_worlds --out assets/tiny-flux [--vae-steps N] [--transformer-steps N] [--seed S]
    python -m maintainer.tiny_worlds --out NEW --init-from OLD [--decoder-steps N] [--transformer-steps N]
    python -m maintainer.tiny_worlds --family flux2 --out assets/tiny-flux2 [same flags]
    python -m maintainer.tiny_worlds --family flux2-dev --untrained --out OUT
    python -m maintainer.tiny_worlds --family flux3 --out assets/tiny-flux3 [--transformer-steps N] [--seed S]
    python -m maintainer.tiny_worlds --family flux1-kontext --out assets/tiny-flux-kontext
        [--init-from assets/tiny-flux] [--transformer-steps N]
    python -m maintainer.tiny_worlds.prompts [FOLDER]      # assets/prompts/tiny_*: prompts, scenes, the edit set

One package, imported in one direction (no module imports one that imports it):

    build.py    the phases every family goes through (`build`) and what they share: world renders, VAE training,
                the latent pool, the flow-matching loop, the scoring of samples; a `Builder` is what a family adds
    flux1.py    FLUX.1 (FluxPipeline): CLIP + T5 tokenizers and encoders, AutoencoderKL, FluxTransformer2DModel
    flux2.py    FLUX.2 [klein] (Flux2KleinPipeline, Qwen3) and an untrained FLUX.2 [dev] (Flux2Pipeline, Mistral3)
    kontext.py  the FLUX.1 build laid out as a FluxKontextPipeline, its transformer trained to edit (uses flux1.py)
    flux3.py    FLUX.3 (Flux3ModularPipeline, Qwen3-VL), the tiny FLUX.2 VAE reused; its own build (no classic pipeline)
    cli.py      the command line above (`python -m maintainer.tiny_worlds`)
    prompts.py  the prompt files (`python -m maintainer.tiny_worlds.prompts`)

Each `Builder` holds the product's model family (grpo.models: FLUX1, FLUX2_KLEIN, FLUX2_DEV, FLUX1_KONTEXT; flux3.py uses FLUX3 without a Builder), from
which the pipeline class, the latent packing, the RoPE ids and the transformer call come, so a tiny model is
pretrained with the very calls the trainer makes. What only a build needs (tokenizer training, random text encoders,
the VAE's latent normalisation, the pretraining loops) stays here, out of the product.
"""
