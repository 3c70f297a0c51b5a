"""Throughput of SDXL-Lightning-shaped text-to-image on one accelerator (H100 / H200), random
weights: one prepared command, no checkpoint and no hub access needed.

    bash benchmarks/accelerator.sh                       # the full run (under 8 minutes)
    python -m benchmarks.accelerator --json out.json     # the same
    python -m benchmarks.accelerator --smoke             # tiny configs, 64², batches 1 and 2
                                                         # (a CPU check of the script: float32)

It builds the full SDXL UNet (2.6 B parameters), the SDXL VAE and both text encoders (CLIP-L and
OpenCLIP bigG) from their config dicts below: parameter shapes from ``jax.eval_shape`` (nothing
is initialised by a jitted ``init``), filled with random values drawn on the host, in bf16 (the
VAE in float32, as ``load_vae`` runs SDXL's VAE, whose config sets ``force_upcast``;
``--vae-dtype bfloat16`` changes that). Attention is ``attention_kernel="dot_product"``: cuDNN's
fused flash attention on NVIDIA GPUs where it applies (bf16, head size a multiple of 8 up to
128: the UNet's 64-wide heads), XLA's ``dot_product_attention`` elsewhere (the VAE's single
512-wide head); the header says which, and whether the compiled UNet holds cuDNN's fused
attention call.

Then, for each batch size (1, 2, 4, 8, 16), a :class:`pipelines.TextToImagePipeline` over those
models generates 1024² images: 4 Euler steps with trailing timesteps (the ``lightning-4step``
preset), no classifier-free guidance, uint8 images back on the host. Separately it times one
UNet forward (one denoising step) and one VAE decode at that batch. Each figure is the median
of ``--reps`` runs after a warm-up run.

Columns: ``images/s`` (whole pipeline), ``ms/UNet step`` and ``ms/VAE decode`` (whole batch),
``TFLOP/s`` and ``MFU %`` of the pipeline, ``UNet MFU %``, and ``peak GiB`` (the device's
``memory_stats()["peak_bytes_in_use"]`` so far; it never goes down, and batches run in
increasing order). MFU is FLOP/s over the chip's dense bf16 peak (989 TFLOP/s for H100 SXM and
H200; ``--peak-tflops`` for others). FLOPs per image: at 1024² with the full configs the design
notes' 6.75 TFLOP per UNet forward and 10.5 TFLOP per VAE decode (XLA's cost analysis does not
count cuDNN's fused attention calls), else XLA's cost analysis of the compiled UNet and VAE
programs; the text encoders are counted as 2 x parameters x 77 tokens each.

Then ``engine=step`` against ``engine=batch`` on the same device and weights (the question:
does step-level batching win where batching is cheap?): ``4 x slots`` one-image requests
arriving at once, their step counts taking turns between 4 and 30 (no CFG). ``engine=batch`` is
request batching as the service does it (a batch queue per step count, batches of at most
``slots`` images, run in the order they formed); ``engine=step`` is a
:class:`pipelines.step_engine.StepEngine` of ``slots`` slots. Each runs the workload once
untimed (its compiles) and once timed: images/s, and the median latency of the 4-step and the
30-step images (``# engine=...`` lines, ``engines`` in the JSON). It is skipped, and said so,
when it would end past ``--total-budget-s`` (540).

Compilation (5 pipeline programs + 10 part programs at full size) would take most of the
budget one after another, so all programs are compiled first, in parallel threads (XLA's
compiler releases the GIL), into a fresh persistent compilation cache; the pipeline's own
calls then load them from it. ``--budget-s`` (default 450) skips the remaining batch sizes if
time runs short (reported). Results go to stdout as a table and, with ``--json PATH``, as JSON.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}  # dense bf16, SXM
DESIGN_TFLOP_1024 = {"unet": 6.75, "vae": 10.5}  # per image at 1024², the design notes
COLUMNS = ["batch", "images/s", "ms/UNet step", "ms/VAE decode", "TFLOP/s", "MFU %",
           "UNet MFU %", "peak GiB"]

# --- configs (diffusers / transformers config.json dicts) ---------------------------------

SDXL_UNET = dict(
    sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
    block_out_channels=[320, 640, 1280], cross_attention_dim=2048,
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    attention_head_dim=[5, 10, 20], use_linear_projection=True,
    addition_embed_type="text_time", addition_time_embed_dim=256,
    transformer_layers_per_block=[1, 2, 10], projection_class_embeddings_input_dim=2816,
    norm_num_groups=32, flip_sin_to_cos=True, freq_shift=0)
SDXL_VAE = dict(
    in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512],
    layers_per_block=2, latent_channels=4, norm_num_groups=32, sample_size=1024,
    scaling_factor=0.13025, force_upcast=True)
CLIP_L = dict(  # SDXL's text_encoder (CLIPTextModel)
    architectures=["CLIPTextModel"], vocab_size=49408, hidden_size=768,
    intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768, eos_token_id=2)
CLIP_BIGG = dict(  # SDXL's text_encoder_2 (CLIPTextModelWithProjection)
    architectures=["CLIPTextModelWithProjection"], vocab_size=49408, hidden_size=1280,
    intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
    max_position_embeddings=77, hidden_act="gelu", projection_dim=1280, eos_token_id=2)

TINY_UNET = dict(
    sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
    block_out_channels=[32, 64], cross_attention_dim=64,
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D"],
    up_block_types=["CrossAttnUpBlock2D", "UpBlock2D"], attention_head_dim=[2, 4],
    use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
    transformer_layers_per_block=1, projection_class_embeddings_input_dim=80, norm_num_groups=8)
TINY_VAE = dict(
    in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[16, 16, 32, 32],
    layers_per_block=1, latent_channels=4, norm_num_groups=8, sample_size=128,
    scaling_factor=0.13025, force_upcast=True)
TINY_CLIP = dict(vocab_size=49408, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=4, max_position_embeddings=77, eos_token_id=2)

SETUPS = {
    "full": dict(size=1024, batches=[1, 2, 4, 8, 16], unet=SDXL_UNET, vae=SDXL_VAE,
                 te1=CLIP_L, te2=CLIP_BIGG),
    "smoke": dict(size=64, batches=[1, 2], unet=TINY_UNET, vae=TINY_VAE,
                  te1=dict(TINY_CLIP, architectures=["CLIPTextModel"], hidden_act="quick_gelu",
                           projection_dim=32),
                  te2=dict(TINY_CLIP, architectures=["CLIPTextModelWithProjection"],
                           hidden_act="gelu", projection_dim=32)),
}
PROMPTS = ["a photo of an astronaut riding a horse on the moon",
           "a lighthouse on a cliff at dusk, oil painting"]


# --- building ------------------------------------------------------------------------------

def random_fill(shapes: dict, dtypes: dict, sharding, seed: int = 0):
    """Arrays of ``shapes``' tree (``jax.ShapeDtypeStruct`` leaves; ``dtypes``: the dtype of
    each top-level entry) on the device, with no compiled program: norm scales 1, biases 0,
    every other leaf a window of one host draw of N(0, 0.02²) values (twice the largest leaf)
    starting at a different offset, copied to the device leaf by leaf. Timing needs the
    values' scale, not their independence. (One jitted program that drew and sliced the
    SDXL-sized tree took over 5 minutes to compile on an H200, 2026-12-04.)"""
    import jax
    import numpy as np

    sizes = [int(np.prod(leaf.shape)) for tree in shapes.values()
             for leaf in jax.tree_util.tree_leaves(tree)]
    base = (0.02 * np.random.default_rng(seed).standard_normal(2 * max(sizes) + 1, np.float32))
    cast = {}
    offset = 0

    def window(n: int, dtype):
        nonlocal offset
        if dtype not in cast:
            cast[dtype] = base.astype(dtype)
        offset = (offset + 7_919) % (base.size - n)
        return cast[dtype][offset:offset + n]

    out = {}
    for comp, tree in shapes.items():
        dtype = np.dtype(dtypes[comp])
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        arrays = []
        for path, leaf in leaves:
            name = str(getattr(path[-1], "key", path[-1]))
            n = int(np.prod(leaf.shape))
            if name == "scale":
                host = np.ones(leaf.shape, dtype)
            elif name == "bias":
                host = np.zeros(leaf.shape, dtype)
            else:
                host = window(n, dtype).reshape(leaf.shape)
            arrays.append(jax.device_put(host, sharding))
        out[comp] = jax.tree_util.tree_unflatten(treedef, arrays)
    return out


def build_pipeline(spec: dict, dtype: str, vae_dtype: str, kernel: str,
                   quantization: str = "none", params: dict | None = None):
    """The pipeline over random weights (``params``: reuse these float weights instead of
    drawing new ones); ``quantization`` other than ``"none"`` quantizes its UNet through
    :func:`maxdiff.quantization.quantize` (qwix), the other parts shared."""
    import jax
    import jax.numpy as jnp

    from maxdiff import mesh as meshlib
    from maxdiff.models.clip import ARCHITECTURES, CLIPTextConfig
    from maxdiff.models.unet import UNet2DConditionModel, UNetConfig
    from maxdiff.models.unet import param_shapes as unet_shapes
    from maxdiff.models.vae import AutoencoderKL, AutoencoderKLConfig
    from maxdiff.models.vae import param_shapes as vae_shapes
    from maxdiff.schedulers import load_scheduler
    from maxdiff.tokenizers import load_tokenizer
    from pipelines import TextToImagePipeline
    from pipelines.default_model import EMBEDDED

    dt = jnp.dtype(dtype)
    vdt = jnp.dtype(vae_dtype)
    mesh = meshlib.make_mesh(1)
    rep = meshlib.replicated(mesh)
    unet = UNet2DConditionModel(UNetConfig.from_dict(spec["unet"]), kernel, 512, dt)
    vae = AutoencoderKL(AutoencoderKLConfig.from_dict(spec["vae"]), attention_kernel=kernel,
                        dtype=vdt)
    encoders = []
    for name in ("te1", "te2"):
        cfg = CLIPTextConfig.from_dict(spec[name])
        encoders.append(ARCHITECTURES[cfg.architectures[0]](cfg, dtype=dt))
    ids = jax.ShapeDtypeStruct((1, 77), jnp.int32)
    shapes = {"unet": unet_shapes(unet), "vae": vae_shapes(vae),
              "text_encoder": jax.eval_shape(encoders[0].init, jax.random.key(0), ids)["params"],
              "text_encoder_2": jax.eval_shape(encoders[1].init, jax.random.key(0), ids)["params"]}
    if params is None:
        params = random_fill(shapes, {k: vdt if k == "vae" else dt for k in shapes}, rep)
    if quantization != "none":
        from maxdiff.quantization import quantize

        unet, qunet = quantize(unet, params["unet"], quantization)
        params = {**params, "unet": qunet}
    pipe = TextToImagePipeline(
        tokenizer=load_tokenizer(EMBEDDED / "tokenizer"),
        tokenizer_2=load_tokenizer(EMBEDDED / "tokenizer_2"),
        text_encoder=encoders[0], text_encoder_2=encoders[1], unet=unet, vae=vae,
        scheduler=load_scheduler("lightning-4step"), params=params, mesh=mesh,
        default_steps=4, default_guidance=0.0, name="random SDXL-Lightning-shaped weights",
        quantization=quantization)
    pipe.default_height = pipe.default_width = spec["size"]
    return pipe


def count(tree) -> int:
    import jax
    import numpy as np

    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))


# --- compiling -----------------------------------------------------------------------------

class _Captured(Exception):
    pass


def part_programs(pipe, batch: int):
    """(name, jitted fn, args) of one UNet forward and one VAE decode at ``batch``."""
    import jax
    import jax.numpy as jnp

    unet, vae, p = pipe.unet, pipe.vae, pipe.params
    f = pipe.vae_scale_factor
    lh = lw = pipe.default_height // f
    rep = jax.sharding.NamedSharding(pipe.mesh, jax.sharding.PartitionSpec())
    key = jax.random.key(batch)

    def concrete(s, k, dtype=None):
        return jax.device_put(jax.random.normal(k, s.shape, jnp.float32).astype(dtype or s.dtype),
                              rep)

    dummy = unet.dummy_inputs(batch, lh, lw)
    ks = jax.random.split(key, 6)
    unet_args = (p["unet"], concrete(dummy["sample"], ks[0]),
                 jax.device_put(jnp.full((), 999.0, jnp.float32), rep),
                 concrete(dummy["encoder_hidden_states"], ks[1], unet.dtype),
                 concrete(dummy["text_embeds"], ks[2], unet.dtype),
                 jax.device_put(jnp.tile(jnp.asarray([[1024.0, 1024.0, 0, 0, 1024.0, 1024.0]]),
                                         (batch, 1)), rep))
    unet_fn = jax.jit(lambda pu, x, t, e, pooled, tids: unet.apply(
        {"params": pu}, x, t, e, pooled, tids))
    vae_args = (p["vae"], concrete(dummy["sample"], ks[3]))
    vae_fn = jax.jit(lambda pv, z: vae.apply({"params": pv}, z, method="latents_to_image"))
    return [("unet", unet_fn, unet_args), ("vae", vae_fn, vae_args)]


def items(batch: int):
    from pipelines import ImageRequest

    return [ImageRequest(PROMPTS[k % len(PROMPTS)], seed=k, guidance_scale=0.0)
            for k in range(batch)]


def compile_all(pipe, batches: list[int], threads: int) -> tuple[dict, dict]:
    """Lower every program on this thread and compile each in a thread pool as soon as it is
    lowered; returns ({(name, batch): compiled}, {(name, batch): args}). The pipeline's
    programs are captured from ``pipe.generate`` (its ``programs.get`` wrapped so that the call
    lowers instead of running)."""
    futures, inputs = {}, {}
    original = pipe.programs.get
    with cf.ThreadPoolExecutor(max_workers=threads) as pool:
        for b in batches:
            captured = {}

            def capture(key, build, captured=captured, **jit_kwargs):
                program = original(key, build, **jit_kwargs)

                def run(*call_args):
                    captured["lowered"] = program.fn.lower(*call_args)
                    raise _Captured

                return run

            pipe.programs.get = capture
            try:
                pipe.generate(items(b), num_inference_steps=4)
            except _Captured:
                pass
            finally:
                del pipe.programs.get  # the class's method again
            futures[("pipeline", b)] = pool.submit(captured["lowered"].compile)
            for name, fn, args in part_programs(pipe, b):
                futures[(name, b)] = pool.submit(fn.lower(*args).compile)
                inputs[(name, b)] = args
        return {key: fut.result() for key, fut in futures.items()}, inputs


def xla_flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float((cost or {}).get("flops", 0.0))


def memory_bytes(compiled) -> int | None:
    try:
        m = compiled.memory_analysis()
        return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes
                   - m.alias_size_in_bytes)
    except Exception:  # not every backend reports it
        return None


# --- engine=step against engine=batch ---------------------------------------------------------

def mixed_workload(n: int, steps: tuple[int, ...] = (4, 30)) -> list[tuple[object, int]]:
    """``n`` one-image requests, all arriving at once, their step counts taking turns (4, 30,
    4, 30, ...): (ImageRequest, steps) in arrival order."""
    return [(r, steps[k % len(steps)]) for k, r in enumerate(items(n))]


def run_batch_engine(pipe, work, slots: int) -> list[float]:
    """What ``engine=batch`` does with requests that all arrived at once: one batch queue per
    shape key (here: the step count), batches of at most ``slots`` images, run in the order
    they formed (FIFO, the keys taking turns); returns each image's latency (s) in order."""
    t0 = time.perf_counter()
    queues: dict[int, list[int]] = {}
    for k, (_, steps) in enumerate(work):
        queues.setdefault(steps, []).append(k)
    batches = []
    while any(queues.values()):
        for steps, q in queues.items():
            if q:
                batches.append((steps, q[:slots]))
                del q[:slots]
    latency = [0.0] * len(work)
    for steps, idx in batches:
        out = pipe.generate([work[k][0] for k in idx], num_inference_steps=steps,
                            output_type="np")
        np_images = out.images  # on the host: the batch is done
        assert len(np_images) == len(idx)
        for k in idx:
            latency[k] = time.perf_counter() - t0
    return latency


