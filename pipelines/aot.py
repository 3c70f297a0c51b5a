"""Compile the pipelines' programs for chips this machine does not have, and read their cost.

With ``libtpu`` installed (``pip install 'maxdiff[tpu]'``) JAX compiles for a TPU topology on a
CPU host; with its CUDA plugin (``pip install 'maxdiff[cuda]'``, and ``JAX_PLATFORMS=cpu``) for
NVIDIA H100 / H200 GPUs (:func:`maxdiff.mesh.topology_mesh`; XLA's GPU compiler gives no cost
analysis without a device, so GPU programs report HBM and collectives only). :func:`load`
reads a model's configs only (no weights: :func:`maxdiff.checkpoint.shapes_only`) onto a
compile-only mesh of the topology's chips; the pipeline it returns, and any
pipeline made from it (``from_pipe``, the step engine), compiles its programs when called
instead of running them (:class:`CompileOnly`), and draws black images. Inside :func:`recording`
each call yields the compiled programs; :func:`analyse` turns one into the figures a platform
engineer asks for: HBM per chip, flops and bytes per chip, the roofline time on the chip's
published peaks, which bound, and the collectives in the compiled HLO.

XLA's ``optimal_seconds`` is not used (it came back negative); Pallas kernels (splash
attention) are custom calls whose work XLA does not count, so their analytic flops and bytes
are added (:func:`maxdiff.models.attention.counting_kernel_costs`).

Two byte counts, because they differ by a factor of two or more on a TPU: XLA's cost analysis
(``"bytes accessed"``) sums every operation's operands and results wherever they live, and the
TPU compiler keeps many activations in the chip's on-chip VMEM (memory space 1 in the compiled
HLO, ``S(1)`` in a layout), whose bandwidth is not the HBM's. :func:`memory_traffic` reads the
compiled HLO and splits the same sum by memory space: the part that touches HBM is what the
HBM's bandwidth serves. Both are reported; both count each operand once per operation (a
kernel that re-reads a tile counts it once), so neither is an upper bound.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from maxdiff import checkpoint
from maxdiff import mesh as meshlib
from pipelines.compile_only import CompileOnly, recording  # noqa: F401 (the report's API)

GIB = 1 << 30
# collective ops as they appear in compiled HLO text (async ones as -start / -done pairs)
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter",
               "collective-broadcast", "ragged-all-to-all")
_COLLECTIVE_RE = re.compile(r"= [^=]*?\b(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_CHANNEL_RE = re.compile(r"\bchannel_id=(\d+)")


@dataclass(frozen=True)
class Chip:
    """A chip's published peaks: dense bf16 flop/s, HBM bytes/s, HBM bytes."""

    name: str
    flops: float
    hbm_bytes_per_s: float
    hbm_bytes: float

    @property
    def ridge(self) -> float:
        """Flops per HBM byte above which a program is compute-bound."""
        return self.flops / self.hbm_bytes_per_s


# Google Cloud's published per-chip figures (bf16 dense, HBM bandwidth and capacity)
CHIPS = {
    "TPU v5 lite": Chip("v5e", 197e12, 819e9, 16 * GIB),
    "TPU v6 lite": Chip("v6e", 918e12, 1640e9, 32 * GIB),
    "TPU v5": Chip("v5p", 459e12, 2765e9, 95 * GIB),
    "TPU v5p": Chip("v5p", 459e12, 2765e9, 95 * GIB),
    # NVIDIA's SXM figures: dense bf16 tensor-core flop/s, HBM bandwidth, HBM
    "NVIDIA H100 80GB HBM3": Chip("h100", 989e12, 3350e9, 80e9),
    "NVIDIA H200": Chip("h200", 989e12, 4800e9, 141e9),
}


def chip_of(mesh) -> Chip:
    kind = mesh.devices.flat[0].device_kind
    if kind not in CHIPS:
        raise ValueError(f"no published peaks for {kind!r}; known: {', '.join(CHIPS)}")
    return CHIPS[kind]


