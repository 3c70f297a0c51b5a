"""What the served programs cost on TPUs, from the TPU compiler on this CPU machine (no chip).

    python -m benchmarks.tpu_report --topology v5e:2x2 v5e:2x4 --program lightning \\
        --batch-per-chip 1 2 8 --out docs/results/tpu-2026-12-05

For each topology, program and per-chip batch: the whole program (text encoders, every
denoising step, VAE decode) compiled for the topology's chips through ``libtpu`` with the
model's configs only (:mod:`pipelines.aot`), then one UNet call compiled alone and the decode
loop as the programs run it (XLA's cost analysis counts a loop's body once: a program is priced
as ``calls`` UNet calls, ``images per chip`` decodes and the rest, :func:`compose`). Per chip:
compiled or the compiler's error, HBM needed against the chip's, flops and bytes per image
(Pallas kernels' added analytically; bytes by XLA's count, every memory level, and the part
that touches HBM: :func:`pipelines.aot.memory_traffic`), flops per byte against the chip's
ridge, the roofline time on the chip's published peaks, images/s per chip, and the collectives
in the compiled HLO. These are the compiler's estimates, never measurements.

Programs: ``lightning`` (SDXL-Lightning 4 steps, Euler trailing, no CFG: MaxDiffusion's
published workload), ``base`` (20 Euler steps, CFG 8: MLPerf's SDXL setting). The other served
tasks at the base setting, whole program only (HBM per chip and collectives, as
``--fit-only``): ``img2img`` (strength 0.75), ``inpaint`` (a 4-channel UNet, strength 0.9999),
``controlnet`` (one ControlNet made from the UNet's config as diffusers' ``from_unet`` makes
the released ones), ``refiner`` (base + the SDXL refiner's shipped configs from 0.8 of the
schedule: diffusers' ensemble of experts, one program) and ``step`` (the step engine's
programs, one slot per image: the row holds the largest one's HBM and every program's
collectives). ``--parts-only`` prices ``base`` or ``lightning`` from one UNet call and one
decode compiled alone, without the whole program (half the compile time; no HBM fit). A
full-size SDXL compile takes minutes on two cores; ``--config`` (and ``--refiner-config``)
takes any diffusers folder of configs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

PROGRAMS = {
    # name: (scheduler preset or None for the model's own, steps, guidance)
    "lightning": ("lightning-4step", 4, 0.0),
    "base": (None, 20, 8.0),
}
TASKS = ("img2img", "inpaint", "controlnet", "refiner", "step")  # the base setting, fit only
# SDXL at 1024² (docs: design notes): UNet forward, VAE decode, both CLIP encoders, TFLOP
SDXL_1024_TFLOP = {"unet": 6.75, "vae": 10.5, "clip": 0.11}


def analytic_tflop(program: str, size: int, config: str, text: bool = True) -> float | None:
    """SDXL's analytic work per image at 1024² (None elsewhere): the yardstick the compiler's
    count is held to. ``text=False``: without the text encoders (what ``--parts-only`` prices)."""
    if config != "sdxl-base" or size != 1024:
        return None
    _, steps, guidance = PROGRAMS[program]
    rows = 2 if guidance > 1 else 1
    t = SDXL_1024_TFLOP
    return steps * rows * t["unet"] + t["vae"] + (rows * t["clip"] if text else 0.0)


def parts_as_whole(unet: dict, vae: dict) -> tuple[dict, dict]:
    """``--parts-only``: :func:`compose`'s ``whole`` and ``loops`` from the two parts compiled
    alone, with nothing else (no text encoders or glue: SDXL's are 0.1 % of its flops) and each
    part's HBM traffic as compiled alone (more than in the program's loops: the decode 85
    against 32 GB, the UNet call 16 against 10, so the estimate errs low)."""
    whole = {k: unet[k] + vae[k] for k in ("tflop", "gbytes", "kernel_gbytes")}
    loops = {"unet": sum(unet["hbm_gbytes_by_loop"].values()),
             "vae": sum(vae["hbm_gbytes_by_loop"].values()), "entry": 0.0}
    return whole, loops


def compose(whole: dict, unet: dict, vae: dict, loops: dict, *, calls: int, per_chip: int,
            chip) -> dict:
    """A program's figures per image from its compiled parts (:func:`pipelines.aot.analyse`
    of the whole program, one UNet call on its rows, one image's decode as the program runs
    it) and ``loops``, the whole program's HBM traffic per loop in GB (``"unet"``, ``"vae"``,
    ``"entry"``: :func:`pipelines.aot.loop_traffic`). XLA counts a loop's body once, so the
    program is ``calls`` UNet calls, ``per_chip`` decodes and the rest (text encoders, glue:
    the whole less one of each). Flops come from the parts (they do not depend on layout);
    bytes two ways: XLA's count (every memory level) of the parts compiled alone, and
    (``hbm_`` keys) the bytes that touch HBM in the loops as the whole program runs them, plus
    the Pallas kernels' own. Its time is the sum of each part's roofline (a compute-bound UNet
    does not hide a memory-bound decode)."""
    def rest(key):
        return max(whole[key] - unet[key] - vae[key], 0.0)

    hbm = {"unet": loops["unet"] + unet["kernel_gbytes"], "vae": loops["vae"] + vae["kernel_gbytes"],
           "rest": loops["entry"] + rest("kernel_gbytes")}
    parts = [({"tflop": unet["tflop"], "gbytes": unet["gbytes"], "hbm_gbytes": hbm["unet"]}, calls),
             ({"tflop": vae["tflop"], "gbytes": vae["gbytes"], "hbm_gbytes": hbm["vae"]}, per_chip),
             ({"tflop": rest("tflop"), "gbytes": rest("gbytes"), "hbm_gbytes": hbm["rest"]}, 1)]

    def times(part, key):  # (compute seconds, memory seconds)
        return part["tflop"] * 1e12 / chip.flops, part[key] * 1e9 / chip.hbm_bytes_per_s

    tflop = sum(n * p["tflop"] for p, n in parts)
    out = {"tflop_per_image": tflop / per_chip, "ridge": chip.ridge}
    for name, (p, n) in zip(("unet_call", "vae_decode", "rest"), parts):
        out[name] = {**p, "times": n,
                     "flops_per_byte": p["tflop"] * 1e3 / p["gbytes"] if p["gbytes"] else None,
                     "hbm_flops_per_byte": (p["tflop"] * 1e3 / p["hbm_gbytes"]
                                            if p["hbm_gbytes"] else None)}
    for pre, key in (("", "gbytes"), ("hbm_", "hbm_gbytes")):
        nbytes = sum(n * p[key] for p, n in parts)
        spent = [(n * max(times(p, key)), times(p, key)) for p, n in parts]
        total_s = sum(t for t, _ in spent)
        compute_s, memory_s = max(spent)[1]  # the part that takes the most time sets the bound
        out.update({
            pre + "gbytes_per_image": nbytes / per_chip,
            pre + "flops_per_byte": tflop * 1e3 / nbytes,
            pre + "bound": "compute" if compute_s >= memory_s else "memory",
            pre + "roofline_s": total_s,
            pre + "images_per_s_per_chip": per_chip / total_s})
        for name, (p, _) in zip(("unet_call", "vae_decode", "rest"), parts):
            c, m = times(p, key)
            out[name][pre + "bound"] = "compute" if c >= m else "memory"
            out[name][pre + "roofline_s"] = max(c, m)
    return out


def loops_gb(whole: dict) -> dict:
    """The whole program's HBM traffic per loop, GB, from its :func:`pipelines.aot.analyse`:
    ``"unet"`` (the denoising loop's body), ``"vae"`` (the decode loop's), ``"entry"``."""
    t = whole["hbm_gbytes_by_loop"]
    return {"unet": t["UNet2DConditionModel"], "vae": t["AutoencoderKL"], "entry": t["entry"]}


def _save_hlo(hlo_dir: Path | None, name: str, entry: dict) -> None:
    if hlo_dir is not None:
        import gzip

        hlo_dir.mkdir(parents=True, exist_ok=True)
        with gzip.open(hlo_dir / f"{name}.hlo.txt.gz", "wt", encoding="utf-8") as f:
            f.write(entry["compiled"].as_text())


def _controlnet_folder(folder: Path) -> Path:
    """A config-only ControlNet folder beside the model's: the UNet's encoder fields, as
    diffusers' ``ControlNetModel.from_unet`` copies them, and its default conditioning
    encoder (16, 32, 96, 256 channels: 8x for SDXL's VAE), cut to the VAE's scale factor."""
    from maxdiff.models.unet import EncoderConfig

    unet = json.loads((folder / "unet" / "config.json").read_text())
    vae = json.loads((folder / "vae" / "config.json").read_text())
    keep = {f.name for f in dataclasses.fields(EncoderConfig)}
    out = folder.parent / "controlnet"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps(
        {"_class_name": "ControlNetModel", **{k: v for k, v in unet.items() if k in keep},
         "conditioning_embedding_out_channels": [16, 32, 96, 256][
             :len(vae.get("block_out_channels", [0] * 4))]}))
    return out


def run_task(pipe, program: str, n: int, size: int, folder: Path) -> None:
    """Call the pipeline of ``program`` (one of :data:`TASKS`) on ``n`` images at the base
    setting, so that its programs compile (inside :func:`pipelines.aot.recording`)."""
    import numpy as np

    from maxdiff import checkpoint

    _, steps, guidance = PROGRAMS["base"]
    kw = dict(num_inference_steps=steps, guidance_scale=guidance, seed=0)
    prompts = ["a photo of a cat"] * n
    image = np.zeros((size, size, 3), np.float32)
    if program == "img2img":
        from pipelines import ImageToImagePipeline

        ImageToImagePipeline.from_pipe(pipe)(prompts, image=image, strength=0.75, **kw)
    elif program == "inpaint":
        from pipelines import InpaintPipeline

        InpaintPipeline.from_pipe(pipe)(prompts, image=image,
                                        mask_image=np.zeros((size, size), np.float32), **kw)
    elif program == "controlnet":
        from pipelines import ControlNetPipeline

        with checkpoint.shapes_only():
            cn = ControlNetPipeline.from_pipe(pipe, controlnet=_controlnet_folder(folder))
        cn(prompts, image=image, height=size, width=size, **kw)
    elif program == "refiner":  # the base's text-to-image with the refiner attached at load
        pipe(prompts, height=size, width=size, **kw)
    elif program == "step":
        from pipelines.step_engine import StepEngine

        StepEngine(pipe, size, size, slots=n, cfg=True, max_steps=steps).warmup()
    else:
        raise ValueError(f"program {program!r}: one of {', '.join(TASKS)}")


def one_task(folder: Path, topology: str, program: str, per_chip: int, size: int, dtype: str,
             config: str, log, hlo_dir: Path | None = None,
             refiner: tuple[str, Path] | None = None) -> dict:
    """A :data:`TASKS` program's row: every program it compiled, HBM of the largest against
    the chip's, the collectives of all. ``refiner``: (its config's name, its folder)."""
    from pipelines import aot

    _, steps, guidance = PROGRAMS["base"]
    row = {"topology": topology, "program": program, "batch_per_chip": per_chip, "size": size,
           "dtype": dtype, "steps": steps, "guidance": guidance, "config": config}
    t0 = time.perf_counter()
    extra = {}
    if program == "refiner":
        if refiner is None:
            raise ValueError("program 'refiner' needs the refiner's config folder")
        row["refiner_config"] = refiner[0]
        extra["refiner"] = refiner[1]
    pipe = aot.load(folder, topology, dtype, **extra)
    chip = aot.chip_of(pipe.mesh)
    n = per_chip * pipe.mesh.size
    row.update(chip=chip.name, chips=pipe.mesh.size, images=n)
    with aot.recording() as rec:
        run_task(pipe, program, n, size, folder)
    row["compile_whole_s"] = time.perf_counter() - t0
    log(f"  {len(rec)} program(s) compiled in {row['compile_whole_s']:.0f} s")
    name = f"{topology.replace(':', '-')}-{program}-{size}-{per_chip}"
    for i, entry in enumerate(rec):
        _save_hlo(hlo_dir, f"{name}-{i}", entry)
    each = [aot.fit(entry, chip) for entry in rec]
    w = max(each, key=lambda a: a["hbm_gib"])
    ops: dict = {}
    for a in each:
        for op, k in a["collectives"].items():
            ops[op] = ops.get(op, 0) + k
    # the largest program's fit; whether all fit and the collectives of all
    row.update(compiled=True, fit_only=True, programs=len(rec), **{
        **fitted(w), "fits": all(a["fits"] for a in each), "collectives": ops,
        "collective_ops": sum(ops.values())})
    return row


def one(folder: Path, topology: str, program: str, per_chip: int, size: int, dtype: str,
        config: str, log, fit_only: bool = False, hlo_dir: Path | None = None,
        parts_only: bool = False, refiner: tuple[str, Path] | None = None) -> dict:
    from pipelines import aot

    if program in TASKS:
        return one_task(folder, topology, program, per_chip, size, dtype, config, log, hlo_dir,
                        refiner)
    preset, steps, guidance = PROGRAMS[program]
    row = {"topology": topology, "program": program, "batch_per_chip": per_chip, "size": size,
           "dtype": dtype, "steps": steps, "guidance": guidance, "config": config}
    t0 = time.perf_counter()
    pipe = aot.load(folder, topology, dtype, **({"scheduler": preset} if preset else {}))
    chip = aot.chip_of(pipe.mesh)
    chips = pipe.mesh.size
    n = per_chip * chips
    row.update(chip=chip.name, chips=chips, images=n)
    name = f"{topology.replace(':', '-')}-{program}-{size}-{per_chip}"
    if not parts_only:
        with aot.recording() as whole:
            pipe(["a photo of a cat"] * n, num_inference_steps=steps, guidance_scale=guidance,
                 height=size, width=size, seed=0)
        row["compile_whole_s"] = time.perf_counter() - t0
        log(f"  whole program compiled in {row['compile_whole_s']:.0f} s")
        _save_hlo(hlo_dir, name + "-whole", whole[-1])
    if fit_only:  # memory and collectives only: no second compile for the per-step cost
        row.update(compiled=True, fit_only=True, **fitted(aot.analyse(whole[-1], chip, per_chip)))
        return row
    t1 = time.perf_counter()
    cfg = guidance > 1
    with aot.recording() as unet:
        aot.unet_call(pipe, n * (2 if cfg else 1), size, size)
    row["compile_unet_s"] = time.perf_counter() - t1
    log(f"  one UNet call compiled in {row['compile_unet_s']:.0f} s")
    _save_hlo(hlo_dir, name + "-unet", unet[-1])
    t2 = time.perf_counter()
    with aot.recording() as vae:
        aot.vae_call(pipe, size, size)
    row["compile_vae_s"] = time.perf_counter() - t2
    log(f"  one image's VAE decode compiled in {row['compile_vae_s']:.0f} s")
    _save_hlo(hlo_dir, name + "-vae", vae[-1])
    row.update(priced(None if parts_only else aot.analyse(whole[-1], chip, per_chip),
                      aot.analyse(unet[-1], chip, per_chip), aot.analyse(vae[-1], chip, 1),
                      chip, program=program, size=size, config=config, per_chip=per_chip,
                      chips=chips))
    return row


def fitted(whole: dict) -> dict:
    """A row's fit figures from the whole program's :func:`pipelines.aot.analyse`."""
    return dict(hbm_gib=whole["hbm_gib"], hbm_fraction=whole["hbm_fraction"], fits=whole["fits"],
                weights_gib=whole["arguments_gib"], temp_gib=whole["temp_gib"],
                collectives=whole["collectives"], collective_ops=whole["collective_ops"])


def priced(whole: dict | None, unet: dict, vae: dict, chip, *, program: str, size: int,
           config: str, per_chip: int, chips: int) -> dict:
    """A row's figures from the analysed programs (:func:`pipelines.aot.analyse`): the whole
    program (its HBM fit and collectives; ``None``: ``--parts-only``), one UNet call and one
    image's decode, priced by :func:`compose` for ``per_chip`` images a chip on ``chips``."""
    _, steps, _ = PROGRAMS[program]
    if whole is None:  # neither the program's HBM nor its own collectives are known
        whole, loops = parts_as_whole(unet, vae)
        out = dict(parts_only=True, collective_ops=unet["collective_ops"]
                   + vae["collective_ops"], parts_hbm_gib=max(unet["hbm_gib"], vae["hbm_gib"]))
    else:
        loops, out = loops_gb(whole), fitted(whole)
    out.update(
        compiled=True, unet_collective_ops=unet["collective_ops"],
        **compose(whole, unet, vae, loops, calls=steps, per_chip=per_chip,
                  chip=chip),  # Euler: one UNet call a step
        analytic_tflop_per_image=analytic_tflop(program, size, config,
                                                text=not out.get("parts_only")))
    out["images_per_s"] = out["images_per_s_per_chip"] * chips
    if out["analytic_tflop_per_image"]:
        out["tflop_vs_analytic"] = out["tflop_per_image"] / out["analytic_tflop_per_image"]
    return out


