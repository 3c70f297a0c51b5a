"""Soak test: the service at a steady fraction of its measured capacity for minutes.

    python -m benchmarks.soak [--minutes 10] [--load 0.8] [--model DIR] [--port 8011]

Starts a local Ray Serve with the service (the embedded model unless ``--model``), measures its
capacity (closed loop, ``2 x max_batch_size`` clients, 60 s), then sends requests at ``--load``
of that rate as a Poisson process (open loop: arrivals do not wait for answers) for
``--minutes``. Reports errors (any answer but 200, or no answer), p50/p90/p99 latency and the
generator replica's resident memory at the start and the end of the soak (growth target: under
10 %), sampled from ``/proc`` every 10 s. Not a test (it takes minutes and wants an idle
machine); figures go to ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import threading
import time

import numpy as np
import requests


def _rss_mib(pid: int) -> float | None:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _one(url: str, i: int, timeout: float) -> tuple[int, float]:
    t0 = time.perf_counter()
    try:
        r = requests.post(f"{url}/v1/generate", json={"prompt": "a red circle on a blue "
                          "background", "seed": i}, timeout=timeout)
        code = r.status_code
    except requests.RequestException:
        code = -1
    return code, time.perf_counter() - t0


def capacity(url: str, clients: int, seconds: float) -> float:
    """Requests per second with ``clients`` closed-loop clients."""
    stop = time.monotonic() + seconds
    done = []

    def client(k):
        i = k * 1_000_000
        while time.monotonic() < stop:
            code, _ = _one(url, i, 120)
            if code == 200:
                done.append(time.monotonic())
            i += 1

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(done) / (time.monotonic() - t0)


def soak(url: str, rate: float, seconds: float, pid: int, timeout: float) -> dict:
    rng = random.Random(0)
    futures, memory = [], []
    t_end = time.monotonic() + seconds
    next_sample = 0.0
    with cf.ThreadPoolExecutor(max_workers=256) as pool:
        i, t = 0, time.monotonic()
        while t < t_end:
            if t >= next_sample:
                memory.append((round(seconds - (t_end - t), 1), _rss_mib(pid)))
                next_sample = t + 10
            futures.append(pool.submit(_one, url, i, timeout))
            i += 1
            t += rng.expovariate(rate)
            time.sleep(max(0.0, t - time.monotonic()))
        results = [f.result() for f in futures]
    memory.append((round(seconds, 1), _rss_mib(pid)))
    codes: dict[str, int] = {}
    for code, _ in results:
        codes[str(code)] = codes.get(str(code), 0) + 1
    lat = np.array([s for code, s in results if code == 200])
    first, last = memory[0][1], memory[-1][1]
    return {"requests": len(results), "codes": codes,
            "errors": sum(n for c, n in codes.items() if c != "200"),
            "latency_s": {q: round(float(np.percentile(lat, p)), 3) if lat.size else None
                          for q, p in (("p50", 50), ("p90", 90), ("p99", 99))},
            "rss_mib_start": first, "rss_mib_end": last,
            "rss_growth_pct": round(100 * (last - first) / first, 1) if first and last else None,
            "rss_samples": memory}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--load", type=float, default=0.8, help="fraction of measured capacity")
    ap.add_argument("--model", default=None, help="diffusers SDXL folder (default: embedded)")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--capacity-seconds", type=float, default=60.0)
    ap.add_argument("--max-batch-size", type=int, default=8)
    a = ap.parse_args(argv)

    import ray
    from ray import serve

    from serving.app import build_app

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": a.port})
    args = {"max_batch_size": a.max_batch_size, "max_queued_requests": 256, "num_cpus": 1,
            "ingress_num_cpus": 0, "request_timeout_s": 120}
    if a.model:
        args["model"] = a.model
    serve.run(build_app(args), name="soak", route_prefix="/")
    url = f"http://127.0.0.1:{a.port}"
    try:
        pid = next(iter(requests.get(f"{url}/v1/stats").json()["replicas"].values()))["pid"]
        capacity(url, 2, 10)  # warm the routes and the batch sizes up
        cap = capacity(url, 2 * a.max_batch_size, a.capacity_seconds)
        rate = a.load * cap
        print(f"capacity {cap:.2f} req/s; soaking at {rate:.2f} req/s for {a.minutes:g} min",
              flush=True)
        res = soak(url, rate, a.minutes * 60, pid, 120)
        res.update(capacity_rps=round(cap, 3), rate_rps=round(rate, 3), minutes=a.minutes,
                   load=a.load, model=a.model or "embedded")
        print(json.dumps(res))
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
