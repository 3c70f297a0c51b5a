"""The ``maxdiff`` command line's arguments: one parser with ``generate``, ``info`` and
``convert``, and the argument types that check values as the request rules do."""

from __future__ import annotations

import argparse

from maxdiff.quantization import MODES as QUANTIZATION_MODES
from pipelines.cli.lines import MAX_IMAGES_PER_LINE
from pipelines.control_limits import CONTROL_SCALE_MAX
from pipelines.image_files import FORMATS
from pipelines.limits import (
    STRENGTH,
    cfg_cutoff_problem,
    deepcache_problem,
    denoising_fraction_problem,
    guidance_problem,
    hires_scale_problem,
    hires_steps_problem,
    hires_strength_problem,
    ip_adapter_scale_problem,
    n_problem,
    seed_problem,
    steps_problem,
)
from pipelines.requests import HiresFix, parse_size

PROG = "maxdiff"


GENERATE_EXAMPLES = """\
examples:
  maxdiff generate "a red fox in the snow" "a lighthouse at dusk" --model /models/sdxl-base \\
      --steps 30 --seed 7 --out out/foxes
  maxdiff generate --prompts prompts.txt --num-images 4 --batch-size 8 --size 1024x768
  maxdiff generate --prompts jobs.jsonl --config sdxl-lightning-4step \\
      --set model=/models/sdxl-base --set unet=/models/sdxl_lightning_4step_unet.safetensors
  maxdiff generate "a watercolor fox" --image fox.png --strength 0.6
  maxdiff generate "a red hat" --image fox.png --mask hat-mask.png   # inpaint the white part
  maxdiff generate "a castle on a hill" --size 1024x1024 --hires-scale 2   # 512 first, upscaled
  maxdiff generate "a golden statue" --controlnet canny=/models/controlnet-canny-sdxl-1.0 \\
      --control-image edges.png:canny:0.5 --control-guidance-end 0.8
  maxdiff generate "a lighthouse at dusk" --model /models/sdxl-base \\
      --refiner /models/sdxl-refiner --high-noise-frac 0.8   # base 80 %, refiner the rest
  maxdiff generate "a cat, best quality" --ip-adapter /models/IP-Adapter/sdxl_models/\
ip-adapter_sdxl.safetensors --ip-adapter-image style.png --ip-adapter-scale 0.6

prompt files: one prompt per line, or (.jsonl) one JSON object per line with "prompt" and any
of "negative_prompt", "seed", "steps", "guidance", "size" ("WxH"), "n" (images of that line),
"image", "mask", "strength" (an edit), "control_images" (ControlNet: a list of {"image",
"controlnet" (a --controlnet name or folder), "scale", "start", "end", "guess_mode"}),
"ip_adapter_image", "ip_adapter_scale" (an image prompt, with --ip-adapter),
"prompt_syntax", "scheduler", "cfg_cutoff", "deepcache_interval", "hires_scale",
"hires_strength", "hires_steps"; paths relative to the JSONL file's folder:
  {"prompt": "a red fox", "seed": 7, "n": 2}
  {"prompt": "a lighthouse", "negative_prompt": "blurry", "size": "1024x768", "steps": 20}
  {"prompt": "a red hat", "image": "fox.png", "mask": "hat-mask.png", "strength": 0.9}
  {"prompt": "a statue", "control_images": [{"image": "edges.png", "controlnet": "canny"}]}
Blank lines and lines starting with # are skipped. Every line is checked before anything is
generated; a bad line stops the run with exit status 2 and its file:line and field.

output: OUT/00000-00-a-red-fox-<id>.png (line, image of the line, prompt, settings hash) and
OUT/metadata.jsonl (prompt, seed, settings, file, time); PNGs also carry the settings as text
chunks. Rerunning the same command skips every image already written. Without --seed a run
seed is drawn (and reused from OUT/metadata.jsonl when resuming); per-image seeds are a hash
of (run seed, line, image), so adding lines never changes existing images. A line's "seed"
gives its images seed, seed+1, ... like the Python API.
"""


# ---------------------------------------------------------------------------------- arguments
def _int_at_least(lo: int, hi: int | None = None):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or v < lo or (hi is not None and v > hi):
            rng = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be an integer {rng}, got {text!r}")
        return v
    return parse


