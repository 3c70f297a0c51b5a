"""A procedural dataset of captioned 64x64 shape images, generated on the fly with NumPy.

Every sample is one filled shape (circle, square or triangle) of one named colour on a plain
background of another named colour, at one of three sizes and five positions, with a caption
drawn from varied templates ("a red circle on a blue background", "small green triangle, top
left, white background"). ``sample(rng)`` is deterministic given the generator's state;
``batch(seed, n)`` is deterministic given ``seed``.

Images are uint8 (H, W, 3) RGB; ``to_model(images)`` maps them to float32 [-1, 1] NHWC.

Held-out combinations: the 216 (shape, colour, background) combinations are split once, per
shape, into ``train`` (156), ``val`` (24) and ``test`` (36) (:data:`SPLITS`). Training draws only
``train`` combinations (the default of every sampler here), so an evaluation on ``test`` shows
the model composing a shape, a colour and a background it never saw together; every shape,
colour and background, and every pair of them, is still seen in training.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SIZE = 64

# Well separated colours (RGB). Names are what captions say.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 20, 20),
    "green": (20, 170, 40),
    "blue": (30, 60, 230),
    "yellow": (250, 230, 30),
    "purple": (140, 40, 190),
    "orange": (250, 130, 10),
    "cyan": (30, 220, 230),
    "white": (250, 250, 250),
    "black": (15, 15, 15),
}
COLOR_NAMES = tuple(COLORS)
SHAPES = ("circle", "square", "triangle")
# half extent of the shape in pixels
SIZES = {"small": 9, "medium": 14, "large": 20}
POSITIONS = ("center", "top left", "top right", "bottom left", "bottom right")

TEMPLATES_FULL = (  # templates that say everything
    "a {size} {color} {shape} in the {pos} of a {bg} background",
    "{size} {color} {shape}, {pos}, {bg} background",
    "a {size} {color} {shape} at the {pos}, on {bg}",
)
TEMPLATES_SHORT = (  # templates that leave size and position to chance
    "a {color} {shape} on a {bg} background",
    "{color} {shape} on {bg}",
    "a {bg} background with a {color} {shape}",
    "a picture of a {color} {shape} on a {bg} background",
    "{color} {shape}, {bg} background",
)
TEMPLATES_SIZE = (
    "a {size} {color} {shape} on a {bg} background",
    "{size} {color} {shape} on {bg}",
)
TEMPLATES_POS = (
    "a {color} {shape} in the {pos} of a {bg} background",
    "{color} {shape}, {pos}, {bg} background",
)
# Caption set v2 (``captions: v2`` in the training config) adds these phrasings, which name the
# background first or mark the roles with other words. The v1 captions name the background
# first in one template only, and a model trained on them paints the shape in whichever colour
# comes first (maxdiff/assets/demo-model/README.md). None of them is one of the evaluation's
# held-out phrasings (pipelines/demo_eval.py UNSEEN_TEMPLATES and UNSEEN_TEMPLATES_2).
TEMPLATES_BG_FIRST = (
    "on {bg}, a {color} {shape}",
    "{bg} background, {color} {shape}",
    "a {bg} background and a {color} {shape} on it",
    "a {bg} scene with a {color} {shape} in it",
    "a plain {bg} background with a {size} {color} {shape}",
    "{bg} background with a {size} {color} {shape} at the {pos}",
    "a {color} {shape} in front of a plain {bg} background",
    "a {bg} background; a {color} {shape} in the {pos}",
)
CAPTION_SETS = ("v1", "v2")


SPLIT_SEED = 2026_12_03
N_VAL, N_TEST = 8, 12  # combinations per shape (of 72)


def _split_combinations() -> dict[str, frozenset]:
    """Each (colour, background) pair is held out for at most one shape, so the other shapes
    still show it in training; drawn once from ``SPLIT_SEED``."""
    rng = np.random.default_rng(SPLIT_SEED)
    pairs = [(c, b) for c in COLOR_NAMES for b in COLOR_NAMES if c != b]
    held = N_VAL + N_TEST
    order = rng.permutation(len(pairs))
    out = {"train": [], "val": [], "test": []}
    for j, shape in enumerate(SHAPES):
        mine = [pairs[i] for i in order[j * held:(j + 1) * held]]
        out["test"] += [(shape, *p) for p in mine[:N_TEST]]
        out["val"] += [(shape, *p) for p in mine[N_TEST:]]
        out["train"] += [(shape, *p) for p in pairs if p not in mine]
    return {k: frozenset(v) for k, v in out.items()}


SPLITS: dict[str, frozenset] = _split_combinations()  # name -> {(shape, colour, background)}


@dataclass(frozen=True)
class Scene:
    """What one image shows; ``cx, cy`` is the shape's centre in pixels, ``r`` its half extent."""

    shape: str
    color: str
    bg: str
    size: str
    pos: str
    cx: float
    cy: float
    r: float


