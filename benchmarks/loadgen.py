"""The service under MLPerf Inference LoadGen: request-level (``engine=batch``) against
step-level (``engine=step``) batching, on the same replica settings and checkpoint, in one run.

    pip install mlcommons-loadgen        # (the `bench` extra)
    python -m benchmarks.loadgen [--engines batch step] [--workloads uniform mixed]
                                 [--step-policy fifo srs] [--rates QPS ...]
                                 [--p99-factor K | --p99 SECONDS] [--model DIR] [--quick]
                                 [--json PATH] [--logs DIR]

``--step-policy`` runs ``engine=step`` once per admission policy (serve arg ``step_policy``:
``fifo``, the default, reported as ``step``; ``srs``, shortest remaining steps first, reported
as ``step-srs``); compare their ``mixed`` rows (p50 / p99 latencies at equal load) on an idle
machine. ``--rates`` replaces Offline and the capacity search with Server runs at the given
rates, the same for every engine: the policy comparison (``--engines step --step-policy fifo
srs --workloads mixed --rates R1 R2``; run it in fresh processes, alternating the order).

For each engine, a local Ray Serve runs the service (the embedded model unless ``--model``;
one generator replica; every request shape of the workloads compiled at warm-up, so no
measurement pays for a compilation), and LoadGen drives it over HTTP through a
system-under-test that sends one ``POST /v1/generate`` per query (one image) and completes the
query when the answer arrives (any answer but 200 is counted as an error and reported).

Workloads (the model's default size):
- ``uniform``: every request 4 steps, guidance off (SDXL-Lightning-like traffic);
- ``mixed``: 4, 8 and 30 steps, each with guidance off and on (``--cfg`` guidance): the query
  library holds the six shapes in turn, and LoadGen draws each query's sample from it at random
  (so a sixth of each shape in expectation, in no fixed order), the way short and long requests
  arrive together in practice.

Scenarios:
- **Offline**: all queries issued at once; images/s. The system under test keeps at most
  ``--offline-concurrency`` requests in flight (default 4 x ``max_batch_size``: enough to fill
  every batch and every slot, with the next ones queued), as a batch client does; the first
  version sent all 192 at once, and on 2 cores the client's 192 threads, the proxy's
  connections and the router's retries took so much CPU from the model that its "Offline
  throughput" came out below the rate the same service sustained under Poisson arrivals.
  ``--offline-queries`` (480) makes the run long enough that its start (the first batches
  forming) and its end (the last, partial batches) weigh little: on uniform traffic through
  ``engine=batch``, 192 queries gave 16.3 images/s where 480 gave 17.9-18.7 at 16, 32 and 64
  requests in flight.
- **Server**: Poisson arrivals at a target rate; the capacity is the highest rate (bracketed
  from that engine's Offline rate by halving or doubling, then bisected; ``--search`` runs) whose
  p99 latency stays under the bound (LoadGen's "performance constraints satisfied"). The bound
  is ``--p99-factor`` (default 10) times the service time of the workloads' longest request (30
  steps with guidance) sent alone, measured through the service before the runs (median of 5),
  the same for both engines; ``--p99`` sets it in seconds instead. Ten times leaves room for a
  full batch of the longest shape and the queue ahead of it, and is short against a run's
  length, so an overloaded queue shows in the p99 within one run. A loose bound lets an
  overloaded queue pass: a run of T seconds at a rate r above the capacity c ends with a queue
  of about (r - c) T, so with a 10 s bound and 30 s runs (this script's first version) rates up
  to 1.33 c passed, and the published "capacity" exceeded the Offline throughput. Each Server
  run lasts ``--seconds`` and at least ``--min-queries`` queries (600: LoadGen's early stopping
  for a p99 needs 459 queries when none is over the bound, more otherwise), and holds when its
  p99 is under the bound, no request failed, and the service kept up: LoadGen's completed
  samples per second at least ``KEPT_UP`` (0.95) of its scheduled ones (a p99 bound alone let
  a run at 1.09 times the sustainable rate pass: its queue grew by the excess for a minute and
  had not yet reached the bound). LoadGen's early-stopping verdict and its overall
  VALID/INVALID are reported per run. Offline runs twice, before and after the capacity
  search (this shared machine's speed moves by a third within minutes), and the script checks
  that each capacity is at most the better of the two Offline throughputs of the same engine
  and workload, exiting with an error naming the rows that are not (a sustained rate cannot
  exceed the peak throughput).
  Then both engines run at the same rate (``--equal-load`` of the batch engine's capacity) and
  their p99 latencies are compared.

``--price-per-hour P`` (what the one generator replica's host costs per hour) adds the cost
per 1,000 images to each Offline run, ``P / 3600 / (images/s) x 1000``, the figure
``/v1/stats`` reports with the serve arg ``price_per_hour`` (:mod:`serving.cost`).

``--logs DIR`` keeps LoadGen's summary and detail logs of every run under
``DIR/<engine>/<workload>/<scenario>-<rate>/`` (the published runs are in ``docs/results/``).

Also the service's overhead: the same batch (``max_batch_size`` images, ``--overhead-steps``,
default 4 and 30) through the pipeline directly and through the service (all requests sent at
once), alternated, medians of ``--repeats``. On the embedded model's 64x64 a batch of 8 takes
0.1 s, so fixed per-request costs (HTTP, PNG, Ray hops) weigh a lot on 2 shared cores;
``--parts overhead --size 256 256`` measures it against a batch of seconds.

Not a test (minutes, and it wants an idle machine); figures go to ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import re
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import requests

from serving.cost import cost_per_1000_images

PROMPTS = ["a red circle on a blue background", "small green triangle, top left, white background",
           "a large yellow square on black", "a purple circle in the bottom right corner",
           "an orange triangle on a grey background", "a blue square, top right, on white"]
MIXED = [(4, False), (30, True), (8, False), (4, True), (30, False), (8, True)]
# a Server run holds only if LoadGen's completed rate is at least this share of its scheduled
# rate (a run that keeps up completes its last query a latency after the last issue: 1-3 s of
# a minute or more, so 0.95 leaves room; an overloaded run falls behind by its excess rate)
KEPT_UP = 0.95


def workload(name: str, n: int, cfg: float, size: tuple[int, int]) -> list[dict]:
    """``n`` request bodies for ``/v1/generate`` of ``size`` (width, height); seeds fixed, so a
    run repeats exactly."""
    out = []
    for i in range(n):
        steps, guided = (4, False) if name == "uniform" else MIXED[i % len(MIXED)]
        out.append({"prompt": PROMPTS[i % len(PROMPTS)], "seed": i, "steps": steps,
                    "guidance_scale": cfg if guided else 0.0, "width": size[0],
                    "height": size[1]})
    return out


class HttpSut:
    """LoadGen system-under-test: each query sample is one HTTP request, sent from a thread
    (at most ``concurrency`` in flight; the rest wait their turn) as soon as LoadGen issues it;
    completes the sample when the answer arrives."""

    def __init__(self, lg, url: str, bodies: list[dict], timeout: float, concurrency: int = 512):
        self.lg, self.url, self.bodies, self.timeout = lg, url, bodies, timeout
        self.pool = cf.ThreadPoolExecutor(max_workers=concurrency)
        self.latencies: list[float] = []
        self.codes: dict[str, int] = {}
        self.lock = threading.Lock()
        self.sut = lg.ConstructSUT(self.issue, self.flush)
        self.qsl = lg.ConstructQSL(len(bodies), len(bodies), lambda s: None, lambda s: None)

    def issue(self, samples) -> None:
        for s in samples:
            self.pool.submit(self._send, s.id, s.index)

    def _send(self, qid: int, index: int) -> None:
        t0 = time.perf_counter()
        try:
            code = str(requests.post(f"{self.url}/v1/generate", json=self.bodies[index],
                                     timeout=self.timeout).status_code)
        except requests.RequestException as e:
            code = type(e).__name__
        with self.lock:
            self.codes[code] = self.codes.get(code, 0) + 1
            if code == "200":
                self.latencies.append(time.perf_counter() - t0)
        self.lg.QuerySamplesComplete([self.lg.QuerySampleResponse(qid, 0, 0)])

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.lg.DestroyQSL(self.qsl)
        self.lg.DestroySUT(self.sut)
        self.pool.shutdown(wait=True)


def _summary(outdir: str) -> dict:
    text = (Path(outdir) / "mlperf_log_summary.txt").read_text()

    def num(label: str) -> float | None:
        m = re.search(re.escape(label) + r"\s*:\s*([0-9.eE+-]+)", text)
        return float(m.group(1)) if m else None

    def yes(label: str) -> bool:
        m = re.search(re.escape(label) + r"\s*:\s*(\w+)", text)
        return bool(m and m.group(1).lower() == "yes")

    valid = re.search(r"Result is\s*:\s*(\w+)", text)
    # "valid" here: the latency bound held (LoadGen's "performance constraints satisfied").
    # LoadGen's full VALID also needs its early-stopping criterion (459 queries for a p99 when
    # none is over the bound): reported beside it
    return {"valid": yes("Performance constraints satisfied"),
            "loadgen_result": valid.group(1) if valid else None,
            "early_stopping": yes("Early stopping satisfied"),
            "samples_per_s": num("Samples per second"),
            "scheduled_per_s": num("Scheduled samples per second"),
            "completed_per_s": num("Completed samples per second"),
            "p99_s": (num("99.00 percentile latency (ns)") or 0) / 1e9 or None,
            "p50_s": (num("50.00 percentile latency (ns)") or 0) / 1e9 or None}


def run_scenario(lg, url: str, bodies: list[dict], scenario: str, *, qps: float,
                 p99: float, seconds: float, min_queries: int, timeout: float,
                 logs: Path | None = None, concurrency: int = 512, tag: str = "") -> dict:
    settings = lg.TestSettings()
    settings.mode = lg.TestMode.PerformanceOnly
    if scenario == "offline":
        settings.scenario = lg.TestScenario.Offline
        settings.offline_expected_qps = qps
    else:
        settings.scenario = lg.TestScenario.Server
        settings.server_target_qps = qps
        settings.server_target_latency_ns = int(p99 * 1e9)
        settings.server_target_latency_percentile = 0.99
    settings.min_duration_ms = int(seconds * 1000)
    settings.min_query_count = min_queries
    settings.max_query_count = max(min_queries, int(qps * seconds * 1.5) + 1)
    if scenario == "server":  # the run lasts until both the duration and the count are met
        settings.max_query_count = max(settings.max_query_count, int(min_queries * 1.5) + 1)
    sut = HttpSut(lg, url, bodies, timeout, concurrency)
    with tempfile.TemporaryDirectory() as out:
        log = lg.LogSettings()
        log.log_output.outdir = out
        log.log_output.copy_summary_to_stdout = False
        t0 = time.perf_counter()
        lg.StartTestWithLogSettings(sut.sut, sut.qsl, settings, log)
        wall = time.perf_counter() - t0
        res = _summary(out)
        if logs is not None:
            keep = logs / f"{scenario}-{tag or f'{qps:.3f}'}"
            keep.mkdir(parents=True, exist_ok=True)
            for name in ("mlperf_log_summary.txt", "mlperf_log_detail.txt"):
                if (Path(out) / name).exists():
                    shutil.copy(Path(out) / name, keep / name)
    sut.close()
    lat = np.array(sut.latencies)
    errors = sum(n for c, n in sut.codes.items() if c != "200")
    res.update(scenario=scenario, target_qps=round(qps, 4), wall_s=round(wall, 1),
               codes=sut.codes, errors=errors,
               own_p99_s=round(float(np.percentile(lat, 99)), 3) if lat.size else None)
    res["valid"] = res["valid"] and errors == 0
    if scenario == "server":  # the service kept up: no backlog left growing at the end
        sched, done = res["scheduled_per_s"], res["completed_per_s"]
        res["kept_up"] = bool(sched and done and done >= KEPT_UP * sched)
        res["valid"] = res["valid"] and res["kept_up"]
    return res


def server_capacity(lg, url, bodies, offline_qps: float, a,
                    logs: Path | None = None) -> tuple[float, list[dict]]:
    """Highest Server rate with p99 under the bound: from the Offline rate, halve while the
    bound does not hold (double while it does) to bracket it, then bisect (``--search`` runs in
    all)."""
    runs, best, lo, hi = [], 0.0, 0.0, None
    qps = offline_qps
    for _ in range(a.search):
        r = run_scenario(lg, url, bodies, "server", qps=qps, p99=a.p99, seconds=a.seconds,
                         min_queries=a.min_queries, timeout=a.timeout, logs=logs)
        runs.append(r)
        print(f"    server {qps:.3f}/s: scheduled {r['scheduled_per_s']}/s, completed "
              f"{r['completed_per_s']}/s ({'kept up' if r['kept_up'] else 'fell behind'}), p99 "
              f"{r['p99_s']} s (bound {a.p99:.2f}), {'holds' if r['valid'] else 'fails'}; LoadGen "
              f"{r['loadgen_result']}, early stopping "
              f"{'met' if r['early_stopping'] else 'not met'}", flush=True)
        if r["valid"]:
            best = lo = qps
        else:
            hi = qps
        if hi is None:
            qps *= 2
        elif lo == 0.0:
            qps /= 2
        else:
            qps = (lo + hi) / 2
    return best, runs


def lone_service_time(url: str, body: dict, repeats: int = 5) -> float:
    """Median seconds of ``body`` sent alone through the service (after one warm-up)."""
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        r = requests.post(f"{url}/v1/generate", json=body, timeout=600)
        assert r.status_code == 200, r.text
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def inconsistent_rows(results: dict) -> list[str]:
    """Rows whose Server capacity exceeds the Offline throughput (impossible if both hold)."""
    bad = []
    for engine, res in results["engines"].items():
        for wl, r in res.items():
            if isinstance(r, dict) and "server_capacity_qps" in r:
                off = r["offline_best"]
                if r["server_capacity_qps"] > off:
                    bad.append(f"{engine}/{wl}: capacity {r['server_capacity_qps']:.3f}/s > "
                               f"Offline {off:.3f} images/s")
    return bad


def overhead(url: str, pipe, size: tuple[int, int], batch: int, steps: int,
             repeats: int) -> dict:
    """Direct pipeline call vs the same batch through the service, alternated, medians."""
    from pipelines.requests import ImageRequest

    w, h = size
    items = [ImageRequest(prompt=PROMPTS[i % len(PROMPTS)], seed=i, guidance_scale=0.0)
             for i in range(batch)]
    body = [{"prompt": it.prompt, "seed": it.seed, "steps": steps, "guidance_scale": 0.0,
             "width": w, "height": h} for it in items]

    def direct():
        pipe.generate(items, height=h, width=w, num_inference_steps=steps)

    def served():
        with cf.ThreadPoolExecutor(batch) as pool:
            rs = list(pool.map(lambda b: requests.post(f"{url}/v1/generate", json=b,
                                                       timeout=300), body))
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]

    direct(), served()
    a, b = [], []
    for r in range(repeats):
        for fn, into in ([(direct, a), (served, b)] if r % 2 == 0 else [(served, b), (direct, a)]):
            t = time.perf_counter()
            fn()
            into.append(time.perf_counter() - t)
    d, s = statistics.median(a), statistics.median(b)
    return {"batch": batch, "steps": steps, "direct_s": round(d, 4), "service_s": round(s, 4),
            "overhead_pct": round(100 * (s - d) / d, 1)}


def cost_text(offline: dict, price_per_hour: float | None) -> str:
    """The cost part of an Offline line: ``", $X per 1,000 images at $P/h"``, or nothing."""
    if offline.get("cost_per_1000_images") is None:
        return ""
    return (f", {offline['cost_per_1000_images']:.4g} per 1,000 images at {price_per_hour:g} "
            "per replica-hour")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", nargs="+", default=["batch", "step"])
    ap.add_argument("--workloads", nargs="+", default=["uniform", "mixed"])
    ap.add_argument("--step-policy", nargs="+", default=["fifo"], choices=["fifo", "srs"],
                    help="engine=step's admission policies (serve arg step_policy), one run each")
    ap.add_argument("--model", default=None, help="diffusers SDXL folder (default: embedded)")
    ap.add_argument("--p99", type=float, default=None,
                    help="Server-scenario p99 latency bound in seconds (default: --p99-factor "
                         "times the longest request's service time alone)")
    ap.add_argument("--p99-factor", type=float, default=10.0,
                    help="the p99 bound as a multiple of the service time of the workloads' "
                         "longest request (30 steps, guided) sent alone (default 10)")
    ap.add_argument("--size", type=int, nargs=2, metavar=("W", "H"), default=None,
                    help="image size (default: the model's)")
    ap.add_argument("--cfg", type=float, default=4.0, help="guidance of the CFG requests")
    ap.add_argument("--seconds", type=float, default=60.0, help="per LoadGen run")
    ap.add_argument("--min-queries", type=int, default=600,
                    help="per Server run (LoadGen's early stopping for a p99 needs 459)")
    ap.add_argument("--offline-queries", type=int, default=480)
    ap.add_argument("--offline-concurrency", type=int, default=None,
                    help="Offline requests in flight at once (default 4 x --max-batch-size)")
    ap.add_argument("--search", type=int, default=6, help="Server runs of the capacity search")
    ap.add_argument("--equal-load", type=float, default=0.7,
                    help="the equal-load comparison's rate, as a fraction of the batch "
                         "engine's Server capacity")
    ap.add_argument("--rates", type=float, nargs="+", default=None, metavar="QPS",
                    help="the policy comparison: skip Offline and the capacity search and run "
                         "each engine's workloads as Server runs at these rates (req/s), the "
                         "same for every engine (e.g. --engines step --step-policy fifo srs)")
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--port", type=int, default=8012)
    ap.add_argument("--parts", nargs="+", default=["loadgen", "overhead"],
                    choices=["loadgen", "overhead"],
                    help="loadgen: the Offline and Server scenarios; overhead: the service "
                         "against the direct pipeline (alone, e.g. with --model on a larger "
                         "checkpoint, where a batch takes seconds)")
    ap.add_argument("--overhead-steps", type=int, nargs="+", default=[4, 30])
    ap.add_argument("--quick", action="store_true",
                    help="short runs (20 s, 3 bisection steps): a smoke run, not for publishing")
    ap.add_argument("--price-per-hour", type=float, default=None,
                    help="what the one generator replica (its host) costs per hour: the Offline "
                         "runs also print $ per 1,000 images (as /v1/stats computes it)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--logs", default=None, help="keep LoadGen's summary and detail logs here")
    a = ap.parse_args(argv)
    if a.quick:
        a.seconds, a.search, a.offline_queries, a.min_queries, a.repeats = 20, 3, 48, 16, 3
    if a.offline_concurrency is None:
        a.offline_concurrency = 4 * a.max_batch_size

    import mlperf_loadgen as lg
    import ray
    from ray import serve

    from pipelines import TextToImagePipeline
    from serving.app import build_app

    pipe = TextToImagePipeline.from_pretrained(a.model)  # None: the embedded model
    w, h = a.size or (pipe.default_width, pipe.default_height)
    if w is None or h is None:
        ap.error("the model states no default size: give --size W H")
    workloads = a.workloads if "loadgen" in a.parts else []
    wanted = [(4, False), *MIXED] if workloads else []
    wanted += [(s, False) for s in a.overhead_steps] if "overhead" in a.parts else []
    shapes = sorted({f"{w}x{h}:{s}:{a.cfg if g else 0:g}" for s, g in wanted})
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": a.port})
    url = f"http://127.0.0.1:{a.port}"
    results: dict = {"p99_bound_s": a.p99, "size": f"{w}x{h}", "model": a.model or "embedded",
                     "price_per_hour": a.price_per_hour,
                     "max_batch_size": a.max_batch_size, "seconds": a.seconds,
                     "min_queries": a.min_queries, "offline_concurrency": a.offline_concurrency,
                     "engines": {}}
    logs = Path(a.logs) if a.logs else None
    try:
        runs = [(e, p) for e in a.engines for p in (a.step_policy if e == "step" else [None])]
        for kind, policy in runs:
            engine = kind if policy in (None, "fifo") else f"{kind}-{policy}"
            args = {"max_batch_size": a.max_batch_size, "max_queued_requests": -1,
                    "num_cpus": 1, "ingress_num_cpus": 0, "request_timeout_s": a.timeout,
                    "max_n": 1, "warmup_shapes": shapes}
            if kind != "batch":  # the default; an older service knows no `engine` arg
                args["engine"] = kind
            if policy not in (None, "fifo"):  # the default; an older service knows no policy
                args["step_policy"] = policy
            if a.model:
                args["model"] = a.model
            print(f"{engine}: starting (warm-up compiles {len(shapes)} shapes)", flush=True)
            serve.run(build_app(args), name=f"lg-{engine}", route_prefix="/")
            res = results["engines"][engine] = {}
            try:
                if workloads and a.p99 is None:  # measured once, on the first engine
                    longest = {"prompt": PROMPTS[0], "seed": 0, "steps": 30,
                               "guidance_scale": a.cfg, "width": w, "height": h}
                    lone = lone_service_time(url, longest)
                    a.p99 = a.p99_factor * lone
                    results.update(p99_bound_s=round(a.p99, 3), lone_30_step_s=round(lone, 4),
                                   p99_factor=a.p99_factor, bound_measured_on=engine)
                    print(f"  p99 bound: {a.p99_factor:g} x {lone:.3f} s (a lone 30-step "
                          f"guided request) = {a.p99:.2f} s", flush=True)
                for wl in workloads if a.rates else []:
                    bodies = workload(wl, a.offline_queries, a.cfg, (w, h))
                    res[wl] = {"at_rate": {}}
                    for qps in a.rates:
                        r = run_scenario(
                            lg, url, bodies, "server", qps=qps, p99=a.p99, seconds=a.seconds,
                            min_queries=a.min_queries, timeout=a.timeout,
                            logs=logs / engine / wl / f"rate-{qps:g}" if logs else None)
                        res[wl]["at_rate"][f"{qps:g}"] = r
                        print(f"  {wl} at {qps:g}/s: p50 {r['p50_s']} s, p99 {r['p99_s']} s, "
                              f"completed {r['completed_per_s']}/s, {r['errors']} errors",
                              flush=True)
                for wl in workloads if not a.rates else []:
                    wl_logs = logs / engine / wl if logs else None
                    bodies = workload(wl, a.offline_queries, a.cfg, (w, h))

                    def offline(tag, wl=wl, bodies=bodies, wl_logs=wl_logs):
                        r = run_scenario(lg, url, bodies, "offline", qps=1.0, p99=a.p99,
                                         seconds=1, min_queries=a.offline_queries,
                                         timeout=a.timeout, logs=wl_logs,
                                         concurrency=a.offline_concurrency, tag=tag)
                        r["cost_per_1000_images"] = cost_per_1000_images(
                            a.price_per_hour, r["samples_per_s"])
                        print(f"  {wl} offline ({tag}): {r['samples_per_s']} images/s "
                              f"({r['errors']} errors){cost_text(r, a.price_per_hour)}",
                              flush=True)
                        return r

                    off = offline("before")
                    cap, runs = server_capacity(lg, url, bodies, off["samples_per_s"], a,
                                                wl_logs)
                    print(f"  {wl} server capacity at p99 <= {a.p99:g} s: {cap:.3f}/s", flush=True)
                    after = offline("after")
                    res[wl] = {"offline": off, "offline_after": after,
                               "offline_best": max(off["samples_per_s"] or 0.0,
                                                   after["samples_per_s"] or 0.0),
                               "server_capacity_qps": round(cap, 4), "server_runs": runs}
                if "overhead" in a.parts:
                    res["overhead"] = [overhead(url, pipe, (w, h), a.max_batch_size, steps,
                                                a.repeats) for steps in a.overhead_steps]
                    print(f"  overhead: {res['overhead']}", flush=True)
                # equal load: both engines at a fraction of the batch engine's capacity
                # (the batch engine's, else the first engine's: fifo and srs at one rate)
                base = results["engines"].get("batch") or next(iter(results["engines"].values()))
                for wl in workloads if not a.rates else []:
                    qps = a.equal_load * base[wl]["server_capacity_qps"]
                    if qps > 0:
                        res[wl]["equal_load"] = run_scenario(
                            lg, url, workload(wl, a.offline_queries, a.cfg, (w, h)), "server",
                            qps=qps, p99=a.p99, seconds=a.seconds, min_queries=a.min_queries,
                            timeout=a.timeout,
                            logs=logs / engine / wl / "equal-load" if logs else None)
            finally:
                serve.delete(f"lg-{engine}")
    finally:
        serve.shutdown()
        ray.shutdown()
    bad = inconsistent_rows(results)
    results["consistent"] = not bad
    print(json.dumps(results, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    if bad:
        raise SystemExit("INCONSISTENT: a Server capacity above the Offline throughput of the "
                         "same engine and workload cannot be sustained; do not publish these "
                         "figures:\n  " + "\n  ".join(bad))


if __name__ == "__main__":
    main()
