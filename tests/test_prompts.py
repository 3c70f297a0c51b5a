"""Long and weighted prompts (maxdiff.prompt_syntax, maxdiff.prompts, pipelines.prompting):
the syntaxes read as compel and A1111 read them, the encodings against compel (the library
diffusers users weight prompts with) and against A1111's arithmetic on transformers' encoders,
images from weighted prompts against diffusers given the same embeddings, and the errors."""

from __future__ import annotations

import numpy as np
import pytest
import tiny
import torch

from maxdiff import prompts as promptlib
from maxdiff.prompt_syntax import parse
from pipelines import TextToImagePipeline, prompting
from pipelines.requests import ImageRequest

SIZE = 32
LONG = ", ".join(["a red cat on a mat"] * 6) + ". a blue dog+ runs, " + "green (tree)1.2 " * 4
COMPEL_PROMPTS = [
    "a cat", "a cat+ on a mat", "a (red cat)1.3 on a mat-", "(a (big)++ dog)0.8, sunset",
    '"a tall man"- walking', "well-known cat--, blurry", "photo, (cat).attend(1.4) dog",
    "a cat\\(s\\) +", "cat- dog-, bird--", "x1.5 (y)1.5 z", "", LONG,
    "x " * 80 + "(blurry)0.5 end",
]


@pytest.fixture(scope="module")
def pipe(sdxl_dir):
    return TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)


@pytest.fixture(scope="module")
def torch_pipe(sdxl_dir):
    from diffusers import StableDiffusionXLPipeline

    return StableDiffusionXLPipeline.from_pretrained(sdxl_dir).to("cpu")


@pytest.fixture(scope="module")
def sd_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-sd1")
    tiny.make_sd_pipeline(folder)
    return folder


def _compel(torch_pipe, sdxl: bool):
    from compel import Compel, ReturnedEmbeddingsType

    if not sdxl:
        return Compel(tokenizer=torch_pipe.tokenizer, text_encoder=torch_pipe.text_encoder,
                      truncate_long_prompts=False)
    return Compel(tokenizer=[torch_pipe.tokenizer, torch_pipe.tokenizer_2],
                  text_encoder=[torch_pipe.text_encoder, torch_pipe.text_encoder_2],
                  returned_embeddings_type=ReturnedEmbeddingsType.
                  PENULTIMATE_HIDDEN_STATES_NON_NORMALIZED,
                  requires_pooled=[False, True], truncate_long_prompts=False)


def _encode(pipe, items):
    import jax

    text, _ = prompting.texts(pipe, items)
    encoders = {n: getattr(pipe, n) for n in pipe.family.encoders}
    cond = jax.jit(lambda prm, t: pipe.family.encode(encoders, prm, t))(pipe.params, text)
    ctx, pooled = cond.context, cond.pooled
    return np.asarray(ctx), np.asarray(pooled), text


# ------------------------------------------------------------------------------ syntaxes
@pytest.mark.parametrize("prompt", COMPEL_PROMPTS + ["(a, b. c)1.1 d+", "a-b c++ (d)-- e"])
def test_compel_syntax_reads_as_compels_parser(prompt):
    """The fragments and weights compel's own parser gives, fused the same way."""
    from compel.prompt_parser import PromptParser

    conj = PromptParser().parse_conjunction(prompt)
    ref = [(f.text, round(f.weight, 6)) for f in conj.prompts[0].children] if conj.prompts else []
    ours = [(t, round(w, 6)) for t, w in parse(prompt, "compel")]
    assert ours == (ref or [("", 1.0)])


A1111 = [  # weights written out by hand from A1111's rules
    ("a cat", [("a cat", 1.0)]),
    ("a (cat)", [("a ", 1.0), ("cat", 1.1)]),
    ("a ((cat))", [("a ", 1.0), ("cat", 1.1 * 1.1)]),
    ("[dog] and (cat:1.5)", [("dog", 1 / 1.1), (" and ", 1.0), ("cat", 1.5)]),
    ("(a (b:2) c:0.5)", [("a ", 0.5), ("b", 1.0), (" c", 0.5)]),
    ("\\(literal\\) [x]", [("(literal) ", 1.0), ("x", 1 / 1.1)]),
    ("a: b (c : 1.2 )", [("a: b ", 1.0), ("c ", 1.2)]),
    ("one BREAK two", [("one", 1.0), ("BREAK", None), ("two", 1.0)]),
    ("", [("", 1.0)]),
]


