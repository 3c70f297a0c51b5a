"""ControlNet over HTTP: the serve arg ``controlnets`` loads them with the model, ``/v1/generate``
takes ``control_images`` (base64 in JSON, or files in a multipart form; each naming a loaded
ControlNet), requests that share their
ControlNets and shape run in one device batch with their own control images and scales, each
equal to the Python API's image alone; an unknown ControlNet is a 422 naming the loaded ones.
One application for the module (the session's Ray cluster), two tiny random ControlNets and an
IP-Adapter (serve arg ``ip_adapter``): image prompts over HTTP, with and without control
images, on both routes."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import requests
import tiny
from PIL import Image

from .helpers import MAIN_ARGS, SIZE, STEPS, concurrently, png

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

CN = dict(conditioning_embedding_out_channels=(8, 16))  # control image 2x the latents
ARGS = dict(MAIN_ARGS, model_name="tiny-cn", num_cpus=0, max_queued_requests=-1,
            batch_wait_timeout_s=2.0, warmup_batch_sizes=[1], max_cost=1.0,
            warmup_shapes=[*MAIN_ARGS["warmup_shapes"], f"{SIZE}x{SIZE}:{STEPS}:0:canny"])


@pytest.fixture(scope="module")
def nets(tmp_path_factory):
    root = tmp_path_factory.mktemp("cn-serve")
    for k, name in enumerate(("canny", "depth")):
        tiny.make_controlnet(root / name, tiny.SDXL_UNET, seed=5 + k, **CN)
    return {name: root / name for name in ("canny", "depth")}


@pytest.fixture(scope="module")
def ip_file(sdxl_dir, tmp_path_factory):
    """A tiny IP-Adapter for the tiny model, its image encoder beside it (h94's layout)."""
    from diffusers import UNet2DConditionModel

    folder = tmp_path_factory.mktemp("ip-serve")
    tiny.make_image_encoder(folder / "image_encoder")
    return tiny.make_ip_adapter(UNet2DConditionModel.from_pretrained(sdxl_dir / "unet"),
                                folder / "ip-adapter_sdxl.safetensors", seed=9)


@pytest.fixture(scope="module")
def cn_app(cluster, sdxl_dir, nets, ip_file):
    """The tiny model with both ControlNets loaded (engine=batch; its warm-up: text-to-image
    and ``canny`` at one batch size only)."""
    from serving.app import build_app

    serve.run(build_app({"model": str(sdxl_dir), **ARGS,
                         "controlnets": {k: str(v) for k, v in nets.items()},
                         "ip_adapter": str(ip_file), "ip_adapter_scale": 0.8}),
              name="controlnet", route_prefix="/controlnet")
    yield f"{cluster.url}/controlnet"
    serve.delete("controlnet")


def _control(seed: int) -> bytes:
    a = np.random.default_rng(seed).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "PNG")
    return buf.getvalue()


def _generate(url, timeout=300, **body):
    return requests.post(f"{url}/v1/generate", json={"prompt": "a red circle", "steps": STEPS,
                                                     "guidance_scale": 0.0, **body},
                         timeout=timeout)


def test_requests_batch_together_and_equal_the_python_api(cn_app, nets, sdxl_dir):
    """Three requests with their own control images, scales and windows, sent together: one
    batch (the same ControlNet and shape), each image within one level of the Python API's
    ControlNetPipeline run alone; no size given: the control image's."""
    from pipelines import ControlNetPipeline, TextToImagePipeline

    images = [_control(k) for k in range(3)]
    settings = [dict(scale=0.5), dict(scale=1.0, guess_mode=True), dict(scale=1.5, start=0.5)]

    def send(k):
        return _generate(cn_app, seed=10 + k, control_images=[
            {"image": base64.b64encode(images[k]).decode(), "controlnet": "canny",
             **settings[k]}])

    rs = concurrently(3, send)
    for r in rs:
        assert r.status_code == 200, r.text
    bodies = [r.json() for r in rs]
    assert {b["timings"]["batch_id"] for b in bodies} == {bodies[0]["timings"]["batch_id"]}
    assert bodies[0]["timings"]["batch_requests"] == 3
    assert all(b["controlnets"] == ["canny"] and (b["width"], b["height"]) == (SIZE, SIZE)
               for b in bodies)

    one = ControlNetPipeline.from_pipe(
        TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None),
        controlnet=str(nets["canny"]))
    for k, b in enumerate(bodies):
        s = settings[k]
        ours = one("a red circle", image=Image.open(io.BytesIO(images[k])).convert("RGB"),
                   controlnet_conditioning_scale=s["scale"],
                   control_guidance_start=s.get("start", 0.0),
                   guess_mode=s.get("guess_mode", False), seed=10 + k,
                   num_inference_steps=STEPS, guidance_scale=0.0).images[0]
        got = png(b["images"][0]["b64_json"]).astype(int)
        assert np.abs(got - np.asarray(ours, int)).max() <= 1, k
    shapes = {x["shape"] for rep in requests.get(f"{cn_app}/v1/stats").json()[
        "replicas"].values() for x in rep["batches"]}
    assert f"controlnet[canny]:{SIZE}x{SIZE}:{STEPS}:nocfg" in shapes, shapes
    # the warm-up shape with a ControlNet compiled its program before the replica was ready
    (warmed,) = {tuple(rep["warmed"]) for rep in requests.get(f"{cn_app}/v1/stats").json()[
        "replicas"].values()}
    assert f"controlnet[canny]:{SIZE}x{SIZE}:{STEPS}:nocfg" in warmed, warmed


