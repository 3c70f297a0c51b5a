"""Every example in README.md and docs/*.md runs as written, with model paths pointed at small
models.

Each fenced block of every page is claimed by exactly one runner below, or listed in ``NOT_RUN``
with the reason; a new example that no runner claims fails :func:`test_every_block_is_run`.
Blocks that are data rather than commands carry a language tag that says so and are checked by
what they are: a ``json`` block must parse (and a ``maxdiff.json`` example must be a valid one).
Model paths (``/models/...``, ``stable-diffusion-xl-base-1.0``,
``sdxl_lightning_4step_unet.safetensors``, ``/tmp/tiny-*``) are replaced by the tiny random
checkpoint or temporary folders; nothing else is changed. The service examples run against real
``serve run`` processes on port 8000, as a user would start them. The pages' relative links
(and their ``#anchors``) must lead somewhere.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import requests

ROOT = Path(__file__).resolve().parent.parent
# README first, then the docs pages by name: the Python blocks run as one session in this order
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent
PORT = 8000

# first line of a block (without its comment) -> why it is not run here
NOT_RUN = {
    "git clone \"$REPO_URL\" maxdiff && cd maxdiff":
        "clones the repository the tests already run in; its make demo runs below, and "
        "test_make_demo_on_a_fresh_clone_installs_only_what_it_needs runs it in a new clone",
    "# head host (TPU VMs report a \"TPU\" resource = chips per host; GPU hosts report \"GPU\")":
        "starts Ray on several hosts (the same build_app placement args run on a local "
        "multi-node cluster in tests/service/test_generate.py)",
    "make lint":
        "the lint and test suites themselves (docs/development.md); make demo runs below",
    "python -m benchmarks.compare --quick --repeats 3":
        "a benchmark (tens of minutes on an idle machine); tests/test_benchmarks.py runs its parts",
    "python -m benchmarks.compare --quick --repeats 3 --compile off --json repeats.json":
        "a benchmark (tens of minutes on an idle machine); tests/test_benchmarks.py runs its parts",
    "python -m benchmarks.feature_cache --json speed.json":
        "a benchmark (30 minutes on an idle machine, the TPU mode 15 minutes of compiling); "
        "tests/test_benchmarks.py runs its process on the tiny checkpoint",
    "python -m benchmarks.quantization --part quality --checkpoint /tmp/medium --json quality.json":
        "a benchmark (tens of minutes); tests/test_benchmarks.py runs every part on the tiny "
        "checkpoint",
    "curl -s http://localhost:8000/v1/generate -H \"Accept: image/png\" -o statue.png \\":
        "needs a server with a ControlNet loaded; tests/service/test_controlnet_serving.py sends "
        "the same multipart form (control_image files, controlnet / control_scale / control_end)",
    "pipe = TextToImagePipeline.from_pretrained(\"/models/sdxl-base\")":
        "needs an IP-Adapter file for its model (h94/IP-Adapter): tests/test_ip_adapter.py makes "
        "the same calls on a tiny random adapter and compares them with diffusers",
    "fast = TextToImagePipeline.from_pretrained(\"/models/sdxl-base\", vae=\"/models/taesdxl\")":
        "needs an SDXL folder and a TAESDXL folder: tests/test_taesd.py loads tiny random ones "
        "and checks the images against diffusers'",
    "bash benchmarks/openvino_env.sh":
        "builds a second venv (1.6 GB) and exports a model to OpenVINO (minutes): a benchmark, "
        "run on an idle machine; tests/test_benchmarks.py checks its summary, its weight check "
        "and its key fix, and that the published rows are the committed run's",
    "pipe.load_preview_decoder(\"/models/taesdxl\")":
        "needs a TAESDXL folder for its model: tests/test_taesd.py loads a tiny random one, "
        "draws previews with it and compares them with diffusers' AutoencoderTiny",
    "from standardwebhooks.webhooks import Webhook":
        "a webhook receiver's two lines (its request comes from the receiver's web framework); "
        "tests/service/test_jobs.py verifies deliveries with the same call",
    "kubectl apply -f deploy/rayservice-gpu.yaml":
        "needs a Kubernetes cluster with the KubeRay operator; tests/test_deploy.py validates "
        "both manifests against Ray Serve's schema and configs/serve.yaml",
    "bash benchmarks/accelerator.sh":
        "needs an H100/H200; tests/test_benchmarks.py runs its --smoke mode on the CPU",
    "python -m benchmarks.cold_start --model /models/sdxl-base --size 1024 --steps 4 --json cold.json":
        "a benchmark on a full-size checkpoint; tests/test_benchmarks.py runs its load part on "
        "the tiny one",
}
# lines of a runner's block that it skips -> why
NOT_RUN_LINES = {
    "make test": "it is this test suite",
    "make test-slow": "it is this test suite (the slow part)",
    "make test-all": "it is this test suite (both parts in one session)",
    "bash .ci/run": "CI: make lint and make test-all, this test among them",
}


class Block(NamedTuple):
    page: str  # path relative to the repository root
    lang: str
    code: str
    before: str  # the paragraph right before the block


def blocks() -> list[Block]:
    """Every fenced block of every page, in page order."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            before = text[:m.start()].rstrip().rsplit("\n\n", 1)[-1]
            found.append(Block(str(page.relative_to(ROOT)), m.group(1), m.group(2), before))
    return found