@pytest.mark.parametrize("prompt,want", A1111)
def test_a1111_syntax(prompt, want):
    got = parse(prompt, "a1111")
    assert [t for t, _ in got] == [t for t, _ in want]
    assert np.allclose([w or 0 for _, w in got], [w or 0 for _, w in want])


@pytest.mark.parametrize("syntax,prompt,match", [
    ("a1111", "a (cat", r"'\(' is never closed at character 3"),
    ("a1111", "a cat)", r"'\)' closes no '\('"),
    ("a1111", "[cat:dog:0.5]", "prompt editing or alternation"),
    ("a1111", "(cat:1.2]", r"'\]' closes no '\['"),
    ("compel", "a (cat", r"'\(' is never closed"),
    ("compel", "a cat)", r"'\)' closes no '\('"),
    ("compel", '("a", "b").blend(0.5, 0.5)', r"compel's \.blend\(\) is not supported"),
    ("compel", "(cat).attend(lots)", r"\.attend\(\) takes a number"),
])
def test_syntax_errors_say_where(syntax, prompt, match):
    with pytest.raises(ValueError, match=match):
        parse(prompt, syntax)
    # the pipelines name the field and the syntax
    with pytest.raises(ValueError, match=rf"negative_prompt: .*{match}.*prompt_syntax="):
        ImageRequest("ok", negative_prompt=prompt, prompt_syntax=syntax).validate()


def test_unknown_syntax_and_length_limit(pipe):
    with pytest.raises(ValueError, match="prompt_syntax='markdown': must be one of a1111, "
                                         "compel, none"):
        ImageRequest("a", prompt_syntax="markdown").validate()
    with pytest.raises(ValueError, match=r"prompt: has \d+ tokens in 5 chunks of 75; at most 4 "
                                         r"chunks \(300 tokens\)"):
        pipe("x " * 320, num_inference_steps=1, height=SIZE, width=SIZE)


def test_a1111_chunks_break_at_a_near_comma_and_at_break(pipe):
    tok = pipe.tokenizer
    # 70 one-token words, a comma, 10 more: the chunk is full at 75 with the comma 4 tokens
    # back, so the 4 words after it move to the next chunk
    text = "x " * 70 + ", " + "y " * 10
    p = promptlib.plan(text, tok, "a1111")
    x, y = tok.convert_tokens_to_ids(["x</w>", "y</w>"])
    comma = tok.convert_tokens_to_ids(",</w>")
    first = list(p.ids[1:77])
    assert p.chunks == 2 and first[:71] == [x] * 70 + [comma]
    assert first[71] == tok.eos_token_id  # the chunk ends after its comma
    assert list(p.ids[78:88]) == [y] * 10
    broken = promptlib.plan("x BREAK y", tok, "a1111")
    assert broken.chunks == 2 and list(broken.ids[[1, 2, 78, 79]]) == [x, tok.eos_token_id, y,
                                                                       tok.eos_token_id]
    # compel splits the same text at its phrase end (the comma) as it fills the window
    c = promptlib.plan(text, tok, "compel")
    assert c.chunks == 2 and list(c.ids[1:72]) == [x] * 70 + [comma]


# ------------------------------------------------------------------------------ encodings
@pytest.mark.parity
def test_sdxl_encoding_equals_compel(pipe, torch_pipe):
    """Weighted, down-weighted (masked and blended) and 150-token prompts: the context and
    the pooled embedding compel computes for SDXL, within 1e-5."""
    compel = _compel(torch_pipe, sdxl=True)
    items = [ImageRequest(p, prompt_syntax="compel") for p in COMPEL_PROMPTS]
    for item in items:
        ctx, pooled, _ = _encode(pipe, [item])
        with torch.no_grad():
            ref, ref_pooled = compel(item.prompt)
        assert ctx.shape == tuple(ref.shape), item.prompt
        assert np.abs(ctx - ref.numpy()).max() < 1e-5, item.prompt
        assert np.abs(pooled - ref_pooled.numpy()).max() < 1e-5, item.prompt