def run_step_engine(engine, work) -> list[float]:
    """The same requests through a step engine (``engine=step``): submitted at once, ticked
    until idle; returns each image's latency (s) in order."""
    t0 = time.perf_counter()
    handles = [engine.submit(r, steps) for r, steps in work]
    engine.run_until_idle()
    assert all(h.status == "done" for h in handles)
    return [h.finished_at - t0 for h in handles]


def compare_engines(pipe, slots: int, n: int, budget_end: float) -> dict | None:
    """engine=step against engine=batch on the device, on the mixed 4/30-step workload
    (no CFG): each engine runs the workload once untimed (its compiles) and once timed, unless
    ``budget_end`` (``time.perf_counter()``) would pass first. images/s over the whole run,
    and the median latency of the 4-step and of the 30-step images: request batching runs the
    short images in batches of their own, but they queue behind whole 30-step batches; the
    step engine lets them leave after 4 ticks, and pays for its per-step programs."""
    from pipelines.step_engine import StepEngine

    work = mixed_workload(n)
    result: dict = {"images": n, "slots": slots, "steps": [4, 30]}
    engine = StepEngine(pipe, slots=slots, cfg=False, max_steps=30, output_type="np")
    runners = {"batch": lambda: run_batch_engine(pipe, work, slots),
               "step": lambda: run_step_engine(engine, work)}
    for name, run in runners.items():
        t = time.perf_counter()
        if t > budget_end:
            result[name] = {"skipped": "over the time budget", "first_run_s": None}
            continue
        run()  # compiles what this engine needs for the workload
        warm_s = time.perf_counter() - t
        if time.perf_counter() + warm_s > budget_end:  # the timed run takes at most as long
            result[name] = {"skipped": "over the time budget", "first_run_s": round(warm_s, 2)}
            continue
        latency = run()
        total = max(latency)
        result[name] = {
            "images_per_s": round(n / total, 4), "run_s": round(total, 4),
            "first_run_s": round(warm_s, 2),
            "p50_latency_4_step_s": round(statistics.median(
                t for t, (_, s) in zip(latency, work) if s == 4), 4),
            "p50_latency_30_step_s": round(statistics.median(
                t for t, (_, s) in zip(latency, work) if s == 30), 4)}
    if "images_per_s" in result["batch"] and "images_per_s" in result["step"]:
        result["step_over_batch_images_per_s"] = round(
            result["step"]["images_per_s"] / result["batch"]["images_per_s"], 3)
    return result


