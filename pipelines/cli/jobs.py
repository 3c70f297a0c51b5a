"""Planning ``maxdiff generate``'s images: one :class:`ImageJob` per image, with its seed and
identity.

A job's identity is everything that decides its pixels (line index, image index, prompt,
negative prompt, seed, steps, guidance, size, scheduler, model, dtype, feature caching
(``cfg_cutoff``, ``deepcache_interval``, where set), a hires fix; for an edit the image's
and mask's contents (SHA-256) and the strength; with ControlNets each control image's
contents, its ControlNet's folder, scale and window) plus the file format. Per-image seeds come
from a hash of (run seed, line index, image index), so adding, removing or reordering *later*
lines never changes an earlier image, and a run seed makes the run reproducible.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.cli.controls import load_control_image
from pipelines.cli.lines import InputError, PromptLine
from pipelines.cli.prompts import edit_strength, load_edit_inputs
from pipelines.conditioned_requests import ControlImage, ControlKey, EditKey, describe_controls
from pipelines.image_files import image_info
from pipelines.limits import (
    cfg_on,
    describe,
    hires_problems,
    prompt_text_problems,
    seed_problem,
    strength_problem,
)
from pipelines.requests import HiresFix, ImageRequest, ShapeKey, derive_seed, image_seeds


@dataclass(frozen=True)
class RunSettings:
    """Run-wide settings; a line's own fields override steps, guidance, size, negative, n."""

    model: str
    scheduler: str
    dtype: str
    steps: int
    guidance: float
    width: int | None
    height: int | None
    run_seed: int
    unet: str | None = None
    vae: str | None = None  # --vae: the VAE (or tiny autoencoder) replacing the model's
    negative_prompt: str | None = None
    num_images: int = 1
    format: str = "png"
    lora: str | None = None  # the fused LoRA adapters, "PATH:SCALE, ..." (None: none)
    quantization: str | None = None  # int8-weights, int8, fp8 (None: none)
    refiner: str | None = None  # "DIR:FRAC": the SDXL refiner and where it takes over
    prompt_syntax: str | None = None  # --prompt-syntax (None: a1111)
    embeddings: str | None = None  # the loaded textual-inversion embeddings, "PATH[:TOKEN], ..."
    ip_adapter: str | None = None  # the loaded IP-Adapter, "PATH:SCALE" (the default scale)
    cfg_cutoff: float | None = None  # --cfg-cutoff (None: guidance on every step)
    deepcache_interval: int = 1  # --deepcache-interval (1: no DeepCache)
    hires_scale: float | None = None  # --hires-scale (None: no hires fix but a line's)
    hires_strength: float | None = None  # --hires-strength (None: HiresFix's default)
    hires_steps: int | None = None  # --hires-steps (None: the first pass's steps)