def test_unknown_controlnets_and_bad_values_are_422(cn_app):
    image = base64.b64encode(_control(0)).decode()
    r = _generate(cn_app, timeout=30,
                  control_images=[{"image": image, "controlnet": "pose"}])
    assert r.status_code == 422, r.text
    err = r.json()
    assert "unknown ControlNet 'pose'; loaded ControlNets: canny, depth" in err["error"][
        "message"], err
    assert any("control_images[0].controlnet" in d["loc"] for d in err["detail"]), err
    r = _generate(cn_app, timeout=30, control_images=[
        {"image": image, "controlnet": "canny", "scale": 11.0},
        {"image": "%%%", "controlnet": "depth", "start": 0.9, "end": 0.1}])
    assert r.status_code == 422, r.text
    err = r.json()
    locs = {d["loc"][-1] for d in err["detail"]}
    assert {"control_images[0].scale", "control_images[1].start",
            "control_images[1].image"} <= locs, err
    assert "must be a number in [0, 10]" in err["error"]["message"]
    r = _generate(cn_app, timeout=30, control_images=[{"image": image}])  # two loaded: name one
    assert r.status_code == 422 and "name the ControlNet" in r.text, r.text
    (entry,) = [m for m in requests.get(f"{cn_app}/v1/models", timeout=30).json()["data"]
                if m["id"] == "tiny-cn"]
    assert entry["maxdiff"]["controlnets"] == [{"name": "canny"}, {"name": "depth"}]


def test_multipart_control_images_equal_the_json_ones(cn_app):
    """``/v1/generate`` as multipart/form-data (``curl -F``): the JSON fields as text fields,
    control images as ``control_image`` files and their settings once per file or once for all;
    the image equals the JSON request's; a bad form names its field."""
    images = [_control(20), _control(21)]
    body = {"prompt": "a red circle", "seed": 3, "steps": STEPS, "guidance_scale": 0.0}
    as_json = _generate(cn_app, seed=3, control_images=[
        {"image": base64.b64encode(images[0]).decode(), "controlnet": "canny", "scale": 0.5},
        {"image": base64.b64encode(images[1]).decode(), "controlnet": "depth", "scale": 0.5,
         "end": 0.5, "guess_mode": True}])
    assert as_json.status_code == 200, as_json.text
    form = {k: str(v) for k, v in body.items()} | {
        "controlnet": ["canny", "depth"], "control_scale": "0.5", "control_end": ["1", "0.5"],
        "control_guess_mode": ["false", "true"]}
    files = [("control_image", (f"c{k}.png", data, "image/png")) for k, data in enumerate(images)]
    r = requests.post(f"{cn_app}/v1/generate", data=form, files=files, timeout=300)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["controlnets"] == ["canny", "depth"] and got["seeds"] == [3]
    assert np.abs(png(got["images"][0]["b64_json"]).astype(int)
                  - png(as_json.json()["images"][0]["b64_json"])).max() <= 1
    # the image itself, as with JSON
    r = requests.post(f"{cn_app}/v1/generate", data=form, files=files,
                      headers={"Accept": "image/png"}, timeout=300)
    assert r.status_code == 200 and r.headers["content-type"] == "image/png", r.text
    assert r.headers["X-Seed"] == "3"
    # problems of the form and of its values, all named in one 422
    bad = form | {"control_scale": ["1", "2", "3"], "steps": "four"}
    r = requests.post(f"{cn_app}/v1/generate", data=bad, files=files, timeout=30)
    assert r.status_code == 422, r.text
    locs = {tuple(d["loc"][1:]) for d in r.json()["detail"]}
    assert {("control_scale",), ("steps",)} <= locs, r.json()
    assert "once per control_image (2), not 3 times" in r.json()["error"]["message"]
    r = requests.post(f"{cn_app}/v1/generate", data=form | {"controlnet": "pose"}, files=files,
                      timeout=30)
    assert r.status_code == 422 and "unknown ControlNet 'pose'" in r.text, r.text