def _rule(check, convert=int):
    """An argument type from a :mod:`pipelines.limits` rule: argparse reports its message."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = text
        problem = check(value)
        if problem is not None:
            raise argparse.ArgumentTypeError(f"{problem.message}, got {text!r}")
        return value
    return parse


def _size(text: str) -> tuple[int, int]:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=fmt,
        description="Text-to-image with SDXL-family models in JAX.",
        epilog="run `maxdiff COMMAND --help` for a command's options and examples")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    model = argparse.ArgumentParser(add_help=False)
    g = model.add_argument_group("model and run config")
    g.add_argument("--config", metavar="NAME|FILE",
                   help="run config: a YAML file or a name in configs/ (sdxl-base, "
                        "sdxl-lightning-4step, ...); flags below override it")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key (repeatable), e.g. --set attention=chunked")
    g.add_argument("--revision", metavar="REV",
                   help="a Hugging Face model name's branch, tag or commit (default main)")
    g.add_argument("--variant", metavar="NAME",
                   help="read *.NAME.safetensors weights where a component has them (fp16)")
    g.add_argument("--model", metavar="DIR|FILE|NAME",
                   help="diffusers SDXL folder, a single-file SDXL checkpoint (.safetensors as "
                        "A1111/ComfyUI use), or a Hugging Face model name (org/name, e.g. "
                        "stabilityai/stable-diffusion-xl-base-1.0: read from the Hugging Face "
                        "cache, $HF_HUB_CACHE or $HF_HOME/hub; downloaded when not cached unless "
                        "HF_HUB_OFFLINE=1) (default: the embedded model, or "
                        "$MAXDIFF_DEFAULT_MODEL)")
    g.add_argument("--single-file-config", metavar="DIR",
                   help="diffusers folder whose config.json files describe a single-file "
                        "--model (default: the SDXL base configs maxdiff ships)")
    g.add_argument("--unet", metavar="FILE", help="single-file UNet replacing the model's "
                   "(SDXL-Lightning)")
    g.add_argument("--vae", metavar="FILE|DIR", help="VAE replacing the model's: a file "
                   "(sdxl_vae.safetensors) or a diffusers VAE folder; an AutoencoderTiny "
                   "folder (taesdxl) decodes fast at lower quality")
    g.add_argument("--scheduler", metavar="NAME",
                   help="sampler: euler, euler_karras, euler_a, dpmpp_2m, dpmpp_2m_karras, "
                        "dpmpp_2m_sde, dpmpp_2m_sde_karras, ddim, pndm, lcm, unipc, "
                        "unipc_karras, A1111's names ('DPM++ 2M "
                        "Karras', 'Euler a', ...) or a diffusers class name, applied to the "
                        "model's own scheduler config; a preset (lightning-1step/2step/4step/"
                        "8step: scheduler, steps and guidance); or a scheduler config "
                        "file/folder")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"])
    g.add_argument("--quantization", choices=QUANTIZATION_MODES,
                   help="the UNet's transformer linear layers in int8 (weights only, or weights "
                        "and activations) or fp8, through qwix (default none; no --lora with it)")
    g.add_argument("--lora", action="append", metavar="PATH[:SCALE]",
                   help="LoRA adapter fused into the weights (diffusers/PEFT or kohya "
                        ".safetensors; scale default 1); repeatable, applied in order")
    g.add_argument("--embedding", action="append", metavar="PATH[:TOKEN]",
                   help="textual-inversion embedding (.safetensors: diffusers, A1111 / Civitai "
                        "or SDXL clip_l + clip_g); its token (default: the file's name) works in "
                        "every prompt; repeatable")
    g.add_argument("--ip-adapter", metavar="FILE",
                   help="IP-Adapter (.safetensors, h94/IP-Adapter's files) for image prompts "
                        "(--ip-adapter-image, a JSONL line's ip_adapter_image); its image "
                        "encoder is read from image_encoder/ beside the file (h94's layout) "
                        "unless --ip-adapter-encoder names it")
    g.add_argument("--ip-adapter-encoder", metavar="DIR",
                   help="the IP-Adapter's CLIP vision encoder folder (transformers layout)")
    g.add_argument("--refiner", metavar="PATH",
                   help="SDXL refiner (a folder or its single file) that finishes every text-to-image image "
                        "(diffusers' base + refiner, one program; edits run the base alone)")
    g.add_argument("--high-noise-frac", type=_rule(denoising_fraction_problem, float),
                   metavar="F", help="where the refiner takes over, a fraction of the noise "
                                     "schedule in (0, 1) (default 0.8: the base runs 80 %%)")
    g.add_argument("--devices", type=_int_at_least(1), metavar="N",
                   help="use the first N local devices (default: all)")

    gen = sub.add_parser("generate", parents=[model], formatter_class=fmt,
                         help="generate images from prompts (resumable)",
                         description="Generate images from prompts given as arguments or in a "
                                     "file; rerun the same command to resume.",
                         epilog=GENERATE_EXAMPLES)
    gen.add_argument("prompt", nargs="*", help="prompts (each makes --num-images images)")
    gen.add_argument("--prompts", metavar="FILE",
                     help="text file (one prompt a line) or .jsonl with per-line settings; "
                          "- for stdin")
    gen.add_argument("--steps", type=_rule(steps_problem), metavar="N", help="denoising steps")
    gen.add_argument("--guidance", type=_rule(guidance_problem, float), metavar="G",
                     help="classifier-free guidance scale (<= 1: off, one UNet pass per step)")
    gen.add_argument("--negative", metavar="TEXT", help="negative prompt for every line")
    gen.add_argument("--prompt-syntax", choices=("a1111", "compel", "none"), default=None,
                     help="how prompts write their weights: a1111 (default: (word:1.3), (word), "
                          "[word], BREAK), compel (word+, word-, (words)1.3) or none (the text "
                          "as written); a JSONL line's prompt_syntax overrides it. Prompts over "
                          "75 tokens are encoded in chunks of 75 (up to 4)")
    gen.add_argument("--cfg-cutoff", type=_rule(cfg_cutoff_problem, float), metavar="F",
                     help="faster, approximate: classifier-free guidance on the first "
                          "floor(F * steps) steps only (F in (0, 1]), the conditional pass "
                          "alone after them (one UNet pass instead of two); a JSONL line's "
                          "cfg_cutoff overrides it (default: guidance on every step)")
    gen.add_argument("--deepcache-interval", type=_rule(deepcache_problem), metavar="N",
                     help="faster, approximate (DeepCache): the UNet runs in full every N "
                          "steps and only its outer blocks in between, on the deep features the "
                          "last full step cached (N in 1..100; default 1: off); a JSONL line's "
                          "deepcache_interval overrides it")
    gen.add_argument("--hires-scale", type=_rule(hires_scale_problem, float), metavar="S",
                     help="hires fix (A1111's): draw each image at its size / S first (S in "
                          "(1, 4]), upscale its latents to the size and denoise again from them, "
                          "in one program; a JSONL line's hires_scale overrides it (default: "
                          "off). Text-to-image lines only")
    gen.add_argument("--hires-strength", type=_rule(hires_strength_problem, float), metavar="F",
                     help=f"the hires fix's second pass: int(steps * F) of its steps run, F in "
                          f"(0, 1] (default {HiresFix.strength:g})")
    gen.add_argument("--hires-steps", type=_rule(hires_steps_problem), metavar="N",
                     help="the hires fix's second pass's steps (default: --steps)")
    gen.add_argument("--size", type=_size, metavar="WxH", help="image size, e.g. 1024x768")
    gen.add_argument("--seed", type=_rule(lambda v: seed_problem(v, optional=False)), metavar="S",
                     help="run seed: makes the whole run reproducible")
    gen.add_argument("--num-images", type=_rule(lambda v: n_problem(v, MAX_IMAGES_PER_LINE)),
                     default=1, metavar="N",
                     help="images per prompt (default 1)")
    gen.add_argument("--batch-size", type=_int_at_least(1), default=4, metavar="B",
                     help="images per device batch (default 4; padded up to a power of two "
                          "times the device count)")
    gen.add_argument("--image", metavar="FILE",
                     help="edit this image (PNG/JPEG/WebP) instead of starting from noise: "
                          "image-to-image, or inpainting with --mask; the size defaults to "
                          "the image's")
    gen.add_argument("--mask", metavar="FILE",
                     help="inpainting mask of the image's size: white = repaint, black = keep "
                          "(a mask with transparent pixels: transparent = repaint)")
    gen.add_argument("--strength", type=float, metavar="S",
                     help="edit strength in (0, 1]: int(steps * S) denoising steps run "
                          f"(default {STRENGTH['img2img']}, {STRENGTH['inpaint']} with --mask)")
    gen.add_argument("--ip-adapter-image", metavar="FILE",
                     help="image prompt for every line without its own (needs --ip-adapter)")
    gen.add_argument("--ip-adapter-scale", type=_rule(ip_adapter_scale_problem, float),
                     metavar="S", help="how strongly image prompts act, in [-1, 5] (default 1; "
                                       "0: not at all); a JSONL line's ip_adapter_scale "
                                       "overrides it")
    gen.add_argument("--control-image", action="append", default=[],
                     metavar="PATH[:MODEL[:SCALE]]",
                     help="ControlNet text-to-image: a control image (edges, depth, pose, ...) "
                          "read by the ControlNet MODEL (a --controlnet name, a diffusers "
                          "ControlNet folder or a .safetensors file; may be left out with one "
                          "--controlnet) at "
                          f"conditioning scale SCALE in [0, {CONTROL_SCALE_MAX:g}] (default 1); "
                          "repeatable: several ControlNets, residuals summed. The size "
                          "defaults to the first control image's")
    gen.add_argument("--controlnet", action="append", default=[], metavar="NAME=PATH",
                     help="name a ControlNet (a diffusers folder, or a .safetensors file: "
                          "without its config.json it takes the model UNet's) for "
                          "--control-image and JSONL lines' control_images (repeatable)")
    gen.add_argument("--control-guidance-start", type=float, metavar="A",
                     help="the ControlNets act from this fraction of the steps (default 0)")
    gen.add_argument("--control-guidance-end", type=float, metavar="B",
                     help="... to this one (default 1; 0 <= A < B <= 1)")
    gen.add_argument("--control-guess-mode", action="store_true",
                     help="diffusers' guess mode for the control images (A1111's \"ControlNet "
                          "is more important\"; a JSONL entry's guess_mode overrides it)")
    gen.add_argument("--out", default="out", metavar="DIR", help="output folder (default out/)")
    gen.add_argument("--format", choices=sorted(FORMATS), default="png")
    gen.add_argument("--quiet", action="store_true", help="no progress bar, plain log lines only")

    info = sub.add_parser("info", parents=[model], formatter_class=fmt,
                          help="show a model's components, parameter counts, dtypes, devices",
                          epilog="example:\n  maxdiff info --model /models/sdxl-base")
    info.add_argument("--json", action="store_true", help="print one JSON object")

    conv = sub.add_parser(
        "convert", formatter_class=fmt,
        help="rewrite a checkpoint: another dtype, or single file <-> diffusers folder",
        description="Rewrite a checkpoint, tensor by tensor, into a temporary path renamed to "
                    "DST at the end:\n"
                    "  folder -> folder: every component's weights as one safetensors file "
                    "cast to --dtype (default bfloat16; diffusers keys and layouts kept)\n"
                    "  folder -> FILE.safetensors: one file in the original Stability layout "
                    "(what A1111, ComfyUI and diffusers' from_single_file read)\n"
                    "  FILE.safetensors -> folder: a diffusers folder (configs from "
                    "--single-file-config or the shipped SDXL base ones)\n"
                    "  folder -> folder with --quantize: the UNet's weights quantized as "
                    "from_pretrained(quantization=) does, stored quantized (maxdiff loads the "
                    "folder with that quantization; diffusers cannot read its UNet)",
        epilog="examples:\n"
               "  maxdiff convert /models/sdxl-base /models/sdxl-base-bf16 --dtype bf16\n"
               "  maxdiff convert /models/sdxl-base /models/sdxl-base-int8 --quantize int8\n"
               "  maxdiff convert /models/sdxl-base /models/sdxl-base.safetensors --dtype fp16\n"
               "  maxdiff convert /models/juggernaut-xl.safetensors /models/juggernaut-xl")
    conv.add_argument("src", metavar="SRC",
                      help="diffusers SDXL folder, single file, or Hugging Face model name "
                           "(org/name)")
    conv.add_argument("dst", metavar="DST",
                      help="new folder, or a .safetensors file (must not exist unless --force)")
    conv.add_argument("--dtype", default=None,
                      choices=["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"],
                      help="weight dtype (default: bfloat16 folder to folder, else as stored)")
    conv.add_argument("--single-file-config", metavar="DIR",
                      help="diffusers folder whose configs describe a single-file SRC")
    conv.add_argument("--vae", metavar="FILE",
                      help="VAE file for a single-file SRC that holds none")
    conv.add_argument("--quantize", choices=[m for m in QUANTIZATION_MODES if m != "none"],
                      help="folder to folder: store the UNet's transformer linear layers "
                           "quantized (int8 / float8 values and float32 scales, computed from "
                           "its float32 weights); its other weights in --dtype")
    conv.add_argument("--force", action="store_true", help="replace DST if it exists")
    return parser
