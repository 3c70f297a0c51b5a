"""Throughput and cost over a recent window, from the generator replicas' reports (the
``/v1/stats`` ``throughput`` entry). Pure arithmetic on what the replicas reported; no Ray.

A replica reports, after every batch and every health check, ``ready_at`` (when its warm-up
finished) and ``images_by_second`` (``[unix second, images finished]`` over the window). Over
the last ``window_s`` seconds, a replica was serving for ``seconds = min(window_s, now -
ready_at)``; its images/s is its images in the window over those seconds, and with
``price_per_hour`` (per replica) its cost per 1,000 images is ``price_per_hour x seconds / 3600
/ images x 1000`` (= the price per second over images/s, x 1000). The total adds up the live
replicas' images and replica-seconds: ``images_per_s`` is the sum of theirs, and
``cost_per_1000_images`` is the price of all their replica-seconds over all their images. The
replicas are ``/v1/stats``' live ones (those Ray Serve runs); one whose last report is older
than ``live_s`` (three health-check periods: a replica that stopped answering its health
checks) is left out of the figures too."""

from __future__ import annotations


def replica_throughput(report: dict, now: float, window_s: float,
                       price_per_hour: float | None) -> dict:
    """One replica's ``images``, ``seconds``, ``images_per_s`` and ``cost_per_1000_images``
    (None when no price is set or no image was made) over the window ending ``now``."""
    ready_at = report.get("ready_at") or now
    seconds = max(min(window_s, now - ready_at), 0.0)
    images = sum(n for t, n in report.get("images_by_second") or () if t >= now - window_s)
    return _figures(images, seconds, price_per_hour, replicas=1)


def throughput(replicas: dict, now: float, window_s: float, price_per_hour: float | None,
               live_s: float) -> dict:
    """The ``throughput`` entry of ``/v1/stats``: ``window_s``, ``price_per_hour``, ``per_replica``
    (replica id -> its figures, live ones only) and ``total``."""
    per_replica = {rid: replica_throughput(r, now, window_s, price_per_hour)
                   for rid, r in replicas.items() if r.get("report_age_s", 0) <= live_s}
    images = sum(f["images"] for f in per_replica.values())
    seconds = sum(f["seconds"] for f in per_replica.values())
    total = _figures(images, seconds, price_per_hour, replicas=len(per_replica))
    total["images_per_s"] = round(sum(f["images_per_s"] for f in per_replica.values()), 6)
    return {"window_s": window_s, "price_per_hour": price_per_hour,
            "per_replica": per_replica, "total": total}


def cost_per_1000_images(price_per_hour: float | None, images_per_s: float) -> float | None:
    """What 1,000 images cost on one replica priced ``price_per_hour`` making
    ``images_per_s`` (None without a price or an image): the price per second over the
    images per second, x 1000. ``benchmarks/loadgen.py`` prints it for its Offline runs."""
    if price_per_hour is None or not images_per_s:
        return None
    return round(price_per_hour / 3600 / images_per_s * 1000, 6)


def _figures(images: int, seconds: float, price_per_hour: float | None, replicas: int) -> dict:
    # images per replica-second: the total's replica-seconds are the sum of its replicas'
    cost = cost_per_1000_images(price_per_hour, images / seconds if seconds > 0 else 0.0)
    return {"replicas": replicas, "images": images, "seconds": round(seconds, 3),
            "images_per_s": round(images / seconds, 6) if seconds > 0 else 0.0,
            "cost_per_1000_images": cost}
