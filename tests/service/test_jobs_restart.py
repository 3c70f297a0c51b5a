"""Jobs across a restart of their application (slow: two deployments): 50 jobs through a real
Ray Serve application, one cancelled, the application deleted and deployed again while most are
queued. Every job ends succeeded, cancelled, or failed with the reason (``job_interrupted``);
none stays queued or running; every job's webhook arrives, signed."""

from __future__ import annotations

import time

import pytest
import requests

from .helpers import MAIN_ARGS
from .test_jobs import DONE, Receiver

pytest.importorskip("ray.serve")

N = 50


def _deploy(cluster, sdxl_dir, store, db):
    from ray import serve

    from serving.app import build_app

    serve.run(build_app({"model": str(sdxl_dir), **MAIN_ARGS, "model_name": "jobs",
                         "max_running_jobs": 1, "output_store": str(store),
                         "jobs_db": str(db), "webhook_backoff_s": 0.5}),
              name="jobs", route_prefix="/jobs")
    return f"{cluster.url}/jobs"


@pytest.mark.slow
def test_jobs_end_with_a_reason_across_a_restart(cluster, sdxl_dir, tmp_path):
    from ray import serve
    from standardwebhooks.webhooks import Webhook

    store, db = tmp_path / "outputs", tmp_path / "jobs.sqlite"
    url = _deploy(cluster, sdxl_dir, store, db)
    hook = Receiver()
    try:
        ids = [requests.post(f"{url}/v1/jobs", json={
            "endpoint": "/v1/generate", "webhook": hook.url,
            "body": {"prompt": f"job {i}", "seed": i, "num_images": 2}},
            timeout=60).json()["id"] for i in range(N)]
        cancelled = requests.delete(f"{url}/v1/jobs/{ids[-1]}", timeout=30).json()
        assert cancelled["status"] == "cancelled"
        deadline = time.monotonic() + 120
        while sum(requests.get(f"{url}/v1/jobs/{i}", timeout=30).json()["status"] == "succeeded"
                  for i in ids[:10]) < 5:
            assert time.monotonic() < deadline, "no job finished"
            time.sleep(0.2)
        secret = requests.get(f"{url}/v1/webhooks/secret", timeout=30).json()["secret"]
        serve.delete("jobs")
        url = _deploy(cluster, sdxl_dir, store, db)
        finals, deadline = {}, time.monotonic() + 180
        while len(finals) < N and time.monotonic() < deadline:
            for i in ids:
                if i not in finals:
                    job = requests.get(f"{url}/v1/jobs/{i}", timeout=30).json()
                    if job["status"] in DONE:
                        finals[i] = job
            time.sleep(0.5)
        states = [finals[i]["status"] if i in finals else "unfinished" for i in ids]
        assert "unfinished" not in states, states
        assert states[-1] == "cancelled" and states.count("succeeded") >= 5, states
        failed = [finals[i] for i in ids if finals[i]["status"] == "failed"]
        assert failed, states  # most were queued when the application went
        assert all(f["error"]["error"]["code"] == "job_interrupted" for f in failed), failed[0]
        # the secret survives the restart (kept in the database); every job's webhook arrives
        assert requests.get(f"{url}/v1/webhooks/secret", timeout=30).json()["secret"] == secret
        deadline = time.monotonic() + 120
        while len({h["webhook-id"] for h, _ in hook.got}) < N and time.monotonic() < deadline:
            time.sleep(0.5)
        delivered = {}
        for headers, body in list(hook.got):
            job = Webhook(secret).verify(body, headers)
            delivered[job["id"]] = job["status"]
        assert delivered == {i: finals[i]["status"] for i in ids}
    finally:
        hook.close()
        serve.delete("jobs")
