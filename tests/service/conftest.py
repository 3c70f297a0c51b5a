"""One local Ray cluster for the service tests, and the applications they share.

The cluster: a head node and two "hosts" with one unit each of a custom ``maxdiff_host``
resource (the multi-host test places one replica on each). The main application (one generator
replica, tiny checkpoint) serves most tests; ``guarded`` adds API keys, a rate limit, CORS and
tight limits; ``step_app`` runs engine=step (with a second model); ``multi_app`` serves two models
on two replicas, priced. Replicas share a JAX compilation cache (``MAXDIFF_COMPILE_CACHE``), so
only the first replica compiles cold. Each application is deployed once (per pytest-xdist
worker: tests/conftest.py splits the package into two groups by the applications they use), when
a test first asks for it, and lives as long as the package runs: a deployment (replica
processes, model loads, warm-up) is what these tests spend most of their time on, so modules
share one wherever their serve args agree, and read the counters of ``/v1/stats`` as
differences (another module may have used the application before)."""

from __future__ import annotations

import os
import time
import types

import pytest
import requests
import tiny

from .helpers import (
    GUARDED_ARGS,
    KEY_A,
    KEY_B,
    KEY_HIGH,
    KEY_LOW,
    KEY_QUOTA,
    MAIN_ARGS,
    MODEL_A,
    MODEL_B,
    MULTI_ARGS,
    QUOTA_IMAGES,
    STEP_ARGS,
    STEP_MODEL,
    STEPS,
    free_port,
)


@pytest.fixture(scope="package")
def cluster(compile_cache):
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    cache = compile_cache  # the run's: the replicas start with the programs already compiled
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "include_dashboard": False,
        "_system_config": {"metrics_report_interval_ms": 1000}})
    hosts = [c.add_node(num_cpus=1, resources={"maxdiff_host": 1}) for _ in range(2)]
    ray.init(address=c.address, log_to_driver=False,
             runtime_env={"env_vars": {"MAXDIFF_COMPILE_CACHE": str(cache),
                                       "XLA_FLAGS": os.environ["XLA_FLAGS"],
                                       "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS":
                                           os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]}})
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    try:
        yield types.SimpleNamespace(url=f"http://127.0.0.1:{port}", cache=cache,
                                    nodes=[c.head_node, *hosts],
                                    host_node_ids={h.node_id for h in hosts})
    finally:
        serve.shutdown()
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="package")
def main_app(cluster, sdxl_dir, tmp_path_factory):
    """The main application, deployed without waiting; /healthz and /v1/generate are probed
    while the generator replica loads and compiles, then until it is ready. Its output store
    and jobs database are this run's (``outputs``, ``jobs_db``)."""
    from ray import serve

    from serving.app import build_app

    url = cluster.url
    store = tmp_path_factory.mktemp("outputs")
    jobs_db = tmp_path_factory.mktemp("jobs") / "jobs.sqlite"
    serve._run(build_app({"model": str(sdxl_dir), **MAIN_ARGS, "output_store": str(store),
                          "jobs_db": str(jobs_db)}), _blocking=False, name="main",
               route_prefix="/")
    probes, early_generate = [], None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            r = requests.get(f"{url}/healthz", timeout=10)
            probes.append((r.status_code, r.headers.get("content-type", ""), r.text,
                           r.headers.get("retry-after")))
            if r.status_code == 200:
                break
            if r.status_code == 503 and early_generate is None and "warming_up" in r.text:
                early_generate = requests.post(f"{url}/v1/generate", json={"prompt": "early"},
                                               timeout=30)
        except requests.ConnectionError:
            probes.append(("connection refused", "", "", None))
        except requests.Timeout:  # a busy machine: the replica still loading, keep probing
            probes.append(("timed out", "", "", None))
        time.sleep(0.25)
    else:
        pytest.fail(f"the main app never became healthy; last probes: {probes[-3:]}")
    yield types.SimpleNamespace(url=url, probes=probes, early_generate=early_generate,
                                outputs=store, jobs_db=jobs_db)
    serve.delete("main")


@pytest.fixture(scope="package")
def pipe(cluster, sdxl_dir):
    """The Python API in this process, sharing the replicas' compilation cache."""
    import jax

    from pipelines import TextToImagePipeline

    before = (jax.config.jax_compilation_cache_dir,
              jax.config.jax_persistent_cache_min_compile_time_secs)
    yield TextToImagePipeline.from_pretrained(sdxl_dir, compile_cache_dir=cluster.cache)
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])


