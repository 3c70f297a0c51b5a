"""``make demo``: generate a few images with the embedded demo model and a labelled contact sheet.

    python -m pipelines.demo [--out out/demo] [--config demo] [--seed 0]

Uses ``TextToImagePipeline.from_config("demo")`` (``configs/demo.yaml``: the embedded model in
``maxdiff/assets/demo-model`` with its measured default steps and guidance), writes one PNG
per prompt and ``contact_sheet.png`` (each tile captioned with its prompt and seed) into
``--out``, and prints where they are and how long loading and generation took.
"""

from __future__ import annotations

import argparse
import re
import textwrap
import time
from pathlib import Path

PROMPTS = [
    "a red circle on a blue background",
    "small green triangle, top left, white background",
    "a large yellow square on a black background",
    "a purple circle in the bottom right of a yellow background",
    "an orange triangle on a cyan background",
    "a white square on a red background",
    "a small blue circle at the top right, on orange",
    "a cyan triangle on a purple background",
]

TILE = 192  # pixels per tile on the contact sheet (images are upscaled, nearest neighbour)
LABEL_LINES = 3


def contact_sheet(images, labels, columns: int = 4):
    """A PIL image: tiles in a grid, each with its label (wrapped) underneath."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    line_h = 14
    rows = (len(images) + columns - 1) // columns
    cell_h = TILE + LABEL_LINES * line_h + 8
    sheet = Image.new("RGB", (columns * TILE + (columns + 1) * 8, rows * cell_h + 8), "white")
    draw = ImageDraw.Draw(sheet)
    for k, (im, label) in enumerate(zip(images, labels)):
        r, c = divmod(k, columns)
        x, y = 8 + c * (TILE + 8), 8 + r * cell_h
        sheet.paste(im.resize((TILE, TILE), Image.NEAREST), (x, y))
        for j, line in enumerate(textwrap.wrap(label, 30)[:LABEL_LINES]):
            draw.text((x, y + TILE + 3 + j * line_h), line, fill="black", font=font)
    return sheet


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Generate demo images with the embedded model.")
    ap.add_argument("--out", default="out/demo", help="output folder (default out/demo)")
    ap.add_argument("--config", default="demo", help="run config name or YAML (default: demo)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the first image (then +1 each)")
    a = ap.parse_args(argv)

    from pipelines import TextToImagePipeline

    t0 = time.perf_counter()
    pipe = TextToImagePipeline.from_config(a.config)
    t1 = time.perf_counter()
    result = pipe(PROMPTS, seed=a.seed)
    t2 = time.perf_counter()
    again = pipe(PROMPTS, seed=a.seed)  # compiled now: the steady-state time
    t3 = time.perf_counter()
    assert all(x.tobytes() == y.tobytes() for x, y in zip(result.images, again.images))

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, (im, prompt, seed) in enumerate(zip(result.images, PROMPTS, result.seeds)):
        p = out / f"{k:02d}-{_slug(prompt)}-seed{seed}.png"
        im.save(p)
        paths.append(p)
    labels = [f"{p} (seed {s})" for p, s in zip(PROMPTS, result.seeds)]
    sheet = out / "contact_sheet.png"
    contact_sheet(result.images, labels).save(sheet)
    w, h = result.images[0].size
    print(f"model: {pipe.name}")
    print(f"{len(paths)} images ({w}x{h}, {pipe.default_steps} steps, guidance "
          f"{pipe.default_guidance}) written to {out}/")
    print(f"contact sheet: {sheet}")
    print(f"load {t1 - t0:.1f}s; first generation {t2 - t1:.1f}s (includes compilation); "
          f"again {t3 - t2:.2f}s ({(t3 - t2) / len(paths):.3f}s per image)")
    print("try it in a browser: `make serve` starts the service on this model; then open "
          "http://127.0.0.1:8000/ (the playground)")


if __name__ == "__main__":
    main()
