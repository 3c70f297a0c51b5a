"""ControlNet text-to-image: the denoiser gets the residuals of one or several ControlNets
(diffusers' ``StableDiffusionXLControlNetPipeline`` / ``MultiControlNetModel``: summed).

Rows: ``latents`` (initial noise, or None), ``images`` (one (B, H, W, 3) control batch per
ControlNet), ``scales`` (B, K, calls: each image's scale for each ControlNet and model call,
``scale`` x :func:`control_keep`) and ``guess`` (B, K). Weights: the ControlNets'. With CFG the
unconditional rows of a guess-mode image get scale 0 (diffusers runs the ControlNet on the
conditional half only and adds zeros to the other: the same zeros).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pipelines import program as program_lib
from pipelines.conditioned_requests import ControlImage
from pipelines.images import image_pixels
from pipelines.runner import Ctx, Task

__all__ = ["CONTROLNET", "control_keep", "control_inputs", "control_residuals",
           "guided_controls"]


def control_keep(calls: int, start: float, end: float) -> np.ndarray:
    """diffusers' ``controlnet_keep`` for a run of ``calls`` model calls: float32 (calls,), 1
    where step i runs the ControlNet (``i / calls >= start`` and ``(i + 1) / calls <= end``),
    else 0. Computed on the host in float64, as diffusers does."""
    return np.array([1.0 - float(i / calls < start or (i + 1) / calls > end)
                     for i in range(calls)], np.float32)


def control_residuals(nets, cps, x, t, cond, images, scales, guess):
    """The UNet's additional residuals from ControlNets ``nets`` (weights ``cps``) for one
    model call on rows ``x`` at timesteps ``t`` with the text conditioning ``cond``
    (:class:`maxdiff.family.Cond`): ``images`` one (B, H, W, 3) control batch per ControlNet,
    ``scales`` (B, K) this call's scale of each row for each ControlNet (0 outside its window),
    ``guess`` (B, K). Summed over the ControlNets in order (diffusers'
    ``MultiControlNetModel``); a ControlNet whose scales are all 0 at this call is skipped
    (``lax.cond``), not run and multiplied by 0. Returns ``(down residuals, mid residual)``;
    what the ControlNet task and the step engine (:mod:`pipelines.step_engine`) both feed the
    UNet."""
    down = mid = None
    for k, net in enumerate(nets):
        def run(net=net, k=k):
            return net.apply({"params": cps[k]}, x, t, cond.context, images[k], scales[:, k],
                             text_embeds=cond.pooled, time_ids=cond.time_ids,
                             guess_mode=guess[:, k])

        shapes = jax.eval_shape(run)
        d, m = jax.lax.cond(jnp.any(scales[:, k] != 0), run, lambda shapes=shapes: jax.tree.map(
            lambda s: jnp.zeros(s.shape, s.dtype), shapes))
        down = d if down is None else tuple(a + b for a, b in zip(down, d))
        mid = m if mid is None else mid + m
    return down, mid


def guided_controls(images, scales, guess, rows):
    """The ControlNet inputs of a guided model call whose unconditional rows come before the
    conditional ones as ``rows(uncond, cond)`` lays them out (:func:`pipelines.program.cfg_rows`
    for a batch; the step engine's guided rows): ``images`` one batch per ControlNet,
    ``scales`` (B, K, ...), ``guess`` (B, K). Guess mode gives the unconditional rows scale 0
    (diffusers runs the ControlNet on the conditional half only and adds zeros to the other:
    the same zeros). Returns (images, scales, guess) of the guided call."""
    off = jnp.where(guess.reshape(guess.shape + (1,) * (scales.ndim - guess.ndim)), 0.0, scales)
    return [rows(im, im) for im in images], rows(off, scales), rows(guess, guess)


def control_inputs(nets, controls: Sequence[Sequence[ControlImage]], height: int, width: int,
                   calls: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """The host side of :func:`control_residuals` for images of ``height`` x ``width`` and a
    run of ``calls`` model calls: ``controls`` has one row per image, one
    :class:`ControlImage` per ControlNet of ``nets``. Returns the control images (one float32
    (n, H, W, 3) batch per ControlNet, resized as diffusers' control image processor does), the
    scales (n, K, calls: scale times :func:`control_keep`) and guess mode (n, K: the
    ControlImage's, or the ControlNet's ``global_pool_conditions``)."""
    k = len(nets)
    cache: dict[int, np.ndarray] = {}  # an image given for several rows is resized once

    def pixels(img, name):
        if id(img) not in cache:
            cache[id(img)] = image_pixels(img, height, width, name)
        return cache[id(img)]

    images = [np.stack([pixels(row[j].image, f"image[{j}]" if k > 1 else "image")
                        for row in controls]) for j in range(k)]
    scales = np.array([[c.scale * control_keep(calls, c.start, c.end) for c in row]
                       for row in controls], np.float32).reshape(len(controls), k, calls)
    guess = np.array([[bool(c.guess_mode) or bool(net.config.global_pool_conditions)
                       for c, net in zip(row, nets)] for row in controls]).reshape(-1, k)
    return images, scales, guess


class ControlNet(Task):
    name = "controlnet"

    def model(self, ctx: Ctx):
        nets, rows = ctx.pipe.controlnets, ctx.rows
        images, scales, guess = rows["images"], rows["scales"], rows["guess"]
        if ctx.inputs.cfg:
            images, scales, guess = guided_controls(images, scales, guess, program_lib.cfg_rows)
        denoiser = ctx.denoiser()

        def model(xin, t, i, **more):
            down, mid = control_residuals(nets, ctx.weights, xin, t, ctx.cond, images,
                                          scales[:, :, i], guess)
            return denoiser(xin, t, i, down_block_additional_residuals=down,
                            mid_block_additional_residual=mid, **more)
        return model

    # the step engine: each slot holds its control images, its scale table (per ControlNet,
    # padded at the front like the schedules) and guess mode
    def slot_extra(self, pipe, extra):
        if extra is None:
            raise ValueError("controls is required: this engine runs ControlNets; give one "
                             f"ControlImage per ControlNet ({len(pipe.controlnets)})")
        extra = list(extra) if isinstance(extra, (list, tuple)) else extra
        pipe.check_controls(extra)
        return extra

    def slot_weights(self, pipe):
        return {"controlnets": pipe.controlnet_params}

    def slot_state(self, pipe, slots, height, width, max_steps):
        k = len(pipe.controlnets)
        return {"cimg": tuple(np.zeros((slots, height, width, 3), np.float32)
                              for _ in range(k)),
                "cscale": np.zeros((slots, k, max_steps), np.float32),
                "cguess": np.zeros((slots, k), bool)}

    def slot_rows(self, pipe, extras, height, width, steps, max_steps):
        """Control images resized as the ControlNet pipeline resizes them, scale tables over
        each image's own steps, guess mode (:func:`control_inputs`)."""
        if not extras:
            return self.slot_state(pipe, 1, height, width, max_steps)
        nets, k = pipe.controlnets, len(pipe.controlnets)
        rows = [control_inputs(nets, [controls], height, width, st)
                for controls, st in zip(extras, steps)]
        return {"cimg": tuple(np.concatenate([r[0][j] for r in rows]) for j in range(k)),
                "cscale": np.concatenate([np.pad(sc, ((0, 0), (0, 0), (max_steps - sc.shape[2], 0)))
                                          for _, sc, _ in rows]),
                "cguess": np.concatenate([gs for _, _, gs in rows])}

    def slot_model(self, pipe, params, state, index, active, pair):
        # this step's scale of each row for each ControlNet (0 for idle rows)
        scale = jnp.take_along_axis(state["cscale"], index[:, None, None], axis=2)[..., 0]
        scale = scale * active[:, None]
        images, guess = state["cimg"], state["cguess"]
        if pair is not None:
            images, scale, guess = guided_controls(images, scale, guess, pair)

        def extras(xin, t, cond):
            down, mid = control_residuals(pipe.controlnets, params["controlnets"], xin, t, cond,
                                          images, scale, guess)
            return {"down_block_additional_residuals": down, "mid_block_additional_residual": mid}
        return extras


CONTROLNET = ControlNet()