@pytest.mark.parity
def test_sd1_encoding_equals_compel(sd_dir):
    from diffusers import StableDiffusionPipeline

    ref_pipe = StableDiffusionPipeline.from_pretrained(sd_dir, safety_checker=None)
    compel = _compel(ref_pipe, sdxl=False)
    pipe = TextToImagePipeline.from_pretrained(sd_dir, compile_cache_dir=None)
    for prompt in ("a (red cat)1.3 on a mat-", LONG, "cat- dog-, bird--"):
        ctx, _, _ = _encode(pipe, [ImageRequest(prompt, prompt_syntax="compel")])
        with torch.no_grad():
            ref = compel(prompt).numpy()
        assert ctx.shape == ref.shape and np.abs(ctx - ref).max() < 1e-5, prompt
    # "none" is compel's reading of text without syntax, and diffusers' for a short prompt
    plain = ", ".join(["a red cat on a mat"] * 8) + ". a blue dog runs"
    ctx, _, text = _encode(pipe, [ImageRequest(plain, prompt_syntax="none")])
    with torch.no_grad():
        ref = compel(plain).numpy()
    assert text.chunks == 2 and ctx.shape == ref.shape and np.abs(ctx - ref).max() < 1e-5


@pytest.mark.parity
def test_a1111_encoding_is_its_arithmetic(pipe, torch_pipe):
    """A1111's emphasis on transformers' encoders, written out here: each 77-token chunk
    encoded alone, its states times the token weights, rescaled to the chunk's former mean,
    chunks concatenated; the pooled embedding from the first chunk."""
    prompt = "a (red cat:1.4) on [a mat], " + "x " * 70 + "(sunset)"
    ctx, pooled, text = _encode(pipe, [ImageRequest(prompt)])
    assert text.chunks == 2 and text.weighted
    outs = []
    for row, enc in ((0, torch_pipe.text_encoder), (1, torch_pipe.text_encoder_2)):
        ids = torch.from_numpy(text.ids[0, row].astype(np.int64)).reshape(-1, 77)
        w = torch.from_numpy(text.weights[0, row]).reshape(-1, 77, 1)
        with torch.no_grad():
            out = enc(ids, output_hidden_states=True)
        z = out.hidden_states[-2]
        zw = z * w
        zw = zw * (z.mean(dim=(1, 2), keepdim=True) / zw.mean(dim=(1, 2), keepdim=True))
        outs.append(zw.reshape(1, -1, z.shape[-1]))
        if row == 1:
            ref_pooled = out.text_embeds[:1]
    ref = torch.cat(outs, dim=-1).numpy()
    weights = text.weights[0, 0]

    def count(t):
        return len(pipe.tokenizer(t, add_special_tokens=False).input_ids)
    assert np.isclose(weights, 1.4).sum() == count("red cat")
    assert np.isclose(weights, 1 / 1.1).sum() == count("a mat")
    assert np.isclose(weights, 1.1).sum() == count("sunset")
    assert np.abs(ctx - ref).max() < 1e-5 and np.abs(pooled - ref_pooled.numpy()).max() < 1e-5


