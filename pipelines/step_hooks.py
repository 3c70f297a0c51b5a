"""The host callbacks of a batch program's steps: a progress bar and the caller's ``on_step``
(latents, or each step's denoised estimate for previews), reported by the program through
``jax.debug.callback`` to the running job's listener."""

from __future__ import annotations

import jax
import numpy as np

LISTENER: list = [None]  # the running job's step listener (the programs' host callbacks)


def _step_done(i, t, x) -> None:
    listener = LISTENER[0]
    if listener is not None:
        listener(int(i), t, x)


def denoised_hook(hooks: str, scheduler):
    """For ``"denoised"`` hooks: a host callback with the step index, its timestep and the
    step's estimate of the clean latents (previews), else None."""
    if hooks != "denoised":
        return None

    def hook(i, state, x0):
        jax.debug.callback(_step_done, i, scheduler.timestep_for_model(state, i), x0)
    return hook


def with_hooks(after_step, hooks: str, scheduler):
    """``after_step`` followed by a host callback with the step index, its timestep and (for
    ``"latents"``) the latents; unchanged without ``hooks`` (or with ``"denoised"``, reported
    by :func:`denoised_hook`), so a call that asks for nothing runs the same program."""
    if hooks in ("", "denoised"):
        return after_step

    def hooked(i, state, x):
        if after_step is not None:
            x = after_step(i, state, x)
        jax.debug.callback(_step_done, i, scheduler.timestep_for_model(state, i),
                           x if hooks == "latents" else None)
        return x
    return hooked


class Steps:
    """A job's step listener: a progress bar (tqdm) and the caller's ``on_step(step,
    timestep, latents (N, C, h, w))``; steps reported more than once (one call per device)
    count once."""

    def __init__(self, job, total: int):
        from tqdm import tqdm

        self.job, self.seen = job, -1
        self.bar = tqdm(total=total, desc=f"{job.task.name} {job.width}x{job.height}",
                        unit="step", disable=not job.progress, leave=False)

    def __call__(self, i: int, t, x) -> None:
        if i <= self.seen:
            return
        self.bar.update(i - self.seen)
        self.seen = i
        if self.job.on_step is not None and x is not None:
            latents = np.asarray(x)[:self.job.n].transpose(0, 3, 1, 2)
            self.job.on_step(i, np.asarray(t), latents)

    def close(self) -> None:
        self.bar.close()
