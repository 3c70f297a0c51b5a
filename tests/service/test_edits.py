"""Edits over HTTP: image-to-image and inpainting through ``/v1/edit`` and the OpenAI
``images.edit`` route, equal to the Python API, and their 422s."""

from __future__ import annotations

import base64
import io
import types
from pathlib import Path

import numpy as np
import pytest
import requests
from PIL import Image

from .helpers import SIZE, STEPS, png

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")


# ---------------------------------------------------------------------------------- edits
def _encode(a: np.ndarray, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def edit_files(tmp_path_factory):
    """A 32x32 picture, a white = repaint mask (left half) and the same mask the OpenAI way (an
    RGBA PNG, left half fully transparent), as files and arrays."""
    d = tmp_path_factory.mktemp("edit")
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    white = np.zeros((SIZE, SIZE), np.uint8)
    white[:, :SIZE // 2] = 255
    rgba = np.dstack([np.full((SIZE, SIZE, 3), 90, np.uint8), 255 - white])
    files = {"image": _encode(image), "mask": _encode(white), "openai_mask": _encode(rgba),
             "small_mask": _encode(white[:16, :16])}
    for name, data in files.items():
        (d / f"{name}.png").write_bytes(data)
    return types.SimpleNamespace(dir=d, image=image, mask=white, **{
        f"{k}_png": d / f"{k}.png" for k in files})


def _edit(url, timeout=120, **body):
    return requests.post(f"{url}/v1/edit", json={"prompt": "a red circle", **body},
                         timeout=timeout)


def _b64file(path) -> str:
    return base64.b64encode(Path(path).read_bytes()).decode()


def test_openai_client_edits(main_app, edit_files):
    """``client.images.edit`` with a mask (inpainting) and without (image-to-image)."""
    import openai

    client = openai.OpenAI(base_url=f"{main_app.url}/v1", api_key="unused", max_retries=0)
    with open(edit_files.image_png, "rb") as image, open(edit_files.openai_mask_png, "rb") as mask:
        out = client.images.edit(image=image, mask=mask, prompt="a blue square",
                                 size=f"{SIZE}x{SIZE}", model="tiny-sdxl", user="test",
                                 input_fidelity="high", quality="high")
    assert len(out.data) == 1 and out.size == f"{SIZE}x{SIZE}"
    inpainted = png(out.data[0].b64_json)
    assert inpainted.shape == (SIZE, SIZE, 3)
    with open(edit_files.image_png, "rb") as image:  # no size: the image's
        out = client.images.edit(image=[image], prompt="a blue square")
    assert png(out.data[0].b64_json).shape == (SIZE, SIZE, 3) and out.size == f"{SIZE}x{SIZE}"
    with open(edit_files.image_png, "rb") as image:  # a link to the stored image
        out = client.images.edit(image=image, prompt="a blue square", response_format="url")
    assert out.data[0].b64_json is None
    assert png(requests.get(out.data[0].url, timeout=30).content).shape == (SIZE, SIZE, 3)
    with open(edit_files.image_png, "rb") as image:
        with pytest.raises(openai.UnprocessableEntityError, match="'b64_json' or 'url'"):
            client.images.edit(image=image, prompt="x", response_format="link")
    shapes = {b["shape"] for rep in requests.get(f"{main_app.url}/v1/stats").json()[
        "replicas"].values() for b in rep["batches"]}
    assert {f"inpaint:{SIZE}x{SIZE}:{STEPS}:nocfg:s0.9999",
            f"img2img:{SIZE}x{SIZE}:{STEPS}:nocfg:s0.75"} <= shapes, shapes


def test_native_edit_equals_python_api(main_app, pipe, edit_files):
    """/v1/edit with a seed: the Python API's ImageToImagePipeline / InpaintPipeline pixels
    (within one level), and the mask's two conventions give the same image."""
    from pipelines import ImageToImagePipeline, InpaintPipeline

    image = Image.fromarray(edit_files.image)
    kw = dict(seed=21, num_inference_steps=STEPS, guidance_scale=0.0)
    r = _edit(main_app.url, prompt="a photo of a cat", image=_b64file(edit_files.image_png),
              seed=21, steps=STEPS, guidance_scale=0.0, strength=0.75)
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["mode"], body["strength"], body["seeds"]) == ("img2img", 0.75, [21])
    assert (body["width"], body["height"]) == (SIZE, SIZE) and "generate_s" in body["timings"]
    ours = ImageToImagePipeline.from_pipe(pipe)("a photo of a cat", image=image, strength=0.75,
                                                **kw).images[0]
    got = png(body["images"][0]["b64_json"]).astype(int)
    assert np.abs(got - np.asarray(ours, int)).max() <= 1
    assert np.abs(got - edit_files.image.astype(int)).max() > 0

    inpainted = []
    for mask in (edit_files.mask_png, edit_files.openai_mask_png):
        r = _edit(main_app.url, prompt="a photo of a cat", image=_b64file(edit_files.image_png),
                  mask=_b64file(mask), seed=21, steps=STEPS, guidance_scale=0.0)
        assert r.status_code == 200, r.text
        assert (r.json()["mode"], r.json()["strength"]) == ("inpaint", 0.9999)
        inpainted.append(png(r.json()["images"][0]["b64_json"]).astype(int))
    np.testing.assert_array_equal(inpainted[0], inpainted[1])
    ours = InpaintPipeline.from_pipe(pipe)("a photo of a cat", image=image,
                                           mask_image=Image.fromarray(edit_files.mask),
                                           strength=0.9999, **kw).images[0]
    assert np.abs(inpainted[0] - np.asarray(ours, int)).max() <= 1


EDIT_ERRORS = [
    (dict(mask="small_mask"), "mask", "mask is 16x16 but image is 32x32"),
    (dict(image=base64.b64encode(b"not an image").decode()), "image", "could not be decoded"),
    (dict(image="%%%"), "image", "not valid base64"),
    (dict(image=None), "image", "required"),
    (dict(strength=1.5), "strength", "must be a number in (0, 1]"),
    (dict(strength=0.25), "strength", "leaves no denoising step"),
    (dict(width=128, height=128), "width", "between 16 and 64"),
    (dict(num_images=5), "num_images", "at most 4"),
    (dict(width=64, height=64, num_images=4), "num_images", "max_cost"),
    (dict(seed=-1), "seed", "seeds are integers in 0..4294967295"),
]


@pytest.mark.parametrize("change,field,message", EDIT_ERRORS,
                         ids=[f"{f}-{i}" for i, (_, f, _) in enumerate(EDIT_ERRORS)])
def test_invalid_edits_are_422_naming_the_field(main_app, edit_files, change, field, message):
    body = {"image": _b64file(edit_files.image_png), "steps": STEPS}
    for k, v in change.items():
        if v is None:
            body.pop(k)
        elif k in ("image", "mask") and v in ("small_mask", "mask"):
            body[k] = _b64file(getattr(edit_files, f"{v}_png"))
        else:
            body[k] = v
    r = _edit(main_app.url, timeout=30, **body)
    assert r.status_code == 422, r.text
    err = r.json()
    assert err["error"]["param"] == field or any(field in d["loc"] for d in err["detail"]), err
    assert message in err["error"]["message"], err


def test_invalid_openai_edits_are_422(main_app, edit_files):
    url = f"{main_app.url}/v1/images/edits"
    image = ("image.png", edit_files.image_png.read_bytes(), "image/png")
    cases = [
        ({"image": image, "mask": ("m.png", edit_files.small_mask_png.read_bytes())}, {},
         "mask", "mask is 16x16 but image is 32x32"),
        ({"image": ("x.png", b"GIF89a not really")}, {}, "image", "could not be decoded"),
        ({}, {"prompt": "x"}, "image", "required"),
        ({"image": image}, {}, "prompt", "Field required"),
        ({"image": image}, {"size": "4096x4096"}, "size", "out of range"),
        ({"image": image}, {"n": "9"}, "n", "at most 4"),
        ({"image": image}, {"n": "two"}, "n", "integer"),
    ]
    for files, data, field, message in cases:
        data = {"prompt": "x", **data} if field != "prompt" else data
        r = requests.post(url, files=files or {"unused": ("", b"")}, data=data, timeout=30)
        assert r.status_code == 422, (field, r.text)
        err = r.json()
        assert any(field in d["loc"] for d in err["detail"]), err
        assert message in err["error"]["message"], err


def test_http_names_the_field_and_the_range_like_every_front_door(main_app, edit_files):
    """tests/test_limits.py's table of bad values, which the Python API, the CLI and JSONL lines
    refuse there: each is a 422 naming the field in the dialect's words and stating the same
    range, through /v1/generate (/v1/edit for strength) and, for the settings OpenAI's API has
    (n, size), through /v1/images/generations and /v1/images/edits."""
    import re

    from test_limits import BAD_VALUES

    from pipelines.field_names import FIELDS

    def refused(r, field, says):
        assert r.status_code == 422, (field, r.text)
        err = r.json()
        assert any(field in d["loc"] for d in err["detail"]), err
        assert re.search(says, err["error"]["message"]), (field, err)

    image = _b64file(edit_files.image_png)
    for field, value, says in BAD_VALUES:
        name = FIELDS[field]["native"]
        if field == "strength":
            r = _edit(main_app.url, image=image, steps=STEPS, strength=value)
        else:
            r = requests.post(f"{main_app.url}/v1/generate", json={"prompt": "x", name: value},
                              timeout=30)
        refused(r, name, says)
        if field in ("n", "width"):
            name = FIELDS[field]["openai"]
            text = str(value) if field == "n" else f"{value}x{SIZE}"
            r = requests.post(f"{main_app.url}/v1/images/generations",
                              json={"prompt": "x", name: value if field == "n" else text},
                              timeout=30)
            refused(r, name, says)
            r = requests.post(f"{main_app.url}/v1/images/edits", data={"prompt": "x", name: text},
                              files={"image": ("i.png", edit_files.image_png.read_bytes())},
                              timeout=30)
            refused(r, name, says)


def test_an_omitted_strength_is_the_same_in_every_front_door(main_app, pipe, edit_files):
    """No strength given: /v1/edit answers with limits.STRENGTH and the pixels of the Python
    API's ImageToImagePipeline called without one; OpenAI's images.edit (which has no strength
    field) batches at the same strength; the CLI plans its edit lines with it."""
    from pipelines import ImageToImagePipeline
    from pipelines.cli.lines import PromptLine
    from pipelines.cli.prompts import edit_strength
    from pipelines.limits import STRENGTH

    r = _edit(main_app.url, prompt="a photo of a cat", image=_b64file(edit_files.image_png),
              seed=22, steps=STEPS, guidance_scale=0.0)
    assert r.status_code == 200, r.text
    assert r.json()["strength"] == STRENGTH["img2img"]
    ours = ImageToImagePipeline.from_pipe(pipe)(
        "a photo of a cat", image=Image.fromarray(edit_files.image), seed=22,
        num_inference_steps=STEPS, guidance_scale=0.0).images[0]
    got = png(r.json()["images"][0]["b64_json"]).astype(int)
    assert np.abs(got - np.asarray(ours, int)).max() <= 1
    r = requests.post(f"{main_app.url}/v1/images/edits", data={"prompt": "x"},
                      files={"image": ("i.png", edit_files.image_png.read_bytes())}, timeout=120)
    assert r.status_code == 200, r.text
    (rep,) = requests.get(f"{main_app.url}/v1/stats").json()["replicas"].values()
    newest = rep["batches"][-1]["shape"]  # this request's batch (newest last)
    assert newest == f"img2img:{SIZE}x{SIZE}:{STEPS}:nocfg:s{STRENGTH['img2img']:g}", newest
    assert edit_strength(PromptLine(0, "x", "x", image="photo.png")) == STRENGTH["img2img"]


def test_edit_bodies_have_their_own_limit(main_app, edit_files):
    """An image far over max_body_bytes (64 KiB) passes the gate of the edit routes (then its
    size is refused: 422); over max_image_bytes (1 MiB here) it is a 413."""
    rng = np.random.default_rng(1)
    big = _encode(rng.integers(0, 256, (200, 200, 3), dtype=np.uint8))
    assert len(big) > 65536
    r = _edit(main_app.url, timeout=30, image=base64.b64encode(big).decode())
    assert r.status_code == 422 and "between 16 and 64" in r.text, r.text
    r = _edit(main_app.url, timeout=30, image="A" * (2**20 + 10))
    assert r.status_code == 413 and "max_image_bytes" in r.text, r.text
    r = requests.post(f"{main_app.url}/v1/generate", json={"prompt": "x" * 70_000})
    assert r.status_code == 413 and "max_body_bytes" in r.text