def model_folder(config: str | Path, out: str | Path) -> Path:
    """A diffusers folder of configs only in ``out``: ``config`` (a shipped name under
    ``maxdiff/assets/configs``, e.g. ``"sdxl-base"``, or a folder) with the embedded model's
    tokenizers where it has none (they set no shape a program depends on beyond 77 tokens)."""
    from pipelines.default_model import EMBEDDED

    src = Path(config)
    if not src.is_dir():
        src = Path(checkpoint.__file__).parent / "assets" / "configs" / str(config)
        if not src.is_dir():
            raise ValueError(f"config {config!r}: neither a folder nor a shipped config")
    out = Path(out)
    shutil.copytree(src, out, dirs_exist_ok=True)
    for name in ("tokenizer", "tokenizer_2"):
        if not (out / name).is_dir():
            shutil.copytree(EMBEDDED / name, out / name)
    return out


def load(path: str | Path, topology: str, dtype: str = "bfloat16", **kwargs: Any):
    """A :class:`pipelines.TextToImagePipeline` of the model at ``path`` (configs only; weights,
    if present, are not read) on a compile-only mesh of ``topology``'s chips (``"v5e:2x2"``,
    ``"h200:1"``):
    its calls compile and record programs (:func:`recording`)."""
    from pipelines.text_to_image import TextToImagePipeline

    mesh = meshlib.topology_mesh(topology)
    with checkpoint.shapes_only():
        return TextToImagePipeline.from_pretrained(
            path, dtype, devices=list(mesh.devices.flat), compile_cache_dir=None, **kwargs)


def collectives(hlo_text: str) -> dict[str, int]:
    """How many of each collective op the compiled HLO holds: an async pair counts once, and
    so does one collective (one ``channel_id``) that the TPU compiler copies into several
    computations (its async collective fusions: a step-engine program of 30 collectives
    shows 172 such instructions)."""
    seen: dict[str, set] = {}
    for line_no, line in enumerate(hlo_text.splitlines()):
        m = _COLLECTIVE_RE.search(line)
        if m is not None:
            channel = _CHANNEL_RE.search(line)
            seen.setdefault(m.group(1), set()).add(
                channel.group(1) if channel else f"line {line_no}")
    return {op: len(ids) for op, ids in seen.items()}


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
                "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_ARRAY_RE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\](\{[^}]*\})?")
_INST_RE = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
# computations that run as themselves (not fused into an operation): loop bodies, branches,
# called computations; a fusion's or a reduction's computation is part of its operation
_RUNS_RE = re.compile(r"\b(?:body|condition|true_computation|false_computation)=%([\w.\-]+)"
                      r"|branch_computations=\{([^}]*)\}")
# the Flax modules the programs' loops run (pipelines.loop.denoise, pipelines.program.decode)
LOOP_NAMES = ("UNet2DConditionModel", "AutoencoderKL")
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
         "copy-done", "slice-done", "while", "conditional", "partition-id", "replica-id"}


def _arrays(text: str) -> list[tuple[int, int]]:
    """(bytes, memory space) of each array shape in an HLO shape text (a tuple: several)."""
    out = []
    for dt, dims, layout in _ARRAY_RE.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        space = re.search(r"S\((\d+)\)", layout or "")
        out.append((n * _DTYPE_BYTES[dt], int(space.group(1)) if space else 0))
    return out


def memory_traffic(hlo_text: str) -> dict[str, float]:
    """The bytes a compiled program's operations read and write, by where they live: ``hbm``
    (memory space 0) and ``on_chip`` (every other space: VMEM, SMEM). Each operation of a
    computation that runs as itself (the entry, loop bodies, branches; once each, as XLA's
    cost analysis counts a loop's body once) adds its operands and results; an async copy or
    slice counts what it moves; bitcasts, tuples and parameters move nothing."""
    totals = {"hbm": 0.0, "on_chip": 0.0}
    for part in loop_traffic(hlo_text).values():
        for k in totals:
            totals[k] += part[k]
    return totals


