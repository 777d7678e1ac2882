"""A synthetic prompt -> image world for the embedded tiny FLUX model, with a programmatic reward.

Prompts read "a {color} {shape} on a {background} background". An image of the world is a flat background with one
axis-aligned filled shape (circle, square or apex-up triangle) of another colour, placed near the centre. The colours
are six corners of the RGB cube, so any two differ by a full unit in at least one channel.

`score` grades any image against a prompt with three soft terms, each in [0, 1]:

- background: how well a thin border ring matches the background colour;
- presence: how much of the image carries the shape colour, 1 inside the area range the renderer produces;
- form: the fill ratio of the shape-colour mask inside its bounding box (square 1, circle ~0.79, triangle ~0.5) and
  the share of that mass in the upper half of the box (1/2, 1/2, 1/4), against the values the prompted shape gives,
  gated by presence.

All terms are continuous in the pixel values, so two similar images get slightly different scores, which GRPO needs.
"""

from __future__ import annotations

import functools
import itertools
import json
import re

import torch

COLORS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
    "magenta": (1.0, 0.0, 1.0),
    "cyan": (0.0, 1.0, 1.0),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
TEMPLATE = "a {color} {shape} on a {background} background"

# Shape half-extent and centre jitter as fractions of the image side. The shape always stays inside
# 0.5 +- (JITTER + RADIUS_MAX) = [0.12, 0.88], clear of the border ring the background term reads.
RADIUS_MIN, RADIUS_MAX = 0.18, 0.28
JITTER = 0.1

# Soft colour membership exp(-d^2 / (2 tau^2)): 0.5 off in one channel keeps ~0.25, a wrong colour (d >= 1) ~0.004.
COLOR_TAU = 0.3
# Rendered shape areas span ~0.065 (small triangle) to ~0.31 (large square) of the image.
AREA_LOW, AREA_HIGH, AREA_ZERO = 0.04, 0.40, 0.80
# A bounding-box row/column counts when its mask mass reaches this fraction of the fullest row/column (and >= 1 px),
# so a faint haze elsewhere does not stretch the box.
BOX_CUT = 0.05
FORM_SIGMA = 0.1

_PROMPT_RE = re.compile(r"^a (\w+) (\w+) on a (\w+) background$")


def all_prompts() -> list[str]:
    """Every prompt of the world, in a fixed order (colour, shape, background).

    Returns:
        list of len(COLORS) * len(SHAPES) * (len(COLORS) - 1) prompts.
    """
    return [
        TEMPLATE.format(color=c, shape=s, background=b)
        for c, s, b in itertools.product(COLORS, SHAPES, COLORS)
        if c != b
    ]


def parse(prompt: str) -> tuple[str, str, str]:
    """Split a world prompt into its parts.

    Args:
        prompt: e.g. "a red circle on a blue background".

    Returns:
        (color, shape, background).

    Raises:
        ValueError: the prompt is not one of `all_prompts()`.
    """
    m = _PROMPT_RE.match(prompt.strip())
    if m is None or not _valid(m[1], m[2], m[3]):
        raise ValueError(
            f"prompt {prompt!r} is not of the tiny world; expected {TEMPLATE!r} with colours {list(COLORS)}, "
            f"shapes {list(SHAPES)} and colour != background"
        )
    return m[1], m[2], m[3]


def _valid(color: str, shape: str, background: str) -> bool:
    return color in COLORS and shape in SHAPES and background in COLORS and color != background


SCENE_FIELDS = ("color", "shape", "background")


def record(prompt: str) -> dict[str, str]:
    """A prompt as a dataset row: {"prompt", "color", "shape", "background"}, the fields `scene` reads back.

    The parts come from `parse`, so a row's metadata always says what its prompt says."""
    return {"prompt": prompt, **dict(zip(SCENE_FIELDS, parse(prompt)))}


def scene(metadata: dict) -> tuple[str, str, str]:
    """(color, shape, background) from a sample's metadata fields (a `record` without its prompt).

    Raises:
        ValueError: a field is missing, or the three are not a scene of the world (as `parse` checks a prompt).
    """
    missing = [f for f in SCENE_FIELDS if f not in metadata]
    if missing:
        raise ValueError(f"has no {', '.join(repr(f) for f in missing)} (tiny world rows carry {list(SCENE_FIELDS)}, "
                         f"e.g. assets/prompts/tiny_train.jsonl)")
    parts = tuple(metadata[f] for f in SCENE_FIELDS)
    if not all(isinstance(p, str) for p in parts) or not _valid(*parts):
        raise ValueError(f"has the scene {dict(zip(SCENE_FIELDS, parts))}, not one of the tiny world; use colours "
                         f"{list(COLORS)}, shapes {list(SHAPES)} and colour != background")
    return parts


