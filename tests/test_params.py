"""maxdiff.models.params: loaded parameters are checked by shape without tracing their
initializers, and ``init_shapes`` (zeros in place of random initializers) finds the same tree
flax's own ``init`` does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import tiny

from maxdiff.models import clip, unet, vae


def _abstract(tree):
    return jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), tree)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_init_shapes_is_flaxs_init_tree(dtype):
    """Every architecture's tree from init_shapes equals eval_shape of flax's init with the
    modules' own (random) initializers: the same paths, shapes and dtypes."""
    model = unet.unet_module(tiny.SDXL_UNET, dtype=dtype)
    inputs = model.dummy_inputs()
    assert _abstract(unet.param_shapes(model)) == _abstract(
        jax.eval_shape(model.init, jax.random.key(0), **inputs)["params"])
    auto = vae.AutoencoderKL(vae.AutoencoderKLConfig.from_dict(tiny.VAE))
    x = jax.ShapeDtypeStruct((1, 2, 2, 3), jnp.float32)
    assert _abstract(vae.param_shapes(auto)) == _abstract(
        jax.eval_shape(auto.init, jax.random.key(0), x)["params"])
    text = _text_encoder()
    ids = jax.ShapeDtypeStruct((1, text.config.max_position_embeddings), jnp.int32)
    assert _abstract(clip.param_shapes(text)) == _abstract(
        jax.eval_shape(text.init, jax.random.key(0), ids)["params"])


def _text_encoder():
    config = tiny.clip_text_config(projection=True).to_dict()
    return clip.CLIPTextModelWithProjection(clip.CLIPTextConfig.from_dict(config))


def test_a_parameter_of_the_wrong_shape_is_named():
    """A loaded tree whose parameter does not fit the module fails when it is applied, with the
    parameter's path and both shapes (flax's check, kept without tracing an initializer)."""
    text = _text_encoder()
    ids = jnp.zeros((1, text.config.max_position_embeddings), jnp.int32)
    params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), clip.param_shapes(text))
    out = text.apply({"params": params}, ids)
    assert out.text_embeds.shape[0] == 1
    proj = params["text_projection"]["kernel"]
    params["text_projection"]["kernel"] = jnp.zeros((proj.shape[0] + 1, proj.shape[1]))
    with pytest.raises(ValueError, match=r"text_projection/kernel has shape \(\d+, \d+\); this "
                                         r"module expects \(\d+, \d+\)"):
        text.apply({"params": params}, ids)


def test_every_module_that_holds_parameters_reads_them_from_the_tree():
    """Every module that holds parameters of its own in the UNet, the VAE and a text encoder is
    a ``FromTree`` one (a flax layer used directly, ``nn.Dense(...)`` say, would trace its
    initializer per parameter on every trace, and ``zero_init`` would not reach it): recorded
    from the modules that run in an ``apply`` (flax's ``intercept_methods``)."""
    from collections.abc import Mapping

    import flax.linen as nn

    from maxdiff.models.params import FromTree

    held, plain = set(), set()

    def record(next_fun, args, kwargs, context):
        mod = context.module
        own = mod.scope is not None and any(
            not isinstance(v, Mapping) for v in mod.variables.get("params", {}).values())
        if own:
            path = "/".join(mod.scope.path)
            held.add(path)
            if not isinstance(mod, FromTree):
                plain.add(f"{path} ({type(mod).__module__}.{type(mod).__name__})")
        return next_fun(*args, **kwargs)

    model = unet.unet_module(tiny.SDXL_UNET)
    auto = vae.AutoencoderKL(vae.AutoencoderKLConfig.from_dict(tiny.VAE))
    text = _text_encoder()
    ids = jax.ShapeDtypeStruct((1, text.config.max_position_embeddings), jnp.int32)
    with nn.intercept_methods(record):
        jax.eval_shape(lambda p, kw: model.apply({"params": p}, **kw), unet.param_shapes(model),
                       model.dummy_inputs())
        jax.eval_shape(lambda p, x: auto.apply({"params": p}, x), vae.param_shapes(auto),
                       jax.ShapeDtypeStruct((1, 2, 2, 3), jnp.float32))
        jax.eval_shape(lambda p, i: text.apply({"params": p}, i), clip.param_shapes(text), ids)
    assert len(held) > 100  # the check saw the models' layers
    assert not plain, sorted(plain)
