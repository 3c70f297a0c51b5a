"""The name of each request setting in each front door (:data:`DOORS`): the Python API's
keyword, the CLI's flag, a JSONL line's field, the native JSON routes' field and the OpenAI
routes' field (:data:`FIELDS`, :func:`field_name`). :mod:`pipelines.limits` says its problems in
these words. JAX-free.
"""

from __future__ import annotations

DOORS = ("python", "cli", "jsonl", "native", "openai")


def _everywhere(name: str) -> dict[str, str]:
    """A setting named ``name`` in every front door (the CLI's flag: ``--name-with-dashes``)."""
    return {"python": name, "cli": "--" + name.replace("_", "-"), "jsonl": name, "native": name,
            "openai": name}


FIELDS: dict[str, dict[str, str]] = {
    "steps": {"python": "num_inference_steps", "cli": "--steps", "jsonl": "steps",
              "native": "steps", "openai": "steps"},
    "guidance": {"python": "guidance_scale", "cli": "--guidance", "jsonl": "guidance",
                 "native": "guidance_scale", "openai": "guidance_scale"},
    "seed": _everywhere("seed"),
    "n": {"python": "num_images_per_prompt", "cli": "--num-images", "jsonl": "n",
          "native": "num_images", "openai": "n"},
    "strength": _everywhere("strength"),
    "width": {"python": "width", "cli": "--size", "jsonl": "size", "native": "width",
              "openai": "size"},
    "height": {"python": "height", "cli": "--size", "jsonl": "size", "native": "height",
               "openai": "size"},
    "prompt": {"python": "prompt", "cli": "prompt", "jsonl": "prompt", "native": "prompt",
               "openai": "prompt"},
    "prompt_syntax": _everywhere("prompt_syntax"),
    "negative_prompt": _everywhere("negative_prompt"),
    "adapter": {"python": "adapter", "cli": "--lora", "jsonl": "lora", "native": "lora",
                "openai": "model"},
    # ControlNet: in a JSONL line and a JSON body they are fields of one entry of
    # ``control_images`` (:func:`within` names the entry: ``control_images[1].scale``); on the
    # command line the scale is the SCALE of ``--control-image PATH[:MODEL[:SCALE]]``
    "control_scale": {"python": "controlnet_conditioning_scale", "cli": "--control-image",
                      "jsonl": "scale", "native": "scale"},
    "control_start": {"python": "control_guidance_start", "cli": "--control-guidance-start",
                      "jsonl": "start", "native": "start"},
    "control_end": {"python": "control_guidance_end", "cli": "--control-guidance-end",
                    "jsonl": "end", "native": "end"},
    "controlnet": {"python": "controlnet", "cli": "--control-image", "jsonl": "controlnet",
                   "native": "controlnet"},
    # IP-Adapter: an image as a prompt (a loaded adapter; the image and its scale per image)
    "ip_adapter_image": _everywhere("ip_adapter_image"),
    "ip_adapter_scale": _everywhere("ip_adapter_scale"),
    # the SDXL refiner (two-stage): the base stops at denoising_end, the refiner starts at
    # denoising_start (fractions of the schedule); the refiner's aesthetic-score time ids
    "denoising_end": {"python": "denoising_end", "cli": "--high-noise-frac"},
    "denoising_start": {"python": "denoising_start"},
    "aesthetic_score": {"python": "aesthetic_score", "cli": "--aesthetic-score"},
    # feature caching: classifier-free guidance for the first fraction of the steps only;
    # DeepCache (the UNet's deep features reused for N - 1 of every N steps)
    "cfg_cutoff": _everywhere("cfg_cutoff"),
    "deepcache_interval": _everywhere("deepcache_interval"),
    # hires fix: a first pass at size / hires_scale, upscaled, denoised again at hires_strength
    "hires_scale": _everywhere("hires_scale"),
    "hires_strength": _everywhere("hires_strength"),
    "hires_steps": _everywhere("hires_steps"),
    "negative_aesthetic_score": {"python": "negative_aesthetic_score",
                                 "cli": "--negative-aesthetic-score"},
}


def field_name(field: str, door: str) -> str:
    """``field``'s name in ``door`` (one of :data:`DOORS`); unknown fields keep their name."""
    return FIELDS.get(field, {}).get(door, field)
