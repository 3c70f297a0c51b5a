"""Image-to-image and inpainting: start from an image's latents noised to the strength's start
step (diffusers' ``StableDiffusionXLImg2ImgPipeline`` / ``StableDiffusionXLInpaintPipeline``).

Rows: ``images`` (pixels in [-1, 1], the tiled encoder's moments, or latents to start from),
``masks`` and ``masked_images`` (inpainting), the noises ``noise`` (add-noise),
``post_noise`` / ``masked_post_noise`` (the VAE posterior's standard normal draws; None: drawn
from the image's keys). Scalars: ``t_start`` (the first model call) and ``pure_noise``
(inpainting at strength 1 starts from noise). Key: (mode, from_latents, noised): ``"img2img"``,
``"inpaint4"`` (the unmasked latents are reset to the noised image after every step) or
``"inpaint9"`` (mask and masked-image latents are extra UNet channels); ``from_latents``: the
images are latents (a base's output); ``noised``: they get the start step's noise (False:
``denoising_start``).
"""

from __future__ import annotations

import jax.numpy as jnp

from pipelines import program as program_lib
from pipelines.runner import Ctx, Task

__all__ = ["EDIT"]


class Edit(Task):
    name = "edit"
    n_keys = 4  # add-noise noise, posterior draw, masked image's posterior draw, step noise
    adapters = False
    steps_in_slots = False  # the step engine runs text-to-image and ControlNet images

    @staticmethod
    def _to_latents(ctx: Ctx, images, eps):
        vae = ctx.pipe.vae
        method = vae.moments_to_latents if ctx.static.out == "unscaled" else vae.image_to_latents
        return vae.apply({"params": ctx.params["vae"]}, images, None, eps, method=method)

    def _draw(self, ctx: Ctx, name: str, key):
        given = ctx.rows.get(name)
        return program_lib.normal(key, ctx.shape) if given is None else given

    def begin(self, ctx: Ctx):
        mode, from_latents, noised = ctx.static.key
        sched, rows, state = ctx.scheduler, ctx.rows, ctx.state
        k_noise, k_post = ctx.keys[:2]
        noise = self._draw(ctx, "noise", k_noise)
        image_latents = rows["images"] if from_latents else self._to_latents(
            ctx, rows["images"], self._draw(ctx, "post_noise", k_post))
        t_start = ctx.scalars["t_start"]
        latents = (sched.add_noise(state, image_latents, noise, t_start) if noised
                   else image_latents)
        if mode != "img2img":  # diffusers' inpainting starts from pure noise at strength 1
            latents = jnp.where(ctx.scalars["pure_noise"],
                                noise * sched.init_noise_sigma(state), latents)
        ctx.memo.update(image_latents=image_latents, noise=noise)
        return latents, t_start

    def extra(self, ctx: Ctx):
        if ctx.static.key[0] != "inpaint9":
            return None
        masked = self._to_latents(ctx, ctx.rows["masked_images"],
                                  self._draw(ctx, "masked_post_noise", ctx.keys[2]))
        return jnp.concatenate([ctx.rows["masks"], masked], axis=-1)

    def after_step(self, ctx: Ctx):
        if ctx.static.key[0] != "inpaint4":
            return None
        sched, masks = ctx.scheduler, ctx.rows["masks"]
        image_latents, noise = ctx.memo["image_latents"], ctx.memo["noise"]
        calls = ctx.state.timesteps.shape[0]

        def keep_unmasked(i, state, x):  # the image, noised to the next step's level
            nxt = jnp.minimum(i + 1, calls - 1)
            proper = jnp.where(i < calls - 1, sched.add_noise(state, image_latents, noise, nxt),
                               image_latents)
            return (1 - masks) * proper + masks * x
        return keep_unmasked

    def encode_tiled(self, job, rows: dict) -> dict:
        """Images (and masked images) of a tiled size become the tiled encoder's moments
        before the program (diffusers' tiled encode)."""
        _, from_latents, _ = job.key
        out = dict(rows)
        for name in ("images", "masked_images"):
            if out.get(name) is not None and not (name == "images" and from_latents):
                out[name] = job.pipe.encode_tiled(out[name])
        return out


EDIT = Edit()
