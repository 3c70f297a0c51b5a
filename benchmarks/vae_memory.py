"""Peak memory of the SDXL VAE decode (and encode), untiled against tiled, from XLA's compiled
memory analysis.

    python -m benchmarks.vae_memory                   # decode, 512² ... 2048², both setups
    python -m benchmarks.vae_memory --parts decode encode --sizes 1024 2048x1024 --json out.json

Nothing runs at full size: the decode is lowered and compiled for abstract inputs (the real
SDXL VAE config, float32 as its ``force_upcast`` asks; parameters as ``jax.ShapeDtypeStruct``
from ``jax.eval_shape``, since a compiled program's buffer sizes do not depend on the values),
and ``compiled.memory_analysis()`` gives its argument, output and temporary bytes.

- **untiled**: one program, ``post_quant_conv`` + decoder on the whole latent image. Its peak
  beyond the parameters is ``temp + output + latents``.
- **tiled**: what :func:`maxdiff.models.vae_tiling.tiled_decode` runs: one program per tile
  shape (at most four), called tile after tile, every decoded tile kept until the blend; its
  peak beyond the parameters is ``max over tile shapes (temp + output + input)`` + all decoded
  tiles + the blended output image + the input (an upper bound: the blends' small temporaries
  are left out, and not every tile is alive at the last tile's peak).
- ``--parts encode``: the same for ``encode_moments`` on images (untiled) and
  :func:`maxdiff.models.vae_tiling.tiled_encode` (1024-pixel tiles).

Two setups, because the convolution and attention algorithms differ by backend:

- ``cpu``: what runs on this machine (Winograd / sub-pixel convolutions, ``chunked`` attention);
- ``accelerator``: ``MAXDIFF_CONV=xla`` and ``attention_kernel="dot_product"``, which on a GPU
  with float32 (the VAE's single 512-wide head) is XLA's ``dot_product_attention`` with the
  whole score matrix, as a GPU runs it (compiled here for the CPU backend, so buffer assignment
  may differ a little from a GPU's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SDXL_VAE = dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
                up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512],
                layers_per_block=2, latent_channels=4, norm_num_groups=32, sample_size=1024,
                scaling_factor=0.13025, force_upcast=True)
SETUPS = {"cpu": ("auto", "auto"), "accelerator": ("xla", "dot_product")}


def tile_shapes(config, h: int, w: int, part: str = "decode") -> list[tuple[int, int]]:
    """(height, width) of every tile :func:`tiled_decode` (latent tiles of an (h, w) latent
    image) or :func:`tiled_encode` (pixel tiles of an (h, w) image) cuts, in order."""
    from maxdiff.models.vae_tiling import OVERLAP, tile_sizes

    latent_tile, sample, stride, _, _ = tile_sizes(config)
    tile = latent_tile
    if part == "encode":
        tile, stride = sample, int(sample * (1 - OVERLAP))
    return [(min(tile, h - i), min(tile, w - j))
            for i in range(0, h, stride) for j in range(0, w, stride)]


def program_memory(vae, params, shape, part: str = "decode") -> dict:
    """XLA's memory analysis of one decode program for latents of ``shape`` (B, h, w, C), or
    of one encode program (``encode_moments``) for images of ``shape`` (B, H, W, 3)."""
    import jax
    import jax.numpy as jnp

    method = "decode" if part == "decode" else "encode_moments"
    fn = jax.jit(lambda p, z: vae.apply({"params": p}, z, method=method))
    z = jax.ShapeDtypeStruct(shape, jnp.float32)
    m = fn.lower(params, z).compile().memory_analysis()
    return dict(temp=int(m.temp_size_in_bytes), output=int(m.output_size_in_bytes),
                argument=int(m.argument_size_in_bytes), alias=int(m.alias_size_in_bytes))


def parse_size(text: str) -> tuple[int, int]:
    """``"1024"`` or ``"2048x1024"`` (width x height) -> (height, width)."""
    w, _, h = text.lower().partition("x")
    return int(h or w), int(w)


def measure(setup: str, sizes: list[tuple[int, int]], batch: int,
            part: str = "decode") -> list[dict]:
    conv_mode, kernel = SETUPS[setup]
    os.environ["MAXDIFF_CONV"] = conv_mode  # read at trace time
    import jax
    import numpy as np

    from maxdiff.models.vae import AutoencoderKL, AutoencoderKLConfig, param_shapes
    from maxdiff.models.vae_tiling import needs_tiled_encode, needs_tiling

    cfg = AutoencoderKLConfig.from_dict(SDXL_VAE)
    vae = AutoencoderKL(cfg, attention_kernel=kernel)
    params = param_shapes(vae)  # jax.eval_shape of init: shapes only
    param_bytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(params))
    f, c = cfg.vae_scale_factor, cfg.latent_channels
    decode = part == "decode"
    # bytes per pixel of a tile's input and of its output (float32)
    per_in, per_out = (c * 4, f * f * 3 * 4) if decode else (3 * 4, 2 * c * 4 / (f * f))
    rows, cache = [], {}
    for height, width in sizes:
        lh, lw = height // f, width // f
        latent_bytes = batch * lh * lw * c * 4
        image_bytes = batch * height * width * 3 * 4
        in_bytes, out_bytes = ((latent_bytes, image_bytes) if decode
                               else (image_bytes, 2 * latent_bytes))
        h, w = (lh, lw) if decode else (height, width)
        m = program_memory(vae, params, (batch, h, w, c if decode else 3), part)
        untiled = m["temp"] + m["output"] + in_bytes
        row = dict(setup=setup, part=part, width=width, height=height, batch=batch,
                   param_bytes=param_bytes, untiled_temp=m["temp"], untiled_peak=untiled)
        if needs_tiling(cfg, lh, lw) if decode else needs_tiled_encode(cfg, height, width):
            tiles = tile_shapes(cfg, h, w, part)
            worst = 0
            for th, tw in sorted(set(tiles)):
                if (th, tw) not in cache:
                    shape = (batch, th, tw, c if decode else 3)
                    cache[(th, tw)] = program_memory(vae, params, shape, part)
                t = cache[(th, tw)]
                worst = max(worst, t["temp"] + t["output"] + batch * th * tw * per_in)
            held = int(sum(batch * th * tw * per_out for th, tw in tiles))
            row.update(tiles=len(tiles), tile_shapes=sorted(set(tiles)),
                       tiled_peak=worst + held + out_bytes + in_bytes)
        else:
            row.update(tiles=1, tiled_peak=untiled)  # one tile: tiling changes nothing
        rows.append(row)
        gib = lambda b: f"{b / 2**30:.2f}"
        print(f"{setup:12s} {part:6s} {width:5d}x{height:<5d} batch {batch}: untiled "
              f"{gib(row['untiled_peak'])} GiB (temp {gib(m['temp'])}), tiled "
              f"{gib(row['tiled_peak'])} GiB ({row['tiles']} tiles), parameters "
              f"{gib(param_bytes)} GiB", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=parse_size, nargs="+", metavar="W[xH]",
                    default=[parse_size(s) for s in
                             ("512", "1024", "1280", "1448", "2048x1024", "1536", "2048")])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--setups", nargs="+", choices=sorted(SETUPS), default=["cpu", "accelerator"])
    ap.add_argument("--parts", nargs="+", choices=["decode", "encode"], default=["decode"])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    rows = []
    for part in args.parts:
        for setup in args.setups:
            rows += measure(setup, args.sizes, args.batch, part)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
