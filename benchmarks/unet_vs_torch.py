"""SDXL-architecture UNet forward: maxdiff (JAX) against diffusers (PyTorch) on this CPU.

    python benchmarks/unet_vs_torch.py [--size 512] [--layers 1 2 2] [--kernel xla]

Same random weights (diffusers writes them, maxdiff loads them), same inputs, one process,
timed side by side; prints both times, their ratio and the max difference. ``--layers``
sets transformer_layers_per_block (the real SDXL has 1 2 10; fewer keeps memory and time
modest on a laptop while keeping every block type and attention shape of SDXL).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import numpy as np


def best_of(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=512, help="image size in pixels (latents /8)")
    ap.add_argument("--layers", type=int, nargs=3, default=[1, 2, 2])
    ap.add_argument("--kernel", default="auto", choices=["auto", "chunked", "xla", "dot_product", "splash"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()

    import torch
    from diffusers import UNet2DConditionModel as TorchUNet

    from maxdiff.models.unet import count_params, load_unet

    torch.set_num_threads(args.threads)
    cfg = dict(
        sample_size=args.size // 8, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(320, 640, 1280), cross_attention_dim=2048,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(5, 10, 20), use_linear_projection=True,
        transformer_layers_per_block=tuple(args.layers), addition_embed_type="text_time",
        addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816)
    ref = TorchUNet(**cfg).eval()
    with tempfile.TemporaryDirectory() as d:
        ref.save_pretrained(d)
        unet, params = load_unet(d, attention_kernel=args.kernel)
    print(f"UNet: transformer layers {args.layers}, {count_params(params) / 1e9:.2f} B params, "
          f"{args.size}x{args.size} image, batch 1, {args.threads} threads")

    rng = np.random.default_rng(0)
    h = args.size // 8
    x = rng.standard_normal((1, h, h, 4)).astype(np.float32)
    t = np.array([500.0], np.float32)
    ctx = rng.standard_normal((1, 77, 2048)).astype(np.float32)
    te = rng.standard_normal((1, 1280)).astype(np.float32)
    tid = np.array([[args.size, args.size, 0, 0, args.size, args.size]], np.float32)

    fwd = jax.jit(unet.apply)
    ours = lambda: fwd({"params": params}, x, t, ctx, te, tid).block_until_ready()
    tx = (torch.from_numpy(x).permute(0, 3, 1, 2), torch.from_numpy(t), torch.from_numpy(ctx))
    kw = {"added_cond_kwargs": {"text_embeds": torch.from_numpy(te), "time_ids": torch.from_numpy(tid)}}

    def theirs():
        with torch.no_grad():
            return ref(*tx, **kw).sample

    t_jax = best_of(ours, args.reps)
    t_torch = best_of(theirs, args.reps)
    diff = np.abs(np.asarray(ours()) - theirs().permute(0, 2, 3, 1).numpy()).max()
    print(f"maxdiff (JAX, {args.kernel}): {t_jax:.2f} s   diffusers (torch): {t_torch:.2f} s   "
          f"JAX/torch time ratio: {t_jax / t_torch:.2f}   max |diff|: {diff:.2e}")


if __name__ == "__main__":
    main()