def test_the_serve_arg_controlnets(sdxl_dir, tmp_path):
    """``controlnets`` as ``name=path,...`` (the command line), a mapping (serve.yaml) or per
    ``models`` entry; a name twice, a missing ``=`` or a missing folder is refused at build
    time, naming it. No deployment."""
    from serving.models import Catalog
    from serving.settings import ServeSettings

    def names(s):
        return [(c.name, c.path) for c in s.controlnets]

    assert names(ServeSettings.from_args({"controlnets": "canny=/a,depth=/b"})) == [
        ("canny", "/a"), ("depth", "/b")]
    assert names(ServeSettings.from_args({"controlnets": {"canny": "/a"}})) == [("canny", "/a")]
    for bad, message in (("a=/x,a=/y", "controlnet 'a' is given twice"),
                         ("canny", "controlnet 'canny': give name=path")):
        with pytest.raises(ValueError, match=message):
            ServeSettings.from_args({"controlnets": bad})
    entry = {"name": "a", "model": str(sdxl_dir), "controlnets": {"canny": str(tmp_path)}}
    s = ServeSettings.from_args({"models": [entry]})
    assert names(s.models[0]) == [("canny", str(tmp_path))]
    assert Catalog.from_settings(s).get("a").controlnets == s.models[0].controlnets
    with pytest.raises(ValueError, match="serve arg 'controlnets' belongs to one model"):
        ServeSettings.from_args({"models": [entry], "controlnets": "canny=/x"})
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=f"serve arg controlnets: canny: {missing}: no such "
                                         "folder"):
        Catalog.from_settings(ServeSettings.from_args({"model": str(sdxl_dir),
                                                       "controlnets": f"canny={missing}"}))


def test_image_prompts_share_batches_and_equal_the_python_api(cn_app, nets, sdxl_dir, ip_file,
                                                              main_app):
    """``ip_adapter_image`` (base64) at its own scale and at the served 0.8 share a batch with a
    request without one; with control images too; as a multipart file; on the OpenAI route as
    an extra field; each image within one level of the Python API's. Bad values and a model
    without an IP-Adapter are 422s naming the field."""
    from pipelines import ControlNetPipeline, TextToImagePipeline

    picture = _control(40)
    b64 = base64.b64encode(picture).decode()
    bodies = [dict(seed=1, ip_adapter_image=b64, ip_adapter_scale=0.5),
              dict(seed=2), dict(seed=3, ip_adapter_image=b64)]
    rs = concurrently(3, lambda k: _generate(cn_app, **bodies[k]))
    assert [r.status_code for r in rs] == [200] * 3, [r.text for r in rs]
    got = [r.json() for r in rs]
    assert len({b["timings"]["batch_id"] for b in got}) == 1
    r = _generate(cn_app, seed=4, ip_adapter_image=b64, control_images=[
        {"image": base64.b64encode(_control(41)).decode(), "controlnet": "canny"}])
    assert r.status_code == 200, r.text
    got.append(r.json())
    pipe = TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=None)
    pipe.load_ip_adapter(ip_file, scale=0.8)
    image = Image.open(io.BytesIO(picture)).convert("RGB")
    kw = dict(num_inference_steps=STEPS, guidance_scale=0.0, height=SIZE, width=SIZE)
    want = [pipe("a red circle", seed=1, ip_adapter_image=image, ip_adapter_scale=0.5, **kw),
            pipe("a red circle", seed=2, **kw), pipe("a red circle", seed=3,
                                                     ip_adapter_image=image, **kw),
            ControlNetPipeline.from_pipe(pipe, controlnet=str(nets["canny"]))(
                "a red circle", image=Image.open(io.BytesIO(_control(41))).convert("RGB"),
                seed=4, ip_adapter_image=image, **kw)]
    for k, (b, w) in enumerate(zip(got, want)):
        assert np.abs(png(b["images"][0]["b64_json"]).astype(int)
                      - np.asarray(w.images[0], int)).max() <= 1, k
    assert np.abs(png(got[0]["images"][0]["b64_json"]).astype(int)
                  - png(got[2]["images"][0]["b64_json"]).astype(int)).max() > 2  # scales act
    form = requests.post(f"{cn_app}/v1/generate", timeout=300,  # multipart: the image a file
                         files={"ip_adapter_image": ("style.png", picture, "image/png")},
                         data={"prompt": "a red circle", "seed": "1", "steps": str(STEPS),
                               "guidance_scale": "0", "ip_adapter_scale": "0.5"})
    assert form.status_code == 200, form.text
    assert np.array_equal(png(form.json()["images"][0]["b64_json"]),
                          png(got[0]["images"][0]["b64_json"]))
    r = requests.post(f"{cn_app}/v1/images/generations", timeout=300, json={
        "prompt": "a red circle", "ip_adapter_image": b64, "ip_adapter_scale": 0.5})
    assert r.status_code == 200, r.text
    (entry,) = [m for m in requests.get(f"{cn_app}/v1/models", timeout=30).json()["data"]
                if m["id"] == "tiny-cn"]
    assert entry["maxdiff"]["ip_adapter"] == {"kind": "basic", "tokens": 4, "scale": 0.8}
    r = _generate(cn_app, timeout=30, ip_adapter_image="%%%", ip_adapter_scale=9)
    assert r.status_code == 422, r.text
    assert {d["loc"][-1] for d in r.json()["detail"]} >= {"ip_adapter_image", "ip_adapter_scale"}
    assert "must be a number in [-1, 5]" in r.text
    r = _generate(main_app.url, timeout=30, ip_adapter_image=b64)
    assert r.status_code == 422 and "this model has no IP-Adapter" in r.text, r.text
