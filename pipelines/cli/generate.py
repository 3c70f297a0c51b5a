"""``maxdiff generate``: validate every prompt line before loading anything, group images
by shape so each compiled program is reused, fill device batches across prompts, write each
image atomically with a ``metadata.jsonl`` line; rerunning the same command resumes
(:mod:`pipelines.cli.prompts`, :mod:`pipelines.cli.jobs`,
:mod:`pipelines.cli.output`)."""

from __future__ import annotations

import secrets
import sys
import time
from pathlib import Path

from pipelines.cli.common import _log, _run_config, _step_limit, _usage_errors, _vae_factor
from pipelines.cli.jobs import RunSettings, plan_jobs
from pipelines.cli.lines import InputError, check_size
from pipelines.cli.output import METADATA, OutputDir
from pipelines.cli.prompts import read_prompts
from pipelines.limits import (
    MAX_SEED,
    steps_problem,
)
from pipelines.requests import pad_to, plan_batches


def _pipelines(pipe, jobs):
    """The pipelines the jobs need (:class:`pipelines.dispatch.Pipelines`), with every
    ControlNet the ControlNet jobs use loaded once (its arrays shared by the sets); a
    ControlNet that cannot be loaded, or is made for another model, is exit status 2."""
    from pipelines.dispatch import Pipelines

    paths = dict.fromkeys(c.controlnet for j in jobs for c in j.line.controls or ())
    loaded = {}
    if paths:
        from pipelines.controlnet import ControlNetPipeline

        for path in paths:
            try:
                one = ControlNetPipeline.from_pipe(pipe, controlnet=path)  # checks it fits
            except (ValueError, OSError) as e:
                raise InputError([f"ControlNet {path}: {e} (--control-image / --controlnet / "
                                  "control_images)"]) from None
            loaded[path] = (one.controlnets[0], one.controlnet_params[0])
    return Pipelines(pipe, loaded)