@dataclass(frozen=True)
class ImageJob:
    """One image of a CLI run: what to make and where it goes."""

    line: PromptLine
    image: int  # index of the image within its line
    prompt: str
    negative_prompt: str | None
    seed: int
    steps: int
    guidance: float
    width: int
    height: int
    settings: RunSettings
    id: str  # hash of everything that decides the file's content
    file: str
    strength: float | None = None  # an edit's strength (None: text-to-image)
    prompt_syntax: str | None = None  # the line's, else the run's (None: a1111)
    scheduler: str | None = None  # the line's sampler (None: the run's --scheduler)
    cfg_cutoff: float | None = None  # feature caching: the line's, else the run's
    deepcache_interval: int = 1
    hires: HiresFix | None = None  # a hires fix: the line's fields over the run's

    @property
    def shape(self) -> ShapeKey | EditKey | ControlKey:
        """What selects the compiled program (and, for an edit, the strength; with
        ControlNets, which ones)."""
        if self.line.controls:
            return ControlKey(tuple(c.controlnet for c in self.line.controls), self.height,
                              self.width, self.steps, cfg_on(self.guidance))
        if self.line.image is not None:
            return EditKey("inpaint" if self.line.mask else "img2img", self.height, self.width,
                           self.steps, cfg_on(self.guidance), self.strength)
        return ShapeKey.of(self.height, self.width, self.steps, self.guidance, self.hires)

    def batch_extra(self, files: dict[str, Any]) -> Any:
        """What this job's kind adds in its device batch (as
        :meth:`pipelines.requests.GenerationRequest.batch_extra`), read from the line's files:
        None for text-to-image, (image, mask) for an edit, the line's ControlImages;
        ``files``: control image path -> image, each file read once a batch."""
        if self.line.controls:
            for c in self.line.controls:
                if c.image not in files:
                    files[c.image] = load_control_image(c.image)
            return [ControlImage(files[c.image], c.scale, c.start, c.end, c.guess_mode)
                    for c in self.line.controls]
        if self.line.image is not None:
            return load_edit_inputs(self.line.image, self.line.mask)
        return None

    def request(self) -> ImageRequest:
        image = None
        if self.line.ip_adapter_image is not None:
            from PIL import Image

            from pipelines.image_files import decode_image

            rgb, _ = decode_image(Path(self.line.ip_adapter_image).read_bytes(),
                                  "ip_adapter_image")
            image = Image.fromarray(rgb)
        return ImageRequest(prompt=self.prompt, negative_prompt=self.negative_prompt,
                            seed=self.seed, guidance_scale=self.guidance,
                            prompt_syntax=self.prompt_syntax, scheduler=self.scheduler,
                            ip_adapter_image=image, ip_adapter_scale=self.line.ip_adapter_scale,
                            cfg_cutoff=self.cfg_cutoff,
                            deepcache_interval=self.deepcache_interval)

    def identity(self) -> dict[str, Any]:
        return identity(self.line.index, self.image, self.prompt, self.negative_prompt, self.seed,
                        self.steps, self.guidance, self.width, self.height, self.settings,
                        self.prompt_syntax, self.scheduler, self.cfg_cutoff,
                        self.deepcache_interval, self.hires)

    def image_info(self) -> dict[str, str]:
        """The settings stored inside the image file (no time or path, so files reproduce)."""
        controlnet = describe_controls((c.controlnet, c.scale, c.start, c.end, c.guess_mode)
                                       for c in self.line.controls or ()) or None
        return image_info(**self.record(), controlnet=controlnet)

    def record(self, **extra: Any) -> dict[str, Any]:
        """This job's ``metadata.jsonl`` entry."""
        s = self.settings
        edit = {}
        if self.line.image is not None:
            edit = dict(mode=self.shape.kind, input_image=self.line.image,
                        mask=self.line.mask, strength=self.strength)
        if self.line.controls:
            edit = dict(mode="controlnet",
                        control_images=[c.record() for c in self.line.controls])
        return dict(line=self.line.index, image=self.image, source=self.line.where,
                    prompt=self.prompt, negative_prompt=self.negative_prompt, seed=self.seed,
                    run_seed=s.run_seed, steps=self.steps, guidance=self.guidance,
                    size=f"{self.width}x{self.height}", width=self.width, height=self.height,
                    scheduler=self.scheduler or s.scheduler, model=s.model, unet=s.unet,
                    **({"vae": s.vae} if s.vae else {}), lora=s.lora,
                    dtype=s.dtype, quantization=s.quantization, format=s.format,
                    prompt_syntax=self.prompt_syntax,
                    **({"refiner": s.refiner} if s.refiner else {}), **edit,
                    **_feature_cache(self.cfg_cutoff, self.deepcache_interval),
                    **_hires(self.hires), **_image_prompt(self.line, s),
                    file=self.file, id=self.id, **extra)


def identity(line: int, image: int, prompt: str, negative_prompt: str | None, seed: int,
             steps: int, guidance: float, width: int, height: int, s: RunSettings,
             prompt_syntax: str | None = None, scheduler: str | None = None,
             cfg_cutoff: float | None = None, deepcache_interval: int = 1,
             hires: HiresFix | None = None) -> dict:
    return dict(line=line, image=image, prompt=prompt, negative_prompt=negative_prompt, seed=seed,
                steps=steps, guidance=float(guidance), width=width, height=height,
                scheduler=s.scheduler, model=s.model, unet=s.unet, dtype=s.dtype, format=s.format,
                **({"vae": s.vae} if s.vae else {}),  # (ids of runs without one unchanged)
                **({"lora": s.lora} if s.lora else {}),  # (ids of runs without LoRA unchanged)
                **({"quantization": s.quantization} if s.quantization else {}),
                **({"refiner": s.refiner} if s.refiner else {}),
                **({"prompt_syntax": prompt_syntax} if prompt_syntax else {}),
                **({"embeddings": s.embeddings} if s.embeddings else {}),
                **({"sampler": scheduler} if scheduler else {}),
                **_feature_cache(cfg_cutoff, deepcache_interval), **_hires(hires))


def _hires(hires: HiresFix | None) -> dict:
    """A hires fix's settings (none: empty, so ids of runs without one are unchanged)."""
    if hires is None:
        return {}
    return {"hires_scale": hires.scale, "hires_strength": hires.strength,
            **({"hires_steps": hires.steps} if hires.steps is not None else {})}


def line_hires(line: PromptLine, s: RunSettings) -> HiresFix | None:
    """A line's hires fix: its own ``hires_*`` fields over the run's (None: off). InputError
    for an edit or ControlNet line that asks for one, or a strength that leaves no step."""
    def pick(name: str, default=None):
        mine, run = getattr(line, name), getattr(s, name)
        return mine if mine is not None else run if run is not None else default

    scale = pick("hires_scale")
    if scale is None:
        if line.hires_strength is not None or line.hires_steps is not None:
            raise InputError([f"{line.where}: fields 'hires_strength' and 'hires_steps' need "
                              "'hires_scale' (or --hires-scale): without it there is no hires "
                              "fix"])
        return None
    if line.image is not None or line.controls:
        raise InputError([f"{line.where}: a hires fix runs text-to-image lines; leave "
                          "hires_scale (--hires-scale) out of edits and ControlNet lines"])
    hires = HiresFix(float(scale), float(pick("hires_strength", HiresFix.strength)),
                     pick("hires_steps"))
    steps = line.steps if line.steps is not None else s.steps
    found = hires_problems(hires.scale, hires.strength, hires.steps, steps, None, None, 1)
    if found:
        raise InputError([f"{line.where}: {describe(p, 'jsonl')}" for p in found])
    return hires


