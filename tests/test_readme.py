"""Every example in README.md runs as written, with model paths pointed at small models.

Each fenced block of the README is claimed by exactly one runner below, or listed in
``NOT_RUN`` with the reason; a new example that no runner claims fails
:func:`test_every_readme_block_is_run`. Model paths (``/models/...``,
``stable-diffusion-xl-base-1.0``, ``sdxl_lightning_4step_unet.safetensors``, ``/tmp/tiny-*``)
are replaced by the tiny random checkpoint or temporary folders; nothing else is changed.
The service examples run against real ``serve run`` processes on port 8000, as a user would
start them.
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

import pytest
import requests

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent
PORT = 8000

# first line of a block -> why it is not run here
NOT_RUN = {
    "# head host (TPU VMs report a \"TPU\" resource = chips per host; GPU hosts report \"GPU\")":
        "starts Ray on several hosts (the same build_app placement args run on a local "
        "multi-node cluster in tests/service/test_generate.py)",
}
NOT_RUN_LINES = {
    "make test": "it is this test suite",
}


def blocks() -> list[tuple[str, str]]:
    """(language, code) of every fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in
            re.finditer(r"^```(\w*)\n(.*?)^```", README, re.S | re.M)]


def first_line(code: str) -> str:
    return code.strip().splitlines()[0].strip()


def claimed(lang: str, code: str) -> str | None:
    head = first_line(code)
    if head in NOT_RUN:
        return "not run"
    for name, test in RUNNERS.items():
        if test(lang, code):
            return name
    return None


RUNNERS = {
    "make": lambda lang, code: first_line(code).startswith("make demo"),
    "python": lambda lang, code: lang == "python" and "localhost:8000" not in code,
    "serve": lambda lang, code: first_line(code).startswith("serve run"),
    "openai": lambda lang, code: lang == "python" and "localhost:8000" in code,
    "curl": lambda lang, code: first_line(code).startswith("curl "),
    "cli": lambda lang, code: first_line(code).startswith("MODEL="),
    "jobs": lambda lang, code: first_line(code) == "# jobs.jsonl",
    "tiny": lambda lang, code: "tiny.make_sdxl_pipeline" in code,
    "keys": lambda lang, code: "MAXDIFF_API_KEYS=" in code,
}


def test_every_readme_block_is_run():
    found = blocks()
    assert len(found) >= 10
    unclaimed = [first_line(c) for lang, c in found if claimed(lang, c) is None]
    assert not unclaimed, f"README blocks that no test runs: {unclaimed}"
    names = {claimed(lang, c) for lang, c in found}
    assert names >= set(RUNNERS), f"runners whose block left the README: {set(RUNNERS) - names}"


def the(name: str) -> str:
    code, = [c for lang, c in blocks() if claimed(lang, c) == name]
    return code


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
    subs = [  # longest first
        ("/models/stable-diffusion-xl-base-1.0", str(sdxl_dir)),
        ("stable-diffusion-xl-base-1.0", str(sdxl_dir)),
        ("/models/sdxl_lightning_4step_unet.safetensors", str(unet)),
        ("sdxl_lightning_4step_unet.safetensors", str(unet)),
        ("/models/sdxl-base-bf16", str(work / "sdxl-base-bf16")),
        ("/models/pixel-art-xl.safetensors", str(lora_1)),
        ("/models/lora-folder", str(work / "lora-folder")),
        ("/models/sdxl-base.safetensors", str(work / "sdxl-base.safetensors")),
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
    for line in the("make").splitlines():
        cmd = line.split("#")[0].strip()
        if not cmd or cmd in NOT_RUN_LINES:
            continue
        res = run_bash(cmd, ROOT)
        assert "contact sheet:" in res.stdout


def test_python_examples(paths):
    """The library, Python API and Lightning snippets, in order, as one session would."""
    work, subs = paths
    from maxdiff import single_file

    if not (work / "sdxl-base.safetensors").is_file():  # the single file the examples read
        single_file.export(work / "tiny-sdxl-f8", work / "sdxl-base.safetensors")
    code = "\n".join(localize(the_code, subs) for lang, the_code in blocks()
                     if claimed(lang, the_code) == "python")
    run_python(code + "\nprint('seeds', out.seeds)", work)
    assert (work / "astronaut.png").is_file()


@pytest.mark.slow  # default-suite time (45 s; tests/test_cli.py covers the CLI): make test-slow
def test_cli_examples(paths):
    work, subs = paths
    jobs = the("jobs")
    (work / "jobs.jsonl").write_text(jobs)
    (work / "prompts.txt").write_text("a red circle\na blue square on white\n")
    (work / "sdxl-base.safetensors").unlink(missing_ok=True)  # the example writes it
    run_bash(localize(the("cli"), subs), work)
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


@pytest.mark.slow  # default-suite time (14-23 s): make test-slow runs it
def test_tiny_checkpoint_example(paths):
    work, subs = paths
    run_bash(localize(the("tiny"), subs), ROOT)
    assert len(list((work / "tiny-out").glob("*.png"))) == 2


# ---------------------------------------------------------------------------------- service
def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


class Served:
    """``serve run ...`` as a user starts it, until /healthz answers 200."""

    def __init__(self, command: str, cwd: Path):
        if not _port_free(PORT):
            pytest.fail(f"port {PORT} is taken: the README's service examples need it free")
        self.log = open(cwd / f"serve-{time.monotonic_ns()}.log", "w+")
        self.proc = subprocess.Popen(["bash", "-c", f"exec env {command}"], cwd=ROOT, env=env(),
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 420
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.tail()
            try:
                if requests.get(f"http://localhost:{PORT}/healthz", timeout=5).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(1)
        self.stop()
        pytest.fail(f"{command} never became healthy:\n{self.tail()}")

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
        deadline = time.monotonic() + 30
        while not _port_free(PORT) and time.monotonic() < deadline:
            time.sleep(0.5)


def _serve_lines(subs) -> list[str]:
    lines = [line.split("  #")[0].strip() for line in the("serve").splitlines()]
    return [localize(line, subs) for line in lines if line]


@pytest.mark.slow  # default-suite time (44 s; tests/service/ covers the service)
def test_serve_run_with_a_model_folder_and_curl(paths):
    work, subs = paths
    served = Served(_serve_lines(subs)[0], work)
    try:
        run_bash(the("curl"), work)
        from PIL import Image

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
    422 naming the limit, and the service keeps serving."""
    work, subs = paths
    served = Served(_serve_lines(subs)[1], work)
    try:
        res = run_python(the("openai"), work)
        assert res.stdout.split() == ["2", "64x64", "64x64"]
        run_bash(the("curl"), work)
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