def position_center(pos: str, r: float) -> tuple[float, float]:
    """Pixel centre (x, y) of a shape of half extent ``r`` at a named position."""
    lo, hi, mid = r + 4, SIZE - 1 - r - 4, (SIZE - 1) / 2
    if pos == "center":
        return mid, mid
    v, h = pos.split()
    return (lo if h == "left" else hi), (lo if v == "top" else hi)


def random_scene(rng: np.random.Generator, split: str | None = "train") -> Scene:
    """A random scene whose (shape, colour, background) is in ``split`` (None: any)."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {tuple(SPLITS)} or None")
    while True:
        shape = SHAPES[rng.integers(len(SHAPES))]
        color = COLOR_NAMES[rng.integers(len(COLOR_NAMES))]
        bg = color
        while bg == color:
            bg = COLOR_NAMES[rng.integers(len(COLOR_NAMES))]
        if split is None or (shape, color, bg) in SPLITS[split]:
            break
    size = tuple(SIZES)[rng.integers(len(SIZES))]
    pos = POSITIONS[rng.integers(len(POSITIONS))]
    r = SIZES[size] + rng.uniform(-1.5, 1.5)
    cx, cy = position_center(pos, r)
    cx += rng.uniform(-2, 2)
    cy += rng.uniform(-2, 2)
    return Scene(shape, color, bg, size, pos, float(cx), float(cy), float(r))


def shape_mask(shape: str, cx: float, cy: float, r: float, size: int = SIZE) -> np.ndarray:
    """Boolean (size, size) mask of a shape; anti-aliased edges are not modelled (hard edges)."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    cx, cy = cx + 0.5, cy + 0.5
    if shape == "circle":
        return (x - cx) ** 2 + (y - cy) ** 2 <= r * r
    if shape == "square":
        return (np.abs(x - cx) <= r) & (np.abs(y - cy) <= r)
    if shape == "triangle":  # upright isosceles, base = height = 2r
        top, bottom = cy - r, cy + r
        half = (y - top) / (2 * r) * r
        return (y >= top) & (y <= bottom) & (np.abs(x - cx) <= half)
    raise ValueError(f"unknown shape {shape!r}; use one of {SHAPES}")


def render(scene: Scene) -> np.ndarray:
    """The scene as a uint8 (64, 64, 3) RGB image."""
    img = np.empty((SIZE, SIZE, 3), np.uint8)
    img[:] = COLORS[scene.bg]
    img[shape_mask(scene.shape, scene.cx, scene.cy, scene.r)] = COLORS[scene.color]
    return img


def fill(template: str, scene: Scene, pos: str | None = None) -> str:
    """``template`` with the scene's words (``pos`` instead of its position if given), with
    "an" before "orange"."""
    text = template.format(size=scene.size, color=scene.color, shape=scene.shape, bg=scene.bg,
                           pos=scene.pos if pos is None else pos)
    return text.replace("a orange", "an orange").replace("A orange", "An orange")


def caption(scene: Scene, rng: np.random.Generator, captions: str = "v1") -> str:
    """One caption for the scene, from a randomly chosen template family; ``captions="v2"``
    draws 30 % of them from :data:`TEMPLATES_BG_FIRST` (v1's draws are unchanged by it)."""
    if captions not in CAPTION_SETS:
        raise ValueError(f"captions={captions!r}; use one of {CAPTION_SETS}")
    if captions == "v2" and rng.random() < 0.3:
        return fill(TEMPLATES_BG_FIRST[rng.integers(len(TEMPLATES_BG_FIRST))], scene)
    u = rng.random()
    family = (TEMPLATES_SHORT if u < 0.4 else TEMPLATES_FULL if u < 0.7
              else TEMPLATES_SIZE if u < 0.85 else TEMPLATES_POS)
    t = family[rng.integers(len(family))]
    pos = "middle" if scene.pos == "center" and "{pos}," in t and rng.random() < 0.5 else scene.pos
    return fill(t, scene, pos)


def sample(rng: np.random.Generator, split: str | None = "train", captions: str = "v1"
           ) -> tuple[np.ndarray, str, Scene]:
    """One (image uint8 (64, 64, 3), caption, scene) of a ``split`` combination."""
    scene = random_scene(rng, split)
    return render(scene), caption(scene, rng, captions), scene


def batch(seed: int, n: int, split: str | None = "train") -> tuple[np.ndarray, list[str], list[Scene]]:
    """``n`` samples, deterministic in ``seed``: images (n, 64, 64, 3) uint8, captions, scenes."""
    rng = np.random.default_rng(seed)
    out = [sample(rng, split) for _ in range(n)]
    return np.stack([o[0] for o in out]), [o[1] for o in out], [o[2] for o in out]


def to_model(images: np.ndarray) -> np.ndarray:
    """uint8 (..., 3) -> float32 in [-1, 1]."""
    return images.astype(np.float32) / 127.5 - 1.0