# ---------------------------------------------------------------------------------- generate
def cmd_generate(args) -> int:
    from tqdm import tqdm

    from maxdiff.checkpoint import resolve_dtype
    from pipelines.text_to_image import TextToImagePipeline

    with _usage_errors():
        errors, cfg = [], None  # gather config, model and prompt problems into one report
        size = dict(width=args.size[0], height=args.size[1]) if args.size else {}
        try:
            with _usage_errors():
                cfg = _run_config(args, steps=args.steps, guidance=args.guidance, **size)
        except InputError as e:
            errors += e.errors
        factor = _vae_factor(Path(cfg.model)) if cfg else None
        if cfg and cfg.width is not None and cfg.height is not None:
            try:
                check_size((cfg.width, cfg.height), factor)
            except ValueError as e:
                errors.append(f"{'--size' if args.size else 'config size'}: {e}")
        steps_limit = _step_limit(cfg) if cfg else None
        if steps_limit and cfg.steps is not None and (p := steps_problem(
                cfg.steps, steps_limit[0], f"what {steps_limit[1]} allows")) is not None:
            errors.append(f"{'--steps' if args.steps else 'config steps'}: {p.message}, got "
                          f"{cfg.steps}")
        try:
            lines = read_prompts(args.prompt, args.prompts, factor=factor,
                                 steps_limit=steps_limit, image=args.image, mask=args.mask,
                                 strength=args.strength, size=args.size,
                                 steps=cfg.steps if cfg else None,
                                 control_images=args.control_image, controlnets=args.controlnet,
                                 control_start=args.control_guidance_start,
                                 control_end=args.control_guidance_end,
                                 control_guess_mode=args.control_guess_mode,
                                 ip_adapter_image=args.ip_adapter_image)
        except InputError as e:
            errors += e.errors
        else:
            prompted = [line.where for line in lines if line.ip_adapter_image is not None]
            if prompted and cfg and cfg.ip_adapter is None:
                errors.append(f"{prompted[0]}: an image prompt (--ip-adapter-image / a line's "
                              "ip_adapter_image) needs an IP-Adapter: pass --ip-adapter FILE "
                              "(config key 'ip_adapter')")
            lone = [f for f in ("hires_strength", "hires_steps") if getattr(args, f) is not None]
            if lone and args.hires_scale is None and not any(ln.hires_scale for ln in lines):
                errors.append(f"--{lone[0].replace('_', '-')}: needs --hires-scale (or a "
                              "line's hires_scale): without it there is no hires fix")
        if errors:
            raise InputError(errors)
        out = OutputDir(args.out)
        out.prepare()
        records = out.records()
        if args.seed is not None:
            run_seed = args.seed
        elif records and isinstance(records[-1].get("run_seed"), int):
            run_seed = records[-1]["run_seed"]
            _log(f"resuming with run seed {run_seed} from {out.metadata} (--seed picks another)")
        else:
            run_seed = secrets.randbelow(MAX_SEED + 1)
            _log(f"run seed {run_seed} (pass --seed {run_seed} to reproduce this run)")
        t0 = time.perf_counter()
        pipe = TextToImagePipeline.from_config(cfg)
        scheduler = type(pipe.scheduler).__name__ + (f" ({cfg.scheduler})" if cfg.scheduler else "")
        settings = RunSettings(
            model=cfg.model, unet=cfg.unet, vae=cfg.vae, scheduler=scheduler,
            dtype=str(resolve_dtype(cfg.dtype)), steps=pipe.default_steps,
            quantization=None if cfg.quantization == "none" else cfg.quantization,
            guidance=float(pipe.default_guidance), width=pipe.default_width,
            height=pipe.default_height, run_seed=run_seed, negative_prompt=args.negative,
            num_images=args.num_images, format=args.format, prompt_syntax=args.prompt_syntax,
            cfg_cutoff=args.cfg_cutoff,
            deepcache_interval=1 if args.deepcache_interval is None else args.deepcache_interval,
            hires_scale=args.hires_scale, hires_strength=args.hires_strength,
            hires_steps=args.hires_steps,
            lora=", ".join(f"{x.path}:{x.scale:g}" for x in cfg.loras) or None,
            embeddings=", ".join(str(e) for e in cfg.embeddings) or None,
            refiner=f"{cfg.refiner}:{cfg.high_noise_frac:g}" if cfg.refiner else None,
            ip_adapter=(f"{cfg.ip_adapter}:{cfg.ip_adapter_scale:g}" if cfg.ip_adapter
                        else None))
        jobs = plan_jobs(lines, settings)
    done = out.done(records)
    todo = [j for j in jobs if j.id not in done]
    pipes = _pipelines(pipe, todo)
    _log(f"loaded {cfg.model} in {time.perf_counter() - t0:.1f}s on {pipe.mesh.size} device(s); "
         f"{len(lines)} prompt(s), {len(jobs)} image(s), {len(jobs) - len(todo)} already in "
         f"{out.path}, {len(todo)} to generate")

    bar = tqdm(total=len(todo), unit="img", file=sys.stderr, disable=args.quiet,
               dynamic_ncols=True, smoothing=0.1)
    t_start, shape, written = time.perf_counter(), None, 0
    try:
        for batch_shape, group, bucket in plan_batches(todo, lambda j: j.shape, args.batch_size,
                                                       pipe.mesh.size):
            if batch_shape != shape:
                shape = batch_shape
                desc = batch_shape.describe()
                bar.set_postfix_str(desc)
                if args.quiet:
                    n = sum(j.shape == shape for j in todo)
                    _log(f"{desc}: {n} image(s), device batch {bucket} (first batch compiles)")
            items = pad_to([j.request() for j in group], bucket)  # one program per group
            files: dict[str, object] = {}  # each control image file read once a batch
            extras = [j.batch_extra(files) for j in pad_to(group, bucket)]
            result = pipes.generate(batch_shape, items, extras)
            batch_s = result.timings["prepare_s"] + result.timings["generate_s"]
            seconds = round(batch_s / len(group), 4)
            for job, image in zip(group, result.images):
                out.write(job, image, seconds=seconds)
                written += 1
                bar.update(1)
    except BaseException:
        out.remove_temp_files()
        bar.close()
        _log(f"stopped after {written} new image(s); {len(jobs) - len(todo) + written} of "
             f"{len(jobs)} are in {out.path}. Rerun the same command to resume.")
        raise
    bar.close()
    took = time.perf_counter() - t_start
    rate = f", {len(todo) / took:.2f} img/s" if todo and took > 0 else ""
    _log(f"done: {len(todo)} new image(s) in {took:.1f}s{rate}; {len(jobs)} in {out.path} "
         f"(see {out.path / METADATA})")
    return 0