def loop_traffic(hlo_text: str, names: tuple[str, ...] = LOOP_NAMES) -> dict[str, dict]:
    """:func:`memory_traffic` per part of the program: ``"entry"`` (what runs once, with any
    loop whose body names none of ``names``) and, for each of ``names`` (the Flax module a loop
    runs: the denoising loop's UNet, the decode loop's VAE), the loops whose body's operations
    name it most, counted once. A program's loops run many times (the UNet once a step, the
    decoder once an image), so this is how their HBM traffic is priced in the context the
    compiler gave them (a model compiled alone may be laid out differently)."""
    comps: dict[str, list[str]] = {}
    entry, cur = None, None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            name = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            cur = comps.setdefault(name, [])
            entry = name if line.startswith("ENTRY") else entry
        elif cur is not None and line.startswith("  "):
            cur.append(line)
    sizes: dict[str, list] = {}
    for lines in comps.values():
        for line in lines:
            m = _INST_RE.match(line)
            if m:
                sizes[m.group(1)] = _arrays(m.group(2))
    parts = {key: {"hbm": 0.0, "on_chip": 0.0} for key in ("entry", *names)}
    todo, seen = [(entry, "entry")], set()
    while todo:
        name, part = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            for a, b in _RUNS_RE.findall(line):
                for body in [a] if a else re.findall(r"%([\w.\-]+)", b):
                    text = "\n".join(comps.get(body, ()))
                    counts = {n: text.count(n) for n in names}
                    most = max(counts, key=counts.get) if names else None
                    todo.append((body, most if most and counts[most] else part))
            m = _INST_RE.match(line)
            if not m or m.group(3) in _FREE:
                continue
            _, shape, op, rest = m.groups()
            out = _arrays(shape)
            operands = [a for o in re.findall(r"%([\w.\-]+)", rest.split(")")[0])
                        for a in sizes.get(o, [])]
            if op in ("copy-start", "slice-start") and len(out) > 1:
                # (destination, source, context) and ((source), destination, context): what
                # moves is the destination's bytes, read from the source's memory space
                dest, src = out[::-1][1:3] if op == "slice-start" else out[:2]
                operands, out = [(dest[0], src[1])], [dest]
            for nbytes, space in operands + out:
                parts[part]["hbm" if space == 0 else "on_chip"] += nbytes
    return parts


def analyse(entry: dict, chip: Chip, images_per_chip: float) -> dict:
    """A recorded program (:func:`recording`) -> per-chip figures: HBM it
    needs, flops and HBM bytes (XLA's count plus the Pallas kernels'), roofline seconds on
    ``chip``, the bound, images/s per chip at ``images_per_chip`` images a call, collectives."""
    compiled = entry["compiled"]
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    if cost is None:  # XLA's GPU compiler gives no cost analysis without a device
        return fit(entry, chip)
    flops = float(cost.get("flops", 0.0)) + entry["kernel_flops"] / entry["shards"]
    nbytes = float(cost.get("bytes accessed", 0.0)) + entry["kernel_bytes"] / entry["shards"]
    # the Pallas kernels' own HBM traffic is analytic (their operands are counted below too)
    loops = loop_traffic(compiled.as_text())
    hbm = sum(part["hbm"] for part in loops.values()) + entry["kernel_bytes"] / entry["shards"]
    compute_s = flops / chip.flops
    memory_s, hbm_s = nbytes / chip.hbm_bytes_per_s, hbm / chip.hbm_bytes_per_s
    seconds, hbm_seconds = max(compute_s, memory_s), max(compute_s, hbm_s)
    return {
        **fit(entry, chip), "tflop": flops / 1e12, "gbytes": nbytes / 1e9,
        "kernel_tflop": entry["kernel_flops"] / entry["shards"] / 1e12,
        "kernel_gbytes": entry["kernel_bytes"] / entry["shards"] / 1e9,
        # HBM traffic per loop (loop_traffic), GB: "entry" and each of LOOP_NAMES
        "hbm_gbytes_by_loop": {k: part["hbm"] / 1e9 for k, part in loops.items()},
        "flops_per_byte": flops / nbytes if nbytes else float("inf"),
        "ridge": chip.ridge, "bound": "compute" if compute_s >= memory_s else "memory",
        "roofline_s": seconds,
        "images_per_s_per_chip": images_per_chip / seconds if seconds else float("inf"),
        # the same with the bytes that touch HBM only (VMEM-resident traffic left out)
        "hbm_gbytes": hbm / 1e9, "hbm_flops_per_byte": flops / hbm if hbm else float("inf"),
        "hbm_bound": "compute" if compute_s >= hbm_s else "memory",
        "hbm_roofline_s": hbm_seconds,
        "hbm_images_per_s_per_chip": (images_per_chip / hbm_seconds if hbm_seconds
                                      else float("inf")),
    }