@pytest.mark.parity
def test_images_equal_diffusers_given_compels_embeddings(pipe, torch_pipe):
    """A weighted 150-token prompt and a weighted negative through the whole pipeline: the
    pixels diffusers gives for compel's embeddings (prompt_embeds=...), within 2e-3."""
    compel = _compel(torch_pipe, sdxl=True)
    prompt, negative = LONG, "(blurry)1.3, [ugly]-"
    lat = np.random.default_rng(3).standard_normal((1, 4, SIZE // 2, SIZE // 2)).astype(np.float32)
    ours = pipe(prompt, negative_prompt=negative, prompt_syntax="compel", num_inference_steps=3,
                guidance_scale=5.0, height=SIZE, width=SIZE, latents=lat, output_type="np").images
    with torch.no_grad():
        cond, pooled = compel(prompt)
        ncond, npooled = compel(negative)
        empty, _ = compel("")  # compel's padding for SDXL (its pad_... needs one encoder)
        while ncond.shape[1] < cond.shape[1]:
            ncond = torch.cat([ncond, empty], dim=1)
        theirs = torch_pipe(prompt_embeds=cond, pooled_prompt_embeds=pooled,
                            negative_prompt_embeds=ncond, negative_pooled_prompt_embeds=npooled,
                            num_inference_steps=3, guidance_scale=5.0, height=SIZE, width=SIZE,
                            latents=torch.from_numpy(lat), output_type="np").images
    assert np.abs(ours - theirs).max() <= 2e-3


def test_a_batch_of_short_and_long_prompts_gives_each_its_own_pixels(pipe):
    """Images whose prompts need different chunk counts run as separate device batches, so
    each image equals the image made alone; weights change the image."""
    kw = dict(num_inference_steps=2, guidance_scale=4.0, height=SIZE, width=SIZE,
              output_type="np", seed=11)
    prompts = ["a red cat", LONG, "a (red cat:1.5)"]
    together = pipe(prompts, **kw)
    assert together.timings["device_batches"] == 2
    for k, p in enumerate(prompts):
        alone = pipe(p, **dict(kw, seed=11 + k)).images[0]
        assert np.abs(together.images[k] - alone).max() < 1e-5, p
    assert np.abs(together.images[0] - together.images[2]).max() > 1e-3


def test_step_engine_takes_weighted_prompts_and_refuses_long_ones(pipe):
    from pipelines.step_engine import StepEngine

    engine = StepEngine(pipe, SIZE, SIZE, slots=2, output_type="np")
    with pytest.raises(ValueError, match=r"prompt: has \d+ tokens in 2 chunks of 75; at "
                                         r"most 1 here \(the step engine"):
        engine.submit(ImageRequest(LONG, seed=1), 2)
    handle = engine.submit(ImageRequest("a (red cat:1.5)", seed=4, guidance_scale=0.0), 2)
    engine.run_until_idle()
    got = handle.image
    ref = pipe("a (red cat:1.5)", seed=4, guidance_scale=0.0, num_inference_steps=2,
               height=SIZE, width=SIZE, output_type="np").images[0]
    assert np.abs(got - ref).max() < 1e-5


def test_cli_lines_take_a_prompt_syntax(tmp_path):
    """--prompt-syntax for the run, a JSONL line's prompt_syntax for its images; the syntax
    is part of an image's id (another syntax is another image); errors name line and field."""
    from pipelines.cli.jobs import RunSettings, plan_jobs
    from pipelines.cli.lines import InputError
    from pipelines.cli.prompts import read_prompts

    s = RunSettings(model="m", scheduler="s", dtype="float32", steps=1, guidance=5.0,
                    width=32, height=32, run_seed=9, prompt_syntax="compel")
    lines = read_prompts(file_text='{"prompt": "a cat+"}\n'
                                   '{"prompt": "a (cat:1.2)", "prompt_syntax": "a1111"}\n',
                         file=tmp_path / "p.jsonl")
    jobs = plan_jobs(lines, s)
    assert [j.request().prompt_syntax for j in jobs] == ["compel", "a1111"]
    assert jobs[0].record()["prompt_syntax"] == "compel"
    other = plan_jobs(lines[:1], RunSettings(**{**s.__dict__, "prompt_syntax": "none"}))
    assert other[0].id != jobs[0].id
    with pytest.raises(InputError, match=r"p.jsonl:1: field 'prompt_syntax': must be one of "
                                         r"a1111, compel, none, got 'html'"):
        read_prompts(file_text='{"prompt": "a", "prompt_syntax": "html"}\n',
                     file=tmp_path / "p.jsonl")
    bad = read_prompts(file_text='{"prompt": "a (cat"}\n', file=tmp_path / "p.jsonl")
    with pytest.raises(InputError, match=r"p.jsonl:1: field 'prompt': '\(' is never closed"):
        plan_jobs(bad, RunSettings(**{**s.__dict__, "prompt_syntax": None}))