def _feature_cache(cfg_cutoff: float | None, deepcache_interval: int) -> dict:
    """The feature-caching settings that are on (none: empty, so the ids and records of runs
    without them are what they were)."""
    return {**({"cfg_cutoff": cfg_cutoff} if cfg_cutoff is not None else {}),
            **({"deepcache_interval": deepcache_interval} if deepcache_interval != 1 else {})}


def _image_prompt(line: PromptLine, s: RunSettings, digest: bool = False) -> dict:
    """A line's image prompt (IP-Adapter) for its metadata, or with ``digest`` for its
    identity (the image's SHA-256 and the scale in force); empty without one."""
    if line.ip_adapter_image is None:
        return {}
    scale = line.ip_adapter_scale
    if scale is None and s.ip_adapter:
        scale = float(s.ip_adapter.rpartition(":")[2])
    image = _sha256(line.ip_adapter_image) if digest else line.ip_adapter_image
    return dict(ip_adapter=s.ip_adapter, ip_adapter_image=image, ip_adapter_scale=scale)


def _sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def job_id(ident: dict) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def slug(text: str, limit: int = 40) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return s[:limit].rstrip("-") or "image"


def plan_jobs(lines: list[PromptLine], s: RunSettings) -> list[ImageJob]:
    """One :class:`ImageJob` per image, in input order. File names
    ``{line:05d}-{image:02d}-{slug}-{id8}.{ext}`` sort in input order and never collide (a job
    with other settings gets another id, so it never overwrites a different image)."""
    counts = [line.n or s.num_images for line in lines]
    wl = max(5, len(str(len(lines) - 1)))
    wi = max(2, len(str(max(counts) - 1)))
    jobs = []
    for line, n in zip(lines, counts):
        w, h = line.size or (s.width, s.height)
        if w is None or h is None:
            raise InputError([f"{line.where}: no size: this model has no default size; "
                              "pass --size WIDTHxHEIGHT"])
        steps = line.steps if line.steps is not None else s.steps
        guidance = line.guidance if line.guidance is not None else s.guidance
        neg = line.negative_prompt if line.negative_prompt is not None else s.negative_prompt
        if (p := seed_problem(line.seed, n)) is not None:
            raise InputError([f"{line.where}: {describe(p, 'jsonl')}"])
        syntax = line.prompt_syntax or s.prompt_syntax
        found = prompt_text_problems(syntax, prompt=line.prompt, negative_prompt=neg)
        if found:
            raise InputError([f"{line.where}: {describe(p, 'jsonl')}" for p in found])
        if line.scheduler is not None and (line.image is not None or line.controls):
            raise InputError([f"{line.where}: field 'scheduler': a sampler per line runs "
                              "text-to-image lines; edits and ControlNet lines run the run's "
                              "--scheduler"])
        cutoff = line.cfg_cutoff if line.cfg_cutoff is not None else s.cfg_cutoff
        interval = (line.deepcache_interval if line.deepcache_interval is not None
                    else s.deepcache_interval)
        hires = line_hires(line, s)
        seeds = image_seeds(line.seed, n)
        strength, edit = None, {}
        if line.image is not None:
            strength = edit_strength(line)
            if (p := strength_problem(strength, steps)) is not None:
                raise InputError([f"{line.where}: {describe(p)}"])
            edit = dict(strength=strength, image_sha256=_sha256(line.image),
                        mask_sha256=line.mask and _sha256(line.mask))
        if line.controls:
            edit = dict(control_images=[{**c.record(), "image": _sha256(c.image)}
                                        for c in line.controls])
        if line.ip_adapter_image is not None:
            if s.ip_adapter is None:
                raise InputError([f"{line.where}: an image prompt (ip_adapter_image / "
                                  "--ip-adapter-image) needs an IP-Adapter: pass --ip-adapter "
                                  "FILE (config key 'ip_adapter')"])
            edit = {**edit, **_image_prompt(line, s, digest=True)}
        for k, seed in enumerate(seeds):
            if seed is None:
                seed = derive_seed(s.run_seed, line.index, k)
            jid = job_id({**identity(line.index, k, line.prompt, neg, seed, steps, guidance, w,
                                     h, s, syntax, line.scheduler, cutoff, interval, hires),
                          **edit})
            name = f"{line.index:0{wl}d}-{k:0{wi}d}-{slug(line.prompt)}-{jid[:8]}.{s.format}"
            jobs.append(ImageJob(line, k, line.prompt, neg, seed, steps, float(guidance), w, h, s,
                                 jid, name, strength, syntax, line.scheduler, cutoff,
                                 interval, hires))
    return jobs