def _both(row: dict, key: str, spec: str) -> str:
    """A figure by XLA's count of bytes, then by the bytes that touch HBM (``hbm_`` key)."""
    return f"{format(row[key], spec)} / {format(row['hbm_' + key], spec)}"


def table(rows: list[dict]) -> str:
    """report.jsonl rows as the markdown table docs/performance.md publishes: each figure with
    XLA's count of bytes (every memory level) and, after the slash, the bytes that touch HBM."""
    out = ["| chips | program, per-chip batch | HBM / chip | TFLOP / image (vs analytic) "
           "| GB / image: all levels / HBM | flops / byte (ridge) | bound "
           "| roofline images/s per chip | collectives |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        head = (f"| {r['topology']} ({r.get('chips', '?')} {r.get('chip', '')}) | {r['program']} "
                f"{r['size']}², {r['batch_per_chip']}")
        if not r.get("compiled"):
            out.append(f"{head} | did not compile: {r['error'][:80]} | | | | | | |")
            continue
        hbm = ("(parts only)" if r.get("parts_only")
               else f"{r['hbm_gib']:.1f} GiB ({r['hbm_fraction']:.0%})")
        if r.get("fit_only"):
            out.append(f"{head} | {hbm} | (fit only) | | | | | {r['collective_ops']} |")
            continue
        vs = (f" ({r['tflop_vs_analytic']:.2f}x)" if r.get("tflop_vs_analytic") else "")
        if "hbm_gbytes_per_image" in r:
            gb = _both(r, "gbytes_per_image", ".0f")
            fpb = _both(r, "flops_per_byte", ".0f")
            bound = f"{r['bound']} / {r['hbm_bound']}"
            ips = _both(r, "images_per_s_per_chip", ".2f")
        else:  # rows written before the HBM count existed
            gb, fpb = f"{r['gbytes_per_image']:.0f}", f"{r['flops_per_byte']:.0f}"
            bound, ips = r["bound"], f"{r['images_per_s_per_chip']:.2f}"
        out.append(f"{head} | {hbm} | {r['tflop_per_image']:.1f}{vs} | {gb} | {fpb} "
                   f"({r['ridge']:.0f}) | {bound} | {ips} | {r['collective_ops']} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", nargs="+", default=["v5e:2x2"],
                    help="TPU topologies (v5e:2x2, v5e:2x4, v6e:2x2, v5p:2x2x1, ...)")
    ap.add_argument("--program", nargs="+", default=["lightning"],
                    choices=sorted(PROGRAMS) + list(TASKS))
    ap.add_argument("--batch-per-chip", nargs="+", type=int, default=[2])
    ap.add_argument("--size", type=int, default=1024, help="image side in pixels")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--config", default="sdxl-base",
                    help="a shipped config name (maxdiff/assets/configs) or a diffusers folder")
    ap.add_argument("--refiner-config", default="sdxl-refiner",
                    help="the refiner program's refiner: a shipped config name or a folder")
    ap.add_argument("--out", type=Path, default=Path("out/tpu_report"),
                    help="folder for report.jsonl (one line per result) and report.log")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--fit-only", action="store_true",
                    help="compile the whole program only: HBM and collectives, no cost")
    only.add_argument("--parts-only", action="store_true",
                    help="price one UNet call and one decode compiled alone, without the "
                         "whole program (no HBM fit; the text encoders left out; each part's "
                         "bytes as compiled alone)")
    ap.add_argument("--hlo-dir", type=Path, default=None,
                    help="also write each compiled program's HLO text here (gzip)")
    ap.add_argument("--table", action="store_true",
                    help="print --out's report.jsonl as a markdown table and exit")
    args = ap.parse_args(argv)
    if args.table:
        lines = (args.out / "report.jsonl").read_text().splitlines()
        print(table([json.loads(line) for line in lines if line.strip()]))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = open(args.out / "report.log", "a", encoding="utf-8")

    def log(msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    from pipelines import aot

    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = aot.model_folder(args.config, Path(tmp) / "model")
        refiner = (args.refiner_config, aot.model_folder(args.refiner_config, Path(tmp) / "refiner")
                   ) if "refiner" in args.program else None
        for topology in args.topology:
            for program in args.program:
                for per_chip in args.batch_per_chip:
                    log(f"{topology} {program} {args.size}² {per_chip}/chip {args.dtype}")
                    try:
                        row = one(folder, topology, program, per_chip, args.size, args.dtype,
                                  args.config, log, args.fit_only, args.hlo_dir,
                                  args.parts_only, refiner)
                    except Exception as e:  # the compiler's error is a result too
                        failed += 1
                        row = {"topology": topology, "program": program,
                               "batch_per_chip": per_chip, "size": args.size, "compiled": False,
                               "error": f"{type(e).__name__}: {e}"[:4000]}
                        log(traceback.format_exc())
                    with open(args.out / "report.jsonl", "a", encoding="utf-8") as f:
                        f.write(json.dumps(row, sort_keys=True) + "\n")
                    if row.get("fit_only"):
                        log(f"  HBM {row['hbm_gib']:.2f} GiB/chip ({row['hbm_fraction']:.0%}), "
                            f"temp {row['temp_gib']:.2f} GiB, collectives "
                            f"{row['collective_ops']}")
                    elif row.get("compiled"):
                        log((f"  parts only (largest part {row['parts_hbm_gib']:.2f} GiB/chip), "
                             if row.get("parts_only") else
                             f"  HBM {row['hbm_gib']:.2f} GiB/chip ({row['hbm_fraction']:.0%}), ")
                            + f"{row['tflop_per_image']:.2f} TFLOP and "
                            f"{row['gbytes_per_image']:.1f} GB per image "
                            f"({row['hbm_gbytes_per_image']:.1f} touching HBM), "
                            f"{row['flops_per_byte']:.0f} / {row['hbm_flops_per_byte']:.0f} "
                            f"flops/byte (ridge {row['ridge']:.0f}: {row['bound']} / "
                            f"{row['hbm_bound']}-bound), {row['images_per_s_per_chip']:.2f} / "
                            f"{row['hbm_images_per_s_per_chip']:.2f} images/s/chip, "
                            f"collectives {row['collective_ops']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