# --- timing --------------------------------------------------------------------------------

def median_time(fn, reps: int, warm_up: bool = True) -> float:
    if warm_up:
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def peak_bytes() -> int | None:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def chip_peak(kind: str, override: float | None) -> float | None:
    if override:
        return override
    for name, tflops in PEAK_TFLOPS.items():
        if name.lower() in kind.lower():
            return tflops
    return None


def fmt(v, digits=1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny configs, 64², batches 1 and 2")
    ap.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 1 2 4 8 16)")
    ap.add_argument("--size", type=int, help="image side (default 1024; smoke 64)")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per figure (median)")
    ap.add_argument("--dtype", default="auto",
                    help="auto: bfloat16, except float32 for --smoke on a CPU (XLA:CPU compiles "
                         "bf16 programs about twice as slowly); or bfloat16 / float32")
    ap.add_argument("--vae-dtype", default="auto",
                    help="auto: float32 when the VAE config sets force_upcast (SDXL's does), "
                         "as load_vae does; or bfloat16 / float32")
    ap.add_argument("--attention", default="dot_product",
                    help="attention kernel (default dot_product: cuDNN fused attention on GPUs)")
    ap.add_argument("--quantization", nargs="+", default=["none"],
                    choices=["none", "int8-weights", "int8", "fp8"],
                    help="one table per setting, the UNet quantized through qwix "
                         "(maxdiff.quantization; needs qwix): e.g. none int8 fp8")
    ap.add_argument("--peak-tflops", type=float, help="the chip's dense bf16 peak")
    ap.add_argument("--threads", type=int, default=max(2, (os.cpu_count() or 2)),
                    help="parallel compilations")
    ap.add_argument("--budget-s", type=float, default=450.0,
                    help="skip the remaining batch sizes once this much time has passed")
    ap.add_argument("--engines-images", type=int, default=None,
                    help="images of the engine=step vs engine=batch comparison (mixed 4/30 "
                         "steps, no CFG; default 4 x --engines-slots); 0 skips it")
    ap.add_argument("--engines-slots", type=int, default=None,
                    help="slots of the step engine = the batch engine's batch size (default 8; "
                         "smoke 2)")
    ap.add_argument("--total-budget-s", type=float, default=540.0,
                    help="the comparison (after the table) is cut short past this many "
                         "seconds from the start")
    ap.add_argument("--cache-dir", help="persistent compilation cache (default: a fresh "
                                        "temporary folder)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if args.smoke:  # the accelerators' convolutions (XLA's), not the CPU-only algorithms
        os.environ.setdefault("MAXDIFF_CONV", "xla")
    spec = dict(SETUPS["smoke" if args.smoke else "full"])
    if args.size:
        spec["size"] = args.size
    batches = args.batches or spec["batches"]

    import jax

    cache = args.cache_dir or tempfile.mkdtemp(prefix="maxdiff-accel-cache-")
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    from maxdiff.models.attention import dot_product_implementation

    dev = jax.devices()[0]
    backend = jax.default_backend()
    if args.dtype == "auto":
        args.dtype = "float32" if args.smoke and backend == "cpu" else "bfloat16"
    vae_dtype = args.vae_dtype
    if vae_dtype == "auto":
        vae_dtype = "float32" if spec["vae"].get("force_upcast") else args.dtype
    pipe = build_pipeline(spec, args.dtype, vae_dtype, args.attention)
    jax.block_until_ready(pipe.params)
    t_built = time.perf_counter()
    n_params = {k: count(v) for k, v in pipe.params.items()}
    ucfg = pipe.unet.config
    unet_head = ucfg.block_out_channels[-1] // ucfg.heads[-1]  # 64 for SDXL
    impl_unet = dot_product_implementation(backend, args.dtype, unet_head) or "xla"
    impl_vae = dot_product_implementation(backend, vae_dtype,
                                          pipe.vae.config.block_out_channels[-1]) or "xla"
    if args.attention != "dot_product":
        impl_unet = impl_vae = args.attention
    peak = chip_peak(dev.device_kind, args.peak_tflops)
    header = dict(device=f"{dev.platform}: {dev.device_kind}", backend=backend,
                  jax=jax.__version__, setup="smoke" if args.smoke else "full",
                  size=spec["size"], steps=4, cfg=False, dtype=args.dtype, vae_dtype=vae_dtype,
                  attention=args.attention, attention_unet=impl_unet, attention_vae=impl_vae,
                  params={k: v for k, v in n_params.items()}, peak_tflops=peak,
                  build_s=round(t_built - t_start, 1))
    print(f"# {header['device']} | jax {jax.__version__} | {header['setup']} configs, "
          f"{spec['size']}², 4 Euler trailing steps, no CFG | {args.dtype} (VAE {vae_dtype})",
          flush=True)
    print("# parameters: " + ", ".join(f"{k} {v / 1e6:.1f} M" for k, v in n_params.items())
          + f" | built in {t_built - t_start:.1f} s", flush=True)
    print(f"# attention {args.attention}: UNet -> {impl_unet}, VAE -> {impl_vae}", flush=True)

    full_1024 = not args.smoke and spec["size"] == 1024
    text_flops = 2 * 77 * (n_params["text_encoder"] + n_params["text_encoder_2"])
    rows, skipped, failed = [], [], []
    float_pipe = pipe
    for mode in args.quantization:
        if time.perf_counter() - t_start > args.budget_s:
            skipped += [(mode, b) for b in batches]
            continue
        t_built = time.perf_counter()
        try:
            pipe = float_pipe if mode == "none" else build_pipeline(
                spec, args.dtype, vae_dtype, args.attention, mode, float_pipe.params)
        except Exception as e:  # noqa: BLE001  (qwix missing, a backend without fp8 ...)
            failed.append({"quantization": mode,
                           "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(f"# quantization={mode}: failed: {failed[-1]['error']}", flush=True)
            continue
        print(f"# quantization={mode}", flush=True)
        compiled, inputs = compile_all(pipe, batches, args.threads)
        t_compiled = time.perf_counter()
        try:
            cudnn = "__cudnn$fmha" in compiled[("unet", batches[0])].as_text()
        except Exception:  # as_text is not available everywhere
            cudnn = None
        info = dict(compile_s=round(t_compiled - t_built, 1), cudnn_fused_attention_in_unet=cudnn)
        header.setdefault("quantization", {})[mode] = info
        if len(header["quantization"]) == 1:
            header.update(info)  # the first setting's, where earlier runs kept them
        print(f"# compiled {len(compiled)} programs in parallel in {t_compiled - t_built:.1f} s; "
              f"cuDNN fused attention in the compiled UNet: "
              f"{ {True: 'yes', False: 'no', None: 'unknown'}[cudnn]}", flush=True)

        print(" | ".join(COLUMNS), flush=True)
        for b in batches:
            if time.perf_counter() - t_start > args.budget_s:
                skipped.append((mode, b))
                continue
            unet_c, vae_c = compiled[("unet", b)], compiled[("vae", b)]
            if full_1024:
                source = "design notes"
                unet_fl = DESIGN_TFLOP_1024["unet"] * 1e12 * b
                vae_fl = DESIGN_TFLOP_1024["vae"] * 1e12 * b
            else:
                source = "xla cost analysis"
                unet_fl, vae_fl = xla_flops(unet_c), xla_flops(vae_c)
            pipe_fl = 4 * unet_fl + vae_fl + text_flops * b
            try:  # one batch size that does not fit (memory) must not cost the others
                t_first = time.perf_counter()
                pipe.generate(items(b), num_inference_steps=4)  # loads the program from the cache
                first_s = time.perf_counter() - t_first
                t_pipe = median_time(lambda pipe=pipe, b=b: pipe.generate(items(b), num_inference_steps=4),
                                     args.reps, warm_up=False)  # the first call was the warm-up
                unet_args, vae_args = inputs[("unet", b)], inputs[("vae", b)]
                t_unet = median_time(lambda f=unet_c, a=unet_args: jax.block_until_ready(f(*a)),
                                     args.reps)
                t_vae = median_time(lambda f=vae_c, a=vae_args: jax.block_until_ready(f(*a)), args.reps)
                pk = peak_bytes()
                row = {"quantization": mode, "batch": b, "images/s": b / t_pipe,
                       "ms/UNet step": 1e3 * t_unet,
                       "ms/VAE decode": 1e3 * t_vae, "TFLOP/s": pipe_fl / t_pipe / 1e12,
                       "MFU %": None if peak is None else 100 * pipe_fl / t_pipe / 1e12 / peak,
                       "UNet MFU %": None if peak is None else 100 * unet_fl / t_unet / 1e12 / peak,
                       "peak GiB": None if pk is None else pk / 2**30}
                extra = dict(pipeline_s=t_pipe, first_call_s=first_s, flops_source=source,
                             unet_tflop=unet_fl / 1e12, vae_tflop=vae_fl / 1e12,
                             pipeline_tflop=pipe_fl / 1e12,
                             program_bytes={k: memory_bytes(compiled[(k, b)])
                                            for k in ("pipeline", "unet", "vae")},
                             vae_mfu_pct=None if peak is None else
                             100 * vae_fl / t_vae / 1e12 / peak)
                print(" | ".join([str(b), fmt(row["images/s"], 2), fmt(row["ms/UNet step"]),
                                  fmt(row["ms/VAE decode"]), f"{row['TFLOP/s']:.3g}",
                                  fmt(row["MFU %"]), fmt(row["UNet MFU %"]),
                                  fmt(row["peak GiB"], 2)]), flush=True)
                rows.append({**row, **extra})
            except Exception as e:  # noqa: BLE001  (XlaRuntimeError: RESOURCE_EXHAUSTED, ...)
                failed.append({"quantization": mode, "batch": b,
                               "error": f"{type(e).__name__}: {str(e)[:300]}"})
                print(f"# batch {b}: failed: {failed[-1]['error']}", flush=True)
        del compiled, inputs
    pipe = float_pipe  # the quantized pipelines (and their programs) go
    if skipped:
        print(f"# skipped (quantization, batch): {skipped}: over the {args.budget_s:.0f} s budget",
              flush=True)
    slots = args.engines_slots or (2 if args.smoke else 8)
    n_mixed = 4 * slots if args.engines_images is None else args.engines_images
    engines = None
    if n_mixed:
        try:
            engines = compare_engines(pipe, slots, n_mixed, t_start + args.total_budget_s)
        except Exception as e:  # noqa: BLE001  (the table above is kept either way)
            msg = f"{type(e).__name__}: {str(e)[:300]}"
            engines = {n: {"skipped": f"failed: {msg}", "first_run_s": None}
                       for n in ("batch", "step")}
        for name in ("batch", "step"):
            r = engines[name]
            if "skipped" in r:
                print(f"# engine={name}: skipped ({r['skipped']}; first run "
                      f"{r['first_run_s']} s)", flush=True)
                continue
            print(f"# engine={name}: {n_mixed} images, 4/30 steps mixed, {slots} slots: "
                  f"{r['images_per_s']:.3f} images/s, p50 latency 4-step "
                  f"{r['p50_latency_4_step_s']:.3f} s, 30-step {r['p50_latency_30_step_s']:.3f} s",
                  flush=True)
        if "step_over_batch_images_per_s" in engines:
            print(f"# engine=step / engine=batch images/s: "
                  f"{engines['step_over_batch_images_per_s']:.3f}", flush=True)
    total = time.perf_counter() - t_start
    print(f"# total {total:.1f} s (FLOPs: {rows[0]['flops_source'] if rows else '-'})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(
            dict(header, total_s=round(total, 1), skipped_batches=skipped,
                 failed_batches=failed, columns=COLUMNS,
                 rows=rows, engines=engines), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
