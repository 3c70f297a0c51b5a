"""The KubeRay manifests under deploy/: each RayService's serveConfigV2 is a valid Ray Serve
config (Ray Serve's own schema), is configs/serve.yaml's application with only the model and
placement args changed, parses as maxdiff's serve args, and asks Kubernetes for what its args
ask Ray for (accelerators per host, hosts per replica count, a grace period above the drain)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = sorted((ROOT / "deploy").glob("rayservice-*.yaml"))
# args a deployment sets for its hardware and model; every other arg equals configs/serve.yaml's
PLATFORM_ARGS = {"config", "model", "unet", "vae", "single_file_config", "resource",
                 "resource_amount", "num_replicas", "autoscaling", "warmup_shapes", "price_per_hour",
                 "max_replicas_per_node"}
ACCELERATOR = {"GPU": "nvidia.com/gpu", "TPU": "google.com/tpu"}


def test_there_is_a_gpu_and_a_tpu_manifest():
    assert {p.name for p in MANIFESTS} >= {"rayservice-gpu.yaml", "rayservice-tpu.yaml"}


@pytest.fixture(params=MANIFESTS, ids=lambda p: p.name)
def manifest(request):
    doc = yaml.safe_load(request.param.read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService")
    return doc


def test_serve_config_is_valid_and_is_the_shipped_one(manifest):
    from ray.serve.schema import ServeDeploySchema

    from serving.settings import ServeSettings

    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_config)  # raises on anything Ray Serve refuses
    shipped = yaml.safe_load((ROOT / "configs" / "serve.yaml").read_text())
    assert {k: v for k, v in serve_config.items() if k != "applications"} == {
        k: v for k, v in shipped.items() if k != "applications"}
    (app,), (want,) = serve_config["applications"], shipped["applications"]
    assert {k: v for k, v in app.items() if k != "args"} == {
        k: v for k, v in want.items() if k != "args"}
    args, want_args = app["args"], want["args"]
    assert set(args) - set(want_args) <= PLATFORM_ARGS, "an arg configs/serve.yaml lacks"
    assert set(want_args) - set(args) <= PLATFORM_ARGS - {"resource", "resource_amount"}
    differ = {k for k in set(args) & set(want_args) if args[k] != want_args[k]}
    assert differ <= PLATFORM_ARGS, f"{differ - PLATFORM_ARGS} differ from configs/serve.yaml"
    ServeSettings.from_args(args)  # maxdiff's own checks, every field


def test_pods_ask_for_what_the_replicas_need(manifest):
    import ray

    from serving.settings import ServeSettings

    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__  # the Ray the tests ran against
    (app,) = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    s = ServeSettings.from_args(app["args"])
    (group,) = cluster["workerGroupSpecs"]
    pod = group["template"]["spec"]
    (container,) = pod["containers"]
    resources = container["resources"]
    # the pod asks Kubernetes for whole replicas' accelerators, and Ray places that many on it
    chips = int(resources["requests"][ACCELERATOR[s.resource]])
    per_pod, rest = divmod(chips, int(s.resource_amount))
    assert rest == 0 and per_pod >= 1
    assert s.max_replicas_per_node == per_pod
    assert resources["limits"] == resources["requests"]
    hosts = group.get("numOfHosts", 1)
    if s.autoscaling_config is None:  # a fixed count: the replicas of every host of every slice
        assert s.num_replicas == per_pod * hosts * group["replicas"]
        assert group["minReplicas"] == group["maxReplicas"] == group["replicas"]
    else:  # replicas follow the load within what the worker group may grow to
        assert s.autoscaling_config["max_replicas"] == per_pod * hosts * group["maxReplicas"]
        assert s.autoscaling_config["min_replicas"] <= per_pod * hosts * group["minReplicas"]
        assert cluster["enableInTreeAutoscaling"] is True
    # a pod being removed gives its replica time to drain
    assert pod["terminationGracePeriodSeconds"] > s.graceful_shutdown_s
    # the compile cache is on a volume every pod mounts (a cold replica reads its programs)
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert any(env["MAXDIFF_COMPILE_CACHE"].startswith(m + "/") for m in mounts)
    # the model folder is mounted where the args say
    assert any(app["args"]["model"].startswith(m + "/") for m in mounts)
    # every Ray node exports metrics on the port the pods declare
    for spec in (cluster["headGroupSpec"], group):
        port = int(spec["rayStartParams"]["metrics-export-port"])
        ports = [p["containerPort"] for p in spec["template"]["spec"]["containers"][0]["ports"]]
        assert port in ports
    if s.resource == "TPU":  # the slice: its accelerator and topology, hosts x chips
        selector = pod["nodeSelector"]
        assert selector["cloud.google.com/gke-tpu-accelerator"].startswith("tpu-")
        topology = [int(x) for x in selector["cloud.google.com/gke-tpu-topology"].split("x")]
        chips = 1
        for x in topology:
            chips *= x
        assert chips == hosts * s.resource_amount


@pytest.mark.parametrize("name, extra", [("gpu", "cuda"), ("tpu", "tpu")])
def test_each_accelerator_has_a_dockerfile_on_its_manifests_ray(name, extra):
    """deploy/Dockerfile.{gpu,tpu} start from the Ray image of the manifest's rayVersion, are
    tagged as the manifest's pods' image, and install the accelerator's extra, which exists."""
    import tomllib

    doc = yaml.safe_load((ROOT / "deploy" / f"rayservice-{name}.yaml").read_text())
    docker = (ROOT / "deploy" / f"Dockerfile.{name}").read_text()
    version = doc["spec"]["rayClusterConfig"]["rayVersion"]
    assert f"rayproject/ray:{version}-" in docker
    images = {c["image"] for group in [doc["spec"]["rayClusterConfig"]["headGroupSpec"],
                                       *doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
              for c in group["template"]["spec"]["containers"]}
    assert len(images) == 1 and f"-t {images.pop()} ." in docker
    assert f"[serve,{extra}]" in docker
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras[extra] == [{"cuda": "jax[cuda13]>=0.4.35", "tpu": "jax[tpu]>=0.4.35"}[extra]]