def fit(entry: dict, chip: Chip) -> dict:
    """A recorded program's HBM per chip and collectives (what every backend reports)."""
    compiled = entry["compiled"]
    mem = compiled.memory_analysis()
    hbm = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
           - mem.alias_size_in_bytes)
    found = collectives(compiled.as_text())
    return {"hbm_gib": hbm / GIB, "hbm_fraction": hbm / chip.hbm_bytes,
            "fits": hbm <= chip.hbm_bytes, "arguments_gib": mem.argument_size_in_bytes / GIB,
            "temp_gib": mem.temp_size_in_bytes / GIB, "collectives": found,
            "collective_ops": sum(found.values())}


def unet_call(pipe, rows: int, height: int, width: int, shallow: bool = False):
    """Compile one UNet call on ``rows`` rows (the batch, twice over with CFG) at this size:
    the body of every program's denoising loop. XLA's cost analysis counts a loop's body once,
    whatever its trip count, so a program's cost is its own plus ``calls - 1`` of these.
    ``shallow``: DeepCache's shallow branch on cached deep features instead (the steps between
    full ones with ``deepcache_interval``). Records like any program (:func:`recording`)."""

    from maxdiff.family import Cond
    from pipelines import program as program_lib

    f = pipe.vae_scale_factor
    unet, cfg, family = pipe.unet, pipe.unet.config, pipe.family
    rows_on = meshlib.batch_sharded(pipe.mesh)
    dtype = jax.tree.leaves(pipe.params["unet"])[0].dtype
    # the pooled embedding: the last text encoder's projection, where the family takes one
    pooled = getattr(pipe, family.encoders[-1]).config.projection_dim if family.pooled else 0

    def arg(*shape, dt=dtype):
        return jax.ShapeDtypeStruct(shape, dt, sharding=rows_on)

    def call(p, x, t, cond, *feats):
        if shallow:
            return family.denoise(unet, p, cond, x, t, deep_cache=feats[0],
                                  return_deep_cache=True)[0]
        return family.denoise(unet, p, cond, x, t)

    cond = Cond(arg(rows, 77, cfg.cross_attention_dim), arg(rows, pooled),
                arg(rows, family.n_time_ids, dt="float32"))
    args = [pipe.params["unet"], arg(rows, height // f, width // f, cfg.in_channels,
                                     dt="float32"), arg(rows, dt="float32"), cond]
    if shallow:  # the deep features' shape, from the full call that caches them
        feats = jax.eval_shape(lambda p, x, t, c: family.denoise(unet, p, c, x, t,
                                                                 return_deep_cache=True)[1],
                               *args)
        args.append(arg(*feats.shape, dt=feats.dtype))
    return program_lib.jit(pipe.mesh, call)(*args)


def vae_call(pipe, height: int, width: int):
    """Compile the decode as every accelerator program runs it (:func:`pipelines.program.decode`:
    each chip decodes its images one at a time in a loop) on two images a chip: XLA's cost
    analysis counts the loop's body once, so what it reports is one image's decode, in the
    context the programs give it (compiled alone, outside that loop, the compiler lays the
    decoder out differently: 85 against 32 GB touching HBM at 1024² on v5e). A program's cost
    is its own plus ``images per chip - 1`` of these. Records like any program
    (:func:`recording`)."""
    import jax

    from pipelines import program as program_lib

    f = pipe.vae_scale_factor
    # float32 latents, as the denoising loop hands them to the decoder
    z = jax.ShapeDtypeStruct((2 * pipe.mesh.size, height // f, width // f,
                              pipe.vae.config.latent_channels),
                             "float32", sharding=meshlib.batch_sharded(pipe.mesh))

    def call(p, z):
        return program_lib.decode(pipe.vae, p, z)

    return program_lib.jit(pipe.mesh, call)(pipe.params["vae"], z)