@pytest.fixture(scope="package")
def guarded(cluster, sdxl_dir, tmp_path_factory):
    """API keys from a file (one plain, one hashed; one with a priority class above the
    others', one with a daily quota), a rate limit, CORS for one origin, limits that leave few
    shapes (32x32, at most 2 steps, one image) so fuzzing stays cheap."""
    from ray import serve

    from serving.app import build_app
    from serving.security import hash_key

    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# maxdiff API keys\n{KEY_A}\n\nsha256:{hash_key(KEY_B)}\n"
                    f"{KEY_HIGH} priority=10\n{KEY_LOW}\n"
                    f"sha256:{hash_key(KEY_QUOTA)} images_per_day={QUOTA_IMAGES}\n")
    state = tmp_path_factory.mktemp("guarded-state")  # jobs, usage and stored images
    serve.run(build_app({"model": str(sdxl_dir), **GUARDED_ARGS, "api_keys": str(keys),
                         "jobs_db": str(state / "db.sqlite"),
                         "output_store": str(state / "outputs")}),
              name="guarded", route_prefix="/guarded")
    yield f"{cluster.url}/guarded"
    serve.delete("guarded")


@pytest.fixture(scope="package")
def sdxl_b(tmp_path_factory):
    """A second tiny SDXL checkpoint: the same shapes as ``sdxl_dir`` (so the two share compiled
    programs), other weights (torch seed 1)."""
    path = tmp_path_factory.mktemp("tiny-sdxl-b")
    tiny.make_sdxl_pipeline(path, seed=1)
    return path


@pytest.fixture(scope="package")
def step_controlnet(tmp_path_factory):
    """A tiny random ControlNet for ``sdxl_dir``'s UNet (control images 2x the latents, as the
    tiny VAE's images), served by ``step_app`` as ``canny``."""
    path = tmp_path_factory.mktemp("step-cn") / "canny"
    tiny.make_controlnet(path, tiny.SDXL_UNET, seed=5, conditioning_embedding_out_channels=(8, 16))
    return path


@pytest.fixture(scope="package")
def step_app(cluster, sdxl_dir, sdxl_b, step_controlnet):
    """An engine=step application (two slots per engine; the default model's engines warmed up
    at SIZE and BIG), serving ``sdxl_dir`` as tiny-sdxl (the default, with ``step_controlnet``
    as ControlNet ``canny``) and ``sdxl_b`` as ``MODEL_B`` (loaded by the first request that
    names it, on the same replica)."""
    from ray import serve

    from serving.app import build_app

    models = [{"name": "tiny-sdxl", "model": str(sdxl_dir), **STEP_MODEL,
               "controlnets": {"canny": str(step_controlnet)}},
              {"name": MODEL_B, "model": str(sdxl_b), **STEP_MODEL}]
    serve.run(build_app({**STEP_ARGS, "models": models}), name="step", route_prefix="/step")
    yield f"{cluster.url}/step"
    serve.delete("step")


@pytest.fixture(scope="package")
def multi_app(cluster, sdxl_dir, sdxl_b):
    """Three models behind one endpoint (``MODEL_A``: ``sdxl_dir``, the default; ``MODEL_B``:
    ``sdxl_b``, 3 default steps; ``tiny-int8``: ``sdxl_dir`` quantized to int8) on two
    generator replicas that keep one model each, priced
    (``price_per_hour``, a stats window longer than the application's life). ``started`` and
    ``returned``: unix times the deploy began and returned."""
    from ray import serve

    from serving.app import build_app

    args = dict(MULTI_ARGS, models=[
        {"name": MODEL_A, "model": str(sdxl_dir), "steps": STEPS, "guidance": 0.0},
        {"name": MODEL_B, "model": str(sdxl_b), "steps": 3, "guidance": 0.0},
        # test_multi_model's int8 case (loaded only by its last test)
        {"name": "tiny-int8", "model": str(sdxl_dir), "quantization": "int8", "steps": STEPS,
         "guidance": 0.0}])
    started = time.time()
    serve.run(build_app(args), name="multi", route_prefix="/multi")
    yield types.SimpleNamespace(url=f"{cluster.url}/multi", started=started,
                                returned=time.time())
    serve.delete("multi")
