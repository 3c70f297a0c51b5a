"""Prompt fidelity of a model on the shapes task, scored by a deterministic image analyser.

    python -m pipelines.demo_eval [--model DIR] [--steps N] [--guidance G] [--sampler S]

48 held-out (prompt, seed) pairs (:func:`eval_set`: captions from the training templates for
scenes drawn from a generator seed the training never uses, 16 per shape, and initial-noise
seeds 10,000+) are generated in one batch and each image is analysed (:func:`analyse`):

- background colour: the median of the 2-pixel border, nearest palette colour (RGB distance);
- shape colour: the most frequent nearest-palette label among pixels not labelled background;
- shape: the pixels nearer the shape colour than the background colour, largest connected
  component; its fill ratio of its bounding box is ~1 for a square, ~pi/4 for a circle and
  ~1/2 for a triangle (thresholds 0.87 and 0.62); a triangle must also be upright (its top
  third at most 0.6 times as wide as its bottom third) and fill more than 0.35 of its box, so
  a plus sign, an upside-down triangle or noise is no shape at all.

``--ground-truth`` scores the dataset's own rendered images instead (validates the analyser).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import numpy as np

from maxdiff.training import shapes

EVAL_SEED = 20_261_202  # scenes; training draws from seeds 0..10
NOISE_SEED = 10_000
N_EVAL = 48
THRESHOLDS = {"shape_color": 0.90, "background": 0.90, "shape": 0.75}

PALETTE = np.array(list(shapes.COLORS.values()), np.float32)
NAMES = list(shapes.COLORS)

SAMPLERS = {  # name -> scheduler config overrides (on top of the model's scheduler config)
    "euler": {"_class_name": "EulerDiscreteScheduler"},
    "euler-trailing": {"_class_name": "EulerDiscreteScheduler", "timestep_spacing": "trailing"},
    "dpm++2m": {"_class_name": "DPMSolverMultistepScheduler", "algorithm_type": "dpmsolver++",
                "solver_order": 2},
    "dpm++2m-karras": {"_class_name": "DPMSolverMultistepScheduler",
                       "algorithm_type": "dpmsolver++", "solver_order": 2,
                       "use_karras_sigmas": True},
    "ddim": {"_class_name": "DDIMScheduler"},
}


@dataclass(frozen=True)
class Analysis:
    shape_color: str | None
    background: str
    shape: str | None
    fill: float


def eval_set(n: int = N_EVAL) -> list[tuple[str, int, shapes.Scene]]:
    """``n`` (prompt, noise seed, scene) triples; shapes cycle circle/square/triangle."""
    rng = np.random.default_rng(EVAL_SEED)
    out = []
    for i in range(n):
        scene = shapes.random_scene(rng)
        want = shapes.SHAPES[i % len(shapes.SHAPES)]
        scene = shapes.Scene(want, *[getattr(scene, f) for f in
                                     ("color", "bg", "size", "pos", "cx", "cy", "r")])
        out.append((shapes.caption(scene, rng), NOISE_SEED + i, scene))
    return out


def _nearest(rgb: np.ndarray) -> np.ndarray:
    return np.argmin(((rgb[..., None, :] - PALETTE) ** 2).sum(-1), axis=-1)


def analyse(image: np.ndarray) -> Analysis:
    """Colours and shape of a uint8 (H, W, 3) image (see the module docstring)."""
    from scipy import ndimage

    x = np.asarray(image, np.float32)
    border = np.concatenate([x[:2].reshape(-1, 3), x[-2:].reshape(-1, 3),
                             x[:, :2].reshape(-1, 3), x[:, -2:].reshape(-1, 3)])
    bg = int(_nearest(np.median(border, axis=0)))
    labels = _nearest(x)
    fg = labels[labels != bg]
    if fg.size < 4:
        return Analysis(None, NAMES[bg], None, 0.0)
    col = int(np.bincount(fg, minlength=len(NAMES)).argmax())
    d_fg = ((x - PALETTE[col]) ** 2).sum(-1)
    d_bg = ((x - PALETTE[bg]) ** 2).sum(-1)
    mask = d_fg < d_bg
    comp, n = ndimage.label(mask)
    if n == 0:
        return Analysis(NAMES[col], NAMES[bg], None, 0.0)
    sizes = ndimage.sum(mask, comp, range(1, n + 1))
    mask = comp == (1 + int(np.argmax(sizes)))
    ys, xs = np.nonzero(mask)
    box = mask[ys.min():ys.max() + 1, xs.min():xs.max() + 1]
    fill = float(box.mean())
    widths = box.sum(axis=1)  # per row, top to bottom
    k = max(1, len(widths) // 3)
    narrowing = widths[:k].mean() / max(widths[-k:].mean(), 1e-9)  # ~0.2 upright triangle
    if fill > 0.87:
        shape = "square"
    elif fill > 0.62:
        shape = "circle"
    elif fill > 0.35 and narrowing < 0.6:
        shape = "triangle"
    else:  # a plus sign, an upside-down triangle, a sliver, noise: no shape of the task
        shape = None
    return Analysis(NAMES[col], NAMES[bg], shape, fill)


def score(images, scenes) -> dict:
    """Fractions correct (shape_color, background, shape, all) over the images."""
    res = [analyse(im) for im in images]
    ok = {
        "shape_color": [r.shape_color == s.color for r, s in zip(res, scenes)],
        "background": [r.background == s.bg for r, s in zip(res, scenes)],
        "shape": [r.shape == s.shape for r, s in zip(res, scenes)],
    }
    ok["all"] = [a and b and c for a, b, c in zip(*ok.values())]
    out = {k: float(np.mean(v)) for k, v in ok.items()}
    out["n"] = len(res)
    out["failures"] = [
        {"i": i, "want": [s.color, s.shape, s.bg], "got": [r.shape_color, r.shape, r.background],
         "fill": round(r.fill, 2)}
        for i, (r, s, a) in enumerate(zip(res, scenes, ok["all"])) if not a]
    return out


def passes(result: dict) -> bool:
    return all(result[k] >= v for k, v in THRESHOLDS.items())


def generate(pipe, prompts, seeds, steps: int, guidance: float) -> np.ndarray:
    """uint8 (N, 64, 64, 3) images, all in one batch."""
    from pipelines.requests import ImageRequest

    items = [ImageRequest(prompt=p, seed=s, guidance_scale=guidance) for p, s in zip(prompts, seeds)]
    out = pipe.generate(items, height=shapes.SIZE, width=shapes.SIZE, num_inference_steps=steps,
                        output_type="np")
    return np.round(out.images * 255).astype(np.uint8)


def load_pipeline(model: str | None = None, sampler: str | None = None):
    """The pipeline for ``model`` (None: the embedded one), optionally with another sampler."""
    from maxdiff import checkpoint
    from pipelines import TextToImagePipeline
    from pipelines.default_model import default_model_path

    path = model or default_model_path()
    sched = None
    if sampler:
        base = checkpoint.read_config(f"{path}/scheduler", "scheduler_config.json")
        sched = {**base, **SAMPLERS[sampler]}
    return TextToImagePipeline.from_pretrained(path, scheduler=sched, compile_cache_dir=None)


def evaluate(pipe, steps: int, guidance: float) -> dict:
    pairs = eval_set()
    t0 = time.perf_counter()
    images = generate(pipe, [p for p, _, _ in pairs], [s for _, s, _ in pairs], steps, guidance)
    res = score(images, [sc for _, _, sc in pairs])
    res.update(steps=steps, guidance=guidance, seconds=round(time.perf_counter() - t0, 1))
    return res


def main(argv=None) -> None:
    from pipelines.config import ModelDefaults
    from pipelines.default_model import default_model_path

    demo = ModelDefaults.read(default_model_path())
    ap = argparse.ArgumentParser(description="Prompt-fidelity evaluation on the shapes task.")
    ap.add_argument("--model", default=None, help="diffusers SDXL folder (default: embedded)")
    ap.add_argument("--steps", type=int, nargs="*", default=[demo.steps or 20])
    ap.add_argument("--guidance", type=float, nargs="*", default=[5.0 if demo.guidance is None else demo.guidance])
    ap.add_argument("--sampler", nargs="*", default=[None],
                    help=f"scheduler(s) to try instead of the model's: {', '.join(SAMPLERS)}")
    ap.add_argument("--ground-truth", action="store_true",
                    help="score the dataset's rendered images (validates the analyser)")
    ap.add_argument("--verbose", action="store_true", help="list the failures")
    a = ap.parse_args(argv)
    if a.ground_truth:
        pairs = eval_set()
        res = score([shapes.render(sc) for _, _, sc in pairs], [sc for _, _, sc in pairs])
        _, _, scenes = shapes.batch(7, 1000)
        big = score([shapes.render(sc) for sc in scenes], scenes)
        big.pop("failures")
        print(json.dumps({"eval_set": {k: v for k, v in res.items() if k != "failures"},
                          "random_1000": big}))
        return
    ok = True
    for sampler in a.sampler:
        pipe = load_pipeline(a.model, sampler)
        for steps in a.steps:
            for g in a.guidance:
                res = evaluate(pipe, steps, g)
                res["sampler"] = sampler or "model default"
                res["pass"] = passes(res)
                ok &= res["pass"]
                if not a.verbose:
                    res["failures"] = len(res["failures"])
                print(json.dumps(res), flush=True)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