def first_line(code: str) -> str:
    return code.strip().splitlines()[0].strip()


def command(code: str) -> str:
    """The first line without a trailing ``  # comment``."""
    return first_line(code).split("  #")[0].strip()


def claimed(block: Block) -> str | None:
    if command(block.code) in NOT_RUN:
        return "not run"
    for name, test in RUNNERS.items():
        if test(block.lang, block.code):
            return name
    return None


RUNNERS = {
    "make": lambda lang, code: first_line(code).startswith("make demo"),
    "python": lambda lang, code: lang == "python" and "localhost:8000" not in code,
    "serve": lambda lang, code: first_line(code).startswith("serve run"),
    "openai": lambda lang, code: lang == "python" and "localhost:8000" in code,
    "curl": lambda lang, code: first_line(code).startswith("curl "),
    "cli": lambda lang, code: first_line(code).startswith(("MODEL=", "maxdiff ")),
    "jobs": lambda lang, code: first_line(code) == "# jobs.jsonl",
    "tiny": lambda lang, code: "tiny.make_sdxl_pipeline" in code,
    "keys": lambda lang, code: "MAXDIFF_API_KEYS=" in code,
    "keyfile": lambda lang, code: lang == "text" and first_line(code).startswith("sha256:"),
    "json": lambda lang, code: lang == "json",
    "yaml": lambda lang, code: lang == "yaml",
}


def test_every_block_is_run():
    found = blocks()
    assert {b.page for b in found} >= {"README.md", "docs/python-api.md", "docs/service.md",
                                       "docs/cli.md", "docs/models.md"}
    unclaimed = [f"{b.page}: {first_line(b.code)}" for b in found if claimed(b) is None]
    assert not unclaimed, f"blocks that no test runs: {unclaimed}"
    names = {claimed(b) for b in found}
    assert names >= set(RUNNERS), f"runners whose blocks left the pages: {set(RUNNERS) - names}"
    heads = {command(b.code) for b in found}
    assert set(NOT_RUN) <= heads, f"NOT_RUN entries for blocks that are gone: {set(NOT_RUN) - heads}"


def codes(name: str) -> list[str]:
    """The blocks a runner claims, in page order."""
    found = [b.code for b in blocks() if claimed(b) == name]
    assert found, name
    return found


def the(name: str) -> str:
    code, = codes(name)
    return code


def test_key_file_blocks_load():
    """A key file example loads as the service reads one, each entry with its settings."""
    from serving.security import load_keys

    for code in codes("keyfile"):
        keys = load_keys(code.splitlines())
        assert len(keys) == len(code.strip().splitlines())
        assert any(p.priority or p.images_per_day for p in keys.values())