def split_prompts(every: int = 5) -> tuple[list[str], list[str]]:
    """Deterministic train / held-out split of `all_prompts()`.

    A (colour, shape, background) triple is held out when (i_color + i_shape + i_background) % every == 0. The held-out
    triples are new combinations of colours and shapes that all appear in training.

    Args:
        every: about 1/every of the prompts are held out.

    Returns:
        (train, heldout) prompt lists.
    """
    names = list(COLORS)
    train, heldout = [], []
    for p in all_prompts():
        c, s, b = parse(p)
        key = names.index(c) + SHAPES.index(s) + names.index(b)
        (heldout if key % every == 0 else train).append(p)
    return train, heldout


def prompt_files() -> dict[str, str]:
    """The text of assets/prompts/tiny_{train,heldout}.{txt,jsonl} (python -m maintainer.tiny_worlds.prompts writes
    them): the split's prompts, one a line, and the same prompts as JSON Lines rows of `record` (prompt + scene
    metadata)."""
    files = {}
    for name, prompts in zip(("tiny_train", "tiny_heldout"), split_prompts()):
        files[f"{name}.txt"] = "".join(f"{p}\n" for p in prompts)
        files[f"{name}.jsonl"] = "".join(json.dumps(record(p)) + "\n" for p in prompts)
    return files


EDIT_KINDS = ("color", "background", "shape")  # what an edit changes: the shape's colour, the background, the shape
EDIT_DIR = "tiny_edit"  # the source images, next to the edit files


def _edited(source: tuple[str, str, str], kind: str) -> tuple[str, str, str]:
    """The scene `source` with its `kind` changed to the next value of the world that keeps it valid."""
    c, s, b = source
    names = list(COLORS)
    if kind == "shape":
        return c, SHAPES[(SHAPES.index(s) + 1) % len(SHAPES)], b
    at, other = (names.index(c), b) if kind == "color" else (names.index(b), c)
    new = next(n for n in (names[(at + k) % len(names)] for k in range(1, len(names))) if n != other)
    return (new, s, b) if kind == "color" else (c, s, new)


def all_edits() -> list[tuple[str, str, str]]:
    """Every edit of the world, in a fixed order: (source prompt, kind, target prompt) for each source scene and
    each of EDIT_KINDS."""
    return [(source, kind, TEMPLATE.format(**dict(zip(SCENE_FIELDS, _edited(parse(source), kind)))))
            for source in all_prompts() for kind in EDIT_KINDS]


def edit_rows() -> tuple[list[dict], list[dict]]:
    """(train, held-out) edits of the world for image-conditioned models (FLUX.1-Kontext): each row's source scene is
    edited in one part (EDIT_KINDS, in turn), and its prompt is the edited scene's world prompt, the instruction in
    the only words the tiny text encoders know. A row carries the target scene (color, shape, background: what
    tiny_world_meta scores), the edit's kind, the source prompt and its image's file name under EDIT_DIR. An edit is
    held out when its target prompt is (split_prompts), so held-out targets are scenes training never asks for: one
    edit of every scene, 73 to train on and 17 held out."""
    train_targets, heldout_targets = map(set, split_prompts())
    rows: tuple[list[dict], list[dict]] = ([], [])
    for i, source in enumerate(all_prompts()):
        kind = EDIT_KINDS[i % len(EDIT_KINDS)]
        target = TEMPLATE.format(**dict(zip(SCENE_FIELDS, _edited(parse(source), kind))))
        split = 0 if target in train_targets else 1
        assert target in train_targets or target in heldout_targets
        rows[split].append({**record(target), "image": f"{EDIT_DIR}/{i:03d}.png", "edit": kind, "source": source})
    return rows


def edit_files(size: int = 64, seed: int = 0) -> dict[str, bytes]:
    """The bytes of assets/prompts/tiny_edit_{train,heldout}.jsonl and of the source images they name (PNG, `size`
    px, rendered with the world's jitter from `seed` and the image's number): what python -m
    maintainer.tiny_worlds.prompts writes."""
    files = {}
    for name, rows in zip(("tiny_edit_train", "tiny_edit_heldout"), edit_rows()):
        files[f"{name}.jsonl"] = "".join(json.dumps(r) + "\n" for r in rows).encode()
        for r in rows:
            number = int(r["image"].split("/")[-1].split(".")[0])
            image = render([r["source"]], size, torch.Generator().manual_seed(seed * 1000 + number))[0]
            files[r["image"]] = png_bytes(image)
    return files


