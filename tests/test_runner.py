"""The one program builder and runner (pipelines.runner) and the pieces every program shares
(pipelines.program), tested directly: a task is only its hooks, programs are counted per
compilation, host inputs are placed as rows."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxdiff import mesh as meshlib
from pipelines import TextToImagePipeline
from pipelines.program import BatchPut, HostInputs, Programs
from pipelines.requests import ImageRequest
from pipelines.runner import TEXT, Job, Task, checked_items, run


def test_programs_count_each_compilation_as_jax_does():
    programs = Programs(meshlib.make_mesh(1))
    double = programs.get(("double",), lambda: (lambda x: x * 2))
    double(np.ones(3, np.float32))
    double(np.ones(3, np.float32))
    assert programs.num_compiled == 1
    double(np.ones(4, np.float32))  # new shape: compiled again
    assert programs.num_compiled == 2 == double.fn._cache_size()  # JAX's own count agrees
    assert programs.get(("double",), lambda: None) is double and list(programs) == [("double",)]


def test_host_inputs_are_placed_as_padded_rows(sdxl_dir):
    from maxdiff import prompts as promptlib
    from maxdiff.tokenizers import load_tokenizer

    mesh = meshlib.make_mesh(1)
    n = 3
    tok = load_tokenizer(sdxl_dir / "tokenizer")
    pair = (promptlib.plan("a (cat)", tok), promptlib.plan("a (cat)", tok))
    empty = promptlib.empty_ids(tok)
    text = promptlib.pack([pair] * n, (empty, empty))
    inputs = HostInputs(seeds=np.arange(n, dtype=np.uint32), text=text, neg_text=text,
                        zero_negative=np.ones(n, bool), time_ids=np.ones((n, 6), np.float32),
                        neg_time_ids=np.ones((n, 6), np.float32),
                        guidance=np.ones(n, np.float32), rescale=np.zeros(n, np.float32), cfg=True)
    placed = BatchPut(mesh, 4).tree({"inputs": inputs, "latents": None})
    got = placed["inputs"]
    assert placed["latents"] is None and got.cfg is True and got.text.weighted is True
    assert got.text.ids.shape == (4, 2, 77) and got.text.masks.shape == (4, 2, 1, 77)
    assert got.seeds.shape == (4,) and got.time_ids.shape == (4, 6)
    assert int(got.seeds[3]) == 2  # padding repeats the last image
    leaves, tree = jax.tree.flatten(got)
    # cfg and the texts' flags are static: part of the structure
    assert len(leaves) == 6 + 2 * 8 and "True" in str(tree)


class _FromZeros(Task):
    """A task that is one hook: every image starts from zero latents instead of its noise."""

    name = "from-zeros"

    def begin(self, ctx):
        return jnp.zeros((ctx.inputs.seeds.shape[0], *ctx.shape), jnp.float32), 0


def test_a_new_task_is_its_hooks(sdxl_dir):
    """A task that only changes the start latents runs through the same builder and runner:
    its images no longer depend on the seed (text-to-image's do), it is kept under its own
    key, and the checks every task shares apply to it."""
    pipe = TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)
    items = [ImageRequest(prompt="a red circle", seed=s, guidance_scale=0.0) for s in (1, 2)]

    def images(task):
        return run(Job(task, pipe, items, 32, 32, 2, "np", time.perf_counter())).images

    zeros, text = images(_FromZeros()), images(TEXT)
    np.testing.assert_array_equal(zeros[0], zeros[1])
    assert np.abs(text[0] - text[1]).max() > 1e-3
    assert [key[0] for key in pipe.programs] == ["from-zeros", "text-to-image"]
    assert pipe.num_compiled == 2
    with pytest.raises(ValueError, match="items is empty"):
        checked_items(pipe, [], 2, 32, 32, "np")
    with pytest.raises(ValueError, match="height=31"):
        checked_items(pipe, items, 2, 31, 32, "np")
    # an item without a guidance scale gets the pipeline's (its family's or run config's)
    pipe.default_guidance = 0.0
    (got,), *_ = checked_items(pipe, [ImageRequest(prompt="a")], 2, 32, 32, "np")
    assert got.guidance_scale == 0.0
    assert checked_items(pipe, [ImageRequest("a", guidance_scale=3.0)], 2, 32, 32,
                         "np")[0][0].guidance_scale == 3.0
    omitted = [ImageRequest(prompt="a red circle", seed=s) for s in (1, 2)]
    np.testing.assert_array_equal(pipe.generate(omitted, height=32, width=32,
                                                num_inference_steps=2, output_type="np").images,
                                  text)