def test_json_blocks_parse():
    for b in blocks():
        if claimed(b) != "json":
            continue
        data = json.loads(b.code)
        if "maxdiff.json" in b.before:  # an example of a model folder's maxdiff.json
            from pipelines.config import ModelDefaults

            ModelDefaults.model_validate(data)


def test_yaml_blocks_are_valid_configs():
    """A ```yaml block parses; a Serve config (``applications:``) is valid for Ray Serve's own
    schema and its maxdiff apps' args for ServeSettings; a Kubernetes manifest names its kind."""
    import yaml

    for b in blocks():
        if claimed(b) != "yaml":
            continue
        data = yaml.safe_load(b.code)
        assert isinstance(data, dict), f"{b.page}: {first_line(b.code)}"
        if "applications" in data:
            from ray.serve.schema import ServeDeploySchema

            from serving.settings import ServeSettings

            ServeDeploySchema.model_validate(data)
            for app in data["applications"]:
                if app["import_path"] == "serving.app:build_app":
                    ServeSettings.from_args(app.get("args") or {})
        elif "apiVersion" in data:
            assert data.get("kind"), f"{b.page}: a manifest without kind"
        else:  # a fragment of serve args
            from serving.settings import ServeSettings

            ServeSettings.from_args(data)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def test_links_lead_somewhere():
    """Every relative link of every page names a file of the repository (and an anchor of a
    page, a heading of it); the README links every docs page."""
    bad = []
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.name}: {target} (no such heading)")
    assert not bad, bad
    readme = (ROOT / "README.md").read_text()
    unlinked = [p.name for p in PAGES[1:] if f"(docs/{p.name}" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


# ---------------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """Work folder and path substitutions: "an SDXL folder" becomes a tiny random one with
    SDXL's VAE scale factor of 8 (so SDXL-sized examples stay cheap)."""
    import tiny

    work = tmp_path_factory.mktemp("readme")
    sdxl_dir = work / "tiny-sdxl-f8"
    tiny.make_sdxl_pipeline(sdxl_dir, vae_config=tiny.VAE_F8)
    unet = sdxl_dir / "unet" / "diffusion_pytorch_model.safetensors"
    lora_1 = tiny.make_sdxl_lora(sdxl_dir, work / "pixel-art-xl.safetensors", seed=1)
    tiny.make_sdxl_lora(sdxl_dir, work / "lora-folder" / "pytorch_lora_weights.safetensors", seed=2)
    controlnet = work / "controlnet-canny-sdxl-1.0"
    tiny.make_controlnet(controlnet, tiny.SDXL_UNET)
    tiny.make_controlnet(work / "controlnet-depth-sdxl-1.0", tiny.SDXL_UNET, seed=1)
    tiny.make_sdxl_refiner(work / "sdxl-refiner", vae_config=tiny.VAE_F8)
    subs = [  # longest first
        ("/models/stable-diffusion-xl-base-1.0", str(sdxl_dir)),
        ("stable-diffusion-xl-base-1.0", str(sdxl_dir)),
        ("/models/sdxl_lightning_4step_unet.safetensors", str(unet)),
        ("sdxl_lightning_4step_unet.safetensors", str(unet)),
        ("/models/controlnet-canny-sdxl-1.0", str(controlnet)),
        ("/models/controlnet-depth-sdxl-1.0", str(work / "controlnet-depth-sdxl-1.0")),
        ("/models/sdxl-base-bf16", str(work / "sdxl-base-bf16")),
        ("/models/pixel-art-xl.safetensors", str(lora_1)),
        ("/models/lora-folder", str(work / "lora-folder")),
        ("/models/sdxl-base.safetensors", str(work / "sdxl-base.safetensors")),
        ("/models/sdxl-refiner", str(work / "sdxl-refiner")),
        ("/models/sdxl-base", str(sdxl_dir)),
        ("/tmp/tiny-sdxl", str(work / "tiny-sdxl")),
        ("/tmp/tiny-out", str(work / "tiny-out")),
    ]
    return work, subs


def localize(code: str, subs) -> str:
    for old, new in subs:
        code = code.replace(old, new)
    assert "/models/" not in code, code
    return code


def env() -> dict:
    e = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    e.pop("MAXDIFF_DEFAULT_MODEL", None)
    return e


def run_bash(code: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=cwd, env=env(),
                         capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{code}\n--- stderr ---\n{res.stderr[-4000:]}"
    return res


def run_python(code: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env(), capture_output=True,
                         text=True, timeout=timeout)
    assert res.returncode == 0, f"{code}\n--- stderr ---\n{res.stderr[-4000:]}"
    return res


# ---------------------------------------------------------------------------------- runners
def test_make_demo():
    """``make demo`` writes the embedded model's 64x64 images and a contact sheet to out/demo and
    says where (the one run of the demo in the default suite)."""
    from PIL import Image

    ran, start = [], time.time() - 1
    for line in the("make").splitlines():
        cmd = line.split("#")[0].strip()
        if not cmd or cmd in NOT_RUN_LINES:
            continue
        res = run_bash(cmd, ROOT)
        ran.append(cmd)
    assert ran == ["make demo"]
    out = ROOT / "out" / "demo"
    assert "contact sheet: out/demo/contact_sheet.png" in res.stdout, res.stdout
    fresh = [p for p in out.glob("*.png") if p.stat().st_mtime >= start]  # not an earlier run's
    assert out / "contact_sheet.png" in fresh and len(fresh) >= 6, sorted(fresh)
    assert Image.open(min(p for p in fresh if p.name != "contact_sheet.png")).size == (64, 64)
    # the README's picture is this command's contact sheet (other CPUs may round a few pixels
    # differently: bounds fixed before the first comparison)
    import numpy as np

    made = np.asarray(Image.open(out / "contact_sheet.png").convert("RGB"), int)
    shown = np.asarray(Image.open(ROOT / "docs" / "demo.png").convert("RGB"), int)
    assert made.shape == shown.shape
    diff = np.abs(made - shown)
    assert diff.max() <= 8 and diff.mean() <= 0.5, (diff.max(), diff.mean())


@pytest.mark.slow  # a fresh venv from the package index (minutes): make test-slow runs it
def test_make_demo_on_a_fresh_clone_installs_only_what_it_needs(tmp_path):
    """A fresh clone's ``make demo`` installs the package and its own dependencies, none of the
    test / serve extras (no torch, diffusers, Ray, playwright; optax comes with flax), and draws the
    images; its time and the venv's size are printed (docs/development.md quotes them)."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    t0 = time.perf_counter()
    res = run_bash("make demo", clone, timeout=1800)
    took = time.perf_counter() - t0
    assert "contact sheet: out/demo/contact_sheet.png" in res.stdout, res.stdout
    listed = subprocess.run([str(clone / ".venv/bin/python"), "-m", "pip", "list",
                             "--format=json"], capture_output=True, text=True, check=True)
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert not names & {"torch", "diffusers", "ray", "playwright", "pytest", "compel"}, names
    size = sum(f.stat().st_size for f in (clone / ".venv").rglob("*") if f.is_file())
    print(f"fresh clone: make demo {took:.0f} s, .venv {size / 2**20:.0f} MiB, "
          f"{len(names)} packages")


def test_python_examples(paths):
    """The front door's, the models page's and the Python API page's snippets, in page order, as
    one session would."""
    work, subs = paths
    from maxdiff import single_file

    if not (work / "sdxl-base.safetensors").is_file():  # the single file the examples read
        single_file.export(work / "tiny-sdxl-f8", work / "sdxl-base.safetensors")
    code = "\n".join(localize(the_code, subs) for the_code in codes("python"))
    # a cold compilation cache (a clean clone) compiles a few dozen programs of the tiny and
    # embedded models here: 447 s alone on this 2-core machine, more beside another worker
    run_python(code + "\nprint('seeds', out.seeds)", work, timeout=1200)
    assert (work / "astronaut.png").is_file()
    from PIL import Image

    assert Image.open(work / "circle.png").size == (64, 64)  # the embedded model's size


@pytest.mark.slow  # default-suite time (45 s; tests/test_cli.py covers the CLI): make test-slow
def test_cli_examples(paths):
    work, subs = paths
    jobs = the("jobs")
    (work / "jobs.jsonl").write_text(jobs)
    (work / "prompts.txt").write_text("a red circle\na blue square on white\n")
    (work / "sdxl-base.safetensors").unlink(missing_ok=True)  # the example writes it
    for code in codes("cli"):  # the front door's, then the CLI page's
        run_bash(localize(code, subs), work)
    circles = [json.loads(line) for line in (work / "out" / "circles" / "metadata.jsonl").open()]
    assert [r["size"] for r in circles] == ["64x64", "64x64"]  # the embedded model's size
    assert len(list((work / "out" / "demo").glob("*.png"))) == 4
    assert len(list((work / "out" / "shapes").glob("*.png"))) == 1
    edit = [json.loads(line) for line in (work / "out" / "edit" / "metadata.jsonl").open()]
    assert [(r["mode"], r["strength"], r["size"]) for r in edit] == [("img2img", 0.6, "128x96")]
    assert len(list((work / "out" / "run1").glob("*.webp"))) == 2
    run2 = [json.loads(line) for line in (work / "out" / "run2" / "metadata.jsonl").open()]
    assert len(run2) == 4 and {r["steps"] for r in run2} == {4}
    assert {r["size"] for r in run2} >= {"768x1024"}
    assert (work / "sdxl-base-bf16" / "model_index.json").is_file()
    assert len(list((work / "out" / "file").glob("*.png"))) == 1  # from the single file
    statue = [json.loads(line) for line in (work / "out" / "statue" / "metadata.jsonl").open()]
    assert [(r["mode"], r["size"]) for r in statue] == [("controlnet", "128x96")]  # edges.png's
    refined = [json.loads(line) for line in (work / "out" / "refined" / "metadata.jsonl").open()]
    assert [r["refiner"] for r in refined] == [f"{(work / 'sdxl-refiner').resolve()}:0.8"]


@pytest.mark.slow  # default-suite time (14-23 s): make test-slow runs it
def test_tiny_checkpoint_example(paths):
    work, subs = paths
    run_bash(localize(the("tiny"), subs), ROOT)
    assert len(list((work / "tiny-out").glob("*.png"))) == 2


# ---------------------------------------------------------------------------------- service
def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _wait_for_port(seconds: float) -> None:
    """Until PORT is free or ``seconds`` pass: a stopped ``serve run`` lets its Ray's HTTP proxy
    go a while after the command exits (longer on a busy machine: the suite's other worker)."""
    deadline = time.monotonic() + seconds
    while not _port_free(PORT) and time.monotonic() < deadline:
        time.sleep(0.5)


class Served:
    """``serve run ...`` as a user starts it, until /healthz answers 200."""

    def __init__(self, command: str, cwd: Path):
        _wait_for_port(60)  # the example before this one may still be shutting its Ray down
        if not _port_free(PORT):
            pytest.fail(f"port {PORT} is taken: the pages' service examples need it free")
        self.log = open(cwd / f"serve-{time.monotonic_ns()}.log", "w+")
        # its own Ray, as on a machine without one: `serve run` would otherwise join any Ray
        # cluster running on this machine (another test run's) and shut its Serve down on exit
        self.proc = subprocess.Popen(["bash", "-c", f"exec env {command}"], cwd=ROOT,
                                     env=dict(env(), RAY_ADDRESS="local"),
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            deadline = time.monotonic() + 420
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, self.tail()
                try:
                    if requests.get(f"http://localhost:{PORT}/healthz", timeout=5).status_code == 200:
                        return
                except (requests.ConnectionError, requests.Timeout):  # starting, or a busy machine
                    pass
                time.sleep(1)
            pytest.fail(f"{command} never became healthy:\n{self.tail()}")
        except BaseException:
            self.stop()
            raise

    def tail(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        _wait_for_port(60)


def _serve_line(subs, start: str) -> str:
    """The first ``serve run`` line of the pages that starts with ``start``, without its comment."""
    lines = [line.split("  #")[0].strip() for code in codes("serve") for line in code.splitlines()]
    return next(localize(line, subs) for line in lines if line.startswith(start))


def _curl_examples(work: Path) -> None:
    """Every curl block of the pages, against the running service."""
    for code in codes("curl"):
        run_bash(code, work)


@pytest.mark.slow  # default-suite time (44 s; tests/service/ covers the service)
def test_serve_run_with_a_model_folder_and_curl(paths):
    work, subs = paths
    served = Served(_serve_line(subs, "serve run serving.app:build_app model="), work)
    try:
        _curl_examples(work)
        from PIL import Image

        assert Image.open(work / "circle.png").size == (128, 128)
        im = Image.open(work / "cat.png")
        assert im.format == "PNG" and im.size == (128, 128)  # the tiny model's native size
        assert Image.open(work / "dog.png").size == (128, 128)  # /v1/edit keeps the size
        assert json.loads((work / "edit.json").read_text())["size"] == "128x128"
    finally:
        served.stop()


@pytest.mark.slow  # default-suite time: make test-slow runs it
def test_serve_yaml_openai_curl_and_a_size_too_large(paths):
    """``serve run configs/serve.yaml`` on the embedded model: the OpenAI and curl examples as
    written; then the most common OpenAI size, far above what the model is for, is a prompt
    422 naming the limit, and the service keeps serving; the official openai client streaming
    with partial_images gets partial images and the completed one (engine=batch)."""
    work, subs = paths
    served = Served(_serve_line(subs, "serve run configs/serve.yaml"), work)
    try:
        printed = [run_python(code, work).stdout.split() for code in codes("openai")]
        assert printed == [["2", "64x64"], ["2", "64x64", "64x64"]]  # README's, then the service page's
        _curl_examples(work)
        from PIL import Image

        assert Image.open(work / "circle.png").size == (64, 64)
        import openai

        client = openai.OpenAI(base_url=f"http://localhost:{PORT}/v1", api_key="unused",
                               max_retries=0)
        t0 = time.monotonic()
        with pytest.raises(openai.UnprocessableEntityError) as err:
            client.images.generate(prompt="a red circle", size="1024x1024")
        assert time.monotonic() - t0 < 10
        assert re.search(r"between \d+ and 256 \(this model's maxdiff.json max_size", str(err.value)), \
            err.value
        assert "max_size" in str(err.value)
        t0 = time.monotonic()
        assert len(client.images.generate(prompt="a red circle", size="64x64").data) == 1
        assert time.monotonic() - t0 < 60
        # streamed with partial images from the default (engine=batch) server: previews too
        got = [e.type for e in client.images.generate(prompt="a red circle", stream=True,
                                                      partial_images=2)]
        assert got.count("image_generation.partial_image") >= 1, got
        assert got[-1] == "image_generation.completed", got
    finally:
        served.stop()


@pytest.mark.slow  # default-suite time: make test-slow runs it
def test_api_keys_example(paths):
    """The security section's two lines: a hashed key file, then the service with keys on."""
    work, subs = paths
    keys = str(work / "keys.txt")
    write, start = [localize(line, subs).replace("keys.txt", keys)
                    for line in the("keys").strip().splitlines()]
    run_bash(write, work)
    assert open(keys).read().startswith("sha256:") and "my-secret-key" not in open(keys).read()
    served = Served(start, work)
    try:
        import openai

        url = f"http://localhost:{PORT}/v1"
        ok = openai.OpenAI(base_url=url, api_key="my-secret-key", max_retries=0)
        assert len(ok.images.generate(prompt="a red circle").data) == 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="guess", max_retries=0).images.generate(
                prompt="a red circle")
        assert requests.get(f"http://localhost:{PORT}/healthz").status_code == 200
    finally:
        served.stop()