def png_bytes(image: torch.Tensor) -> bytes:
    """A [3, H, W] image in [0, 1] as PNG bytes (8 bits, lossless for the world's renders, whose channels are 0 or
    1)."""
    import io

    from PIL import Image

    pixels = (image * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def _parts(parsed: list[tuple[str, str, str]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scenes (color, shape, background) as tensors: shape colours [B, 3], background colours [B, 3], shape indices
    [B]."""
    fg = torch.tensor([COLORS[c] for c, _, _ in parsed], dtype=torch.float32, device=device)
    bg = torch.tensor([COLORS[b] for _, _, b in parsed], dtype=torch.float32, device=device)
    shape = torch.tensor([SHAPES.index(s) for _, s, _ in parsed], dtype=torch.long, device=device)
    return fg, bg, shape


def _shape_masks(
    shape: torch.Tensor, cx: torch.Tensor, cy: torch.Tensor, r: torch.Tensor, size: int
) -> torch.Tensor:
    """Binary masks of axis-aligned shapes on a size x size grid of pixel centres.

    Args:
        shape: [B] indices into SHAPES.
        cx, cy, r: [B] centre and half-extent as fractions of the side.
        size: image side in pixels.

    Returns:
        float32 [B, size, size], 1 inside the shape.
    """
    coords = (torch.arange(size, dtype=torch.float32, device=cx.device) + 0.5) / size
    x = coords.view(1, 1, size) - cx.view(-1, 1, 1)
    y = coords.view(1, size, 1) - cy.view(-1, 1, 1)
    r = r.view(-1, 1, 1)
    circle = x.square() + y.square() <= r.square()
    square = (x.abs() <= r) & (y.abs() <= r)
    # Apex at the top (y = -r), base at the bottom (y = +r): half-width grows linearly from 0 to r.
    triangle = (y.abs() <= r) & (x.abs() <= (y + r) / 2)
    stacked = torch.stack([circle, square, triangle], dim=1)  # [B, 3, H, W]
    return stacked.gather(1, shape.view(-1, 1, 1, 1).expand(-1, 1, size, size)).squeeze(1).float()


def render(
    prompts: list[str], size: int = 64, generator: torch.Generator | None = None, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """Draw one image per prompt, with random centre jitter and shape size.

    Args:
        prompts: B world prompts.
        size: image side in pixels.
        generator: CPU generator for the jitter and size (None: torch's global RNG).
        device: where the images are built.

    Returns:
        float32 [B, 3, size, size] in [0, 1].
    """
    return _draw([parse(p) for p in prompts], *_placements(len(prompts), generator, device), size)


def render_edits(
    sources: list[str], targets: list[str], size: int = 64, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Source and edited images of B edits, each pair with one placement (centre and size): a right edit changes
    what its instruction names and keeps where the shape is and how big, which `edit_terms` grades.

    Returns:
        (sources, targets), float32 [B, 3, size, size] each in [0, 1].
    """
    placement = _placements(len(sources), generator, "cpu")
    return (_draw([parse(p) for p in sources], *placement, size),
            _draw([parse(p) for p in targets], *placement, size))


def _placements(
    n: int, generator: torch.Generator | None, device: str | torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n random (centre x, centre y, half-extent) as fractions of the side, [n] each."""
    u = torch.rand(n, 3, generator=generator).to(torch.device(device))
    cx = 0.5 + (2 * u[:, 0] - 1) * JITTER
    cy = 0.5 + (2 * u[:, 1] - 1) * JITTER
    r = RADIUS_MIN + u[:, 2] * (RADIUS_MAX - RADIUS_MIN)
    return cx, cy, r


def _draw(scenes: list[tuple[str, str, str]], cx: torch.Tensor, cy: torch.Tensor, r: torch.Tensor,
          size: int) -> torch.Tensor:
    fg, bg, shape = _parts(scenes, cx.device)
    n = len(scenes)
    mask = _shape_masks(shape, cx, cy, r, size).unsqueeze(1)  # [B, 1, H, W]
    return bg.view(n, 3, 1, 1) * (1 - mask) + fg.view(n, 3, 1, 1) * mask


def _membership(images: torch.Tensor, colors: torch.Tensor) -> torch.Tensor:
    """Soft per-pixel match of images [B, 3, H, W] to colours [B, 3] -> [B, H, W] in (0, 1]."""
    d2 = (images - colors.view(-1, 3, 1, 1)).square().sum(1)
    return torch.exp(-d2 / (2 * COLOR_TAU**2))


def _box(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The robust bounding box of a soft mask [B, H, W]: first and last row, first and last column ([B] each, pixel
    indices) whose mass reaches BOX_CUT of the fullest one's (and 1 px), so a faint haze does not stretch it."""

    def span(profile: torch.Tensor) -> torch.Tensor:
        cut = torch.clamp(BOX_CUT * profile.amax(-1, keepdim=True), min=1.0)
        return profile >= cut  # [B, L]

    def extent(active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.arange(active.shape[-1], device=active.device)
        return torch.where(active, idx, idx.numel()).amin(-1), torch.where(active, idx, -1).amax(-1)

    return (*extent(span(mask.sum(-1))), *extent(span(mask.sum(-2))))


def _box_stats(mask: torch.Tensor) -> torch.Tensor:
    """Form descriptors of a soft mask [B, H, W] inside its robust bounding box.

    Returns:
        [B, 2]: fill ratio (mask mass / box area) and top share (mass in the upper half of the box / mass in the box),
        both in [0, 1]. Square (1, 1/2), circle (pi/4, 1/2), apex-up triangle (1/2, 1/4), up to the box cut.
    """
    r0, r1, c0, c1 = _box(mask)
    idx_r = torch.arange(mask.shape[-2], device=mask.device)
    idx_c = torch.arange(mask.shape[-1], device=mask.device)
    inside = (
        (idx_r.view(1, -1, 1) >= r0.view(-1, 1, 1))
        & (idx_r.view(1, -1, 1) <= r1.view(-1, 1, 1))
        & (idx_c.view(1, 1, -1) >= c0.view(-1, 1, 1))
        & (idx_c.view(1, 1, -1) <= c1.view(-1, 1, 1))
    )
    box_area = ((r1 - r0 + 1).clamp(min=0) * (c1 - c0 + 1).clamp(min=0)).float()
    boxed = mask * inside
    mass = boxed.sum((-2, -1))
    fill = torch.where(box_area > 0, mass / box_area.clamp(min=1.0), torch.zeros_like(mass)).clamp(0, 1)
    # Rows strictly above the box's middle count fully, the middle row (odd heights) half.
    mid2 = (r0 + r1).view(-1, 1).float()  # twice the middle row index
    row_w = torch.where(2 * idx_r.view(1, -1) < mid2, 1.0, torch.where(2 * idx_r.view(1, -1) == mid2, 0.5, 0.0))
    top = (boxed.sum(-1) * row_w).sum(-1)
    top_share = torch.where(mass > 0, top / mass.clamp(min=1e-6), torch.full_like(mass, 0.5)).clamp(0, 1)
    return torch.stack([fill, top_share], dim=-1)


@functools.lru_cache(maxsize=None)
def expected_form() -> tuple[tuple[float, float], ...]:
    """(fill ratio, top share) that `score` measures on clean, centred, mid-size renders of each shape (index = SHAPES).

    Measured through the same `_box_stats` so the bounding-box cut and pixel discretisation cancel out.
    """
    size = 64
    shape = torch.arange(len(SHAPES))
    half = torch.full((len(SHAPES),), 0.5)
    r = torch.full((len(SHAPES),), (RADIUS_MIN + RADIUS_MAX) / 2)
    return tuple(tuple(row) for row in _box_stats(_shape_masks(shape, half, half, r, size)).tolist())


def score_terms(images: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
    """The three reward terms of `score`, each float32 [B] in [0, 1].

    Args:
        images: [B, 3, H, W] in [0, 1] (values outside are clamped), any device and float dtype.
        prompts: B world prompts.

    Returns:
        {"background": ..., "presence": ..., "form": ...}.
    """
    return scene_terms(images, [parse(p) for p in prompts])


def scene_terms(images: torch.Tensor, scenes: list[tuple[str, str, str]]) -> dict[str, torch.Tensor]:
    """`score_terms` for scenes (color, shape, background) given as such rather than as prompts to parse."""
    if images.ndim != 4 or images.shape[1] != 3 or images.shape[0] != len(scenes):
        raise ValueError(
            f"images of shape {tuple(images.shape)} do not match {len(scenes)} prompts; expected [B, 3, H, W]"
        )
    with torch.no_grad():
        x = images.detach().float().clamp(0, 1)
        fg, bg, shape = _parts(scenes, x.device)
        h, w = x.shape[-2:]
        ring = max(1, round(min(h, w) / 16))
        border = torch.ones(h, w, dtype=torch.bool, device=x.device)
        border[ring:-ring, ring:-ring] = False
        background = _membership(x, bg)[:, border].mean(-1)

        m = _membership(x, fg)
        area = m.mean((-2, -1))
        presence = torch.clamp(area / AREA_LOW, max=1.0) * torch.clamp(
            (AREA_ZERO - area) / (AREA_ZERO - AREA_HIGH), min=0.0, max=1.0
        )
        target = torch.tensor(expected_form(), device=x.device)[shape]  # [B, 2]
        dist2 = ((_box_stats(m) - target) / FORM_SIGMA).square().sum(-1)
        form = torch.exp(-0.5 * dist2) * presence
        return {"background": background, "presence": presence, "form": form}


def score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """Programmatic reward: how well each image shows its prompt.

    Args:
        images: [B, 3, H, W] in [0, 1], any device.
        prompts: B world prompts.

    Returns:
        float32 [B] in [0, 1] on the images' device: the mean of the background, presence and form terms.
        Rendered ground truth scores ~1, a blank background ~1/3, a wrong colour ~1/3, a wrong shape ~0.7.
    """
    return score_scenes(images, [parse(p) for p in prompts])


def score_scenes(images: torch.Tensor, scenes: list[tuple[str, str, str]]) -> torch.Tensor:
    """`score` for scenes (color, shape, background), e.g. read by `scene` from each sample's metadata."""
    terms = scene_terms(images, scenes)
    return ((terms["background"] + terms["presence"] + terms["form"]) / 3).float()


def placement(images: torch.Tensor, colors: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the shape of each image is: (centre x, centre y, half-extent) as fractions of the side, [B] each, read
    from the robust bounding box of the pixels of its colour (every shape of the world fills a 2r x 2r box)."""
    x = images.detach().float().clamp(0, 1)
    fg = torch.tensor([COLORS[c] for c in colors], dtype=torch.float32, device=x.device)
    r0, r1, c0, c1 = (v.float() for v in _box(_membership(x, fg)))
    h, w = x.shape[-2:]
    half = ((r1 - r0 + 1) / h + (c1 - c0 + 1) / w) / 4
    return (c0 + c1 + 1) / (2 * w), (r0 + r1 + 1) / (2 * h), half.clamp(min=0)


def edit_terms(images: torch.Tensor, targets: list[tuple[str, str, str]], sources: torch.Tensor,
               source_scenes: list[tuple[str, str, str]]) -> dict[str, torch.Tensor]:
    """The terms of `edit_score`, each float32 [B] in [0, 1]: `scene_terms` of the edited scene (is the instruction
    followed: background, presence, form) and `placement`: the soft IoU of the image's shape-colour pixels with the
    target shape drawn where the source's shape is, at its size (is the rest of the image kept).

    Args:
        images: [B, 3, H, W] edits in [0, 1].
        targets: B scenes the edits should show (what the rows' metadata name).
        sources: [B, 3, h, w] the source images in [0, 1] (resized to H x W when they differ).
        source_scenes: B scenes the sources show (the rows' "source" prompts, parsed).
    """
    terms = scene_terms(images, targets)
    x = images.detach().float().clamp(0, 1)
    src = sources.detach().float().to(x.device)
    if src.shape[-2:] != x.shape[-2:]:
        src = torch.nn.functional.interpolate(src, size=x.shape[-2:], mode="nearest")
    fg, _, shape = _parts(targets, x.device)
    ideal = _shape_masks(shape, *placement(src, [c for c, _, _ in source_scenes]), x.shape[-1])
    got = _membership(x, fg)
    union = torch.maximum(got, ideal).sum((-2, -1))
    terms["placement"] = torch.where(union > 0, torch.minimum(got, ideal).sum((-2, -1)) / union.clamp(min=1e-6),
                                     torch.zeros_like(union))
    return terms


def edit_score(images: torch.Tensor, targets: list[tuple[str, str, str]], sources: torch.Tensor,
               source_scenes: list[tuple[str, str, str]]) -> torch.Tensor:
    """Programmatic editing reward: the mean of `edit_terms`' four terms, float32 [B] in [0, 1]. The right edit
    (the target rendered at the source's placement) scores ~1; the source returned unchanged ~0.25 for a colour
    edit, ~0.6 for a shape edit and ~0.75 for a background edit (its shape is already right and in place)."""
    terms = edit_terms(images, targets, sources, source_scenes)
    return (sum(terms.values()) / len(terms)).float()
