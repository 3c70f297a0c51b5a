"""The ingress's routes that describe the service: the web playground (``GET /``),
``GET /healthz``, the served models (``GET /v1/models``, ``GET /v1/models/{model}``: each
model's defaults, limits and adapters) and ``GET /v1/stats`` (recent batches, throughput and
cost per generator replica): a part of :class:`serving.app.Ingress`, which provides ``s``,
``catalog``, ``generator``, ``board``, ``app_name`` and ``started``."""

from __future__ import annotations

import functools
import logging
import time

from fastapi import Request
from fastapi.responses import HTMLResponse, JSONResponse

from serving import cost, validation
from serving.api import api
from serving.errors import ApiError
from serving.schemas import ERROR_RESPONSES
from serving.settings import ServeSettings
from serving.stats_board import StatsBoard

logger = logging.getLogger("ray.serve")

# the page may talk to this server only; its script and style are inline
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'none'; connect-src 'self'; img-src 'self' "
                "data:; script-src 'unsafe-inline'; style-src 'unsafe-inline'; base-uri 'none'; "
                "form-action 'none'; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


@functools.cache
def _playground_html() -> str:
    from importlib.resources import files

    return files("serving").joinpath("playground.html").read_text(encoding="utf-8")


def _model_details(s: ServeSettings, info: dict) -> dict:
    """``/v1/models``'s ``maxdiff`` entry: the model's defaults, the engine, this server's
    limits for it and the adapters loaded."""
    details = {k: info[k] for k in (
        "scheduler", "default_steps", "default_guidance", "default_width", "default_height",
        "size_multiple", "max_size", "dtype", "devices")}
    details["quantization"] = info.get("quantization", "none")
    details["engine"] = s.engine  # "step": steps and partial images are streamed
    lim = validation.limits(s, info)
    details["limits"] = {
        "min_size": lim.min_size or lim.multiple, "max_size": lim.max_size,
        "size_multiple": lim.multiple, "max_steps": lim.max_steps,
        "max_guidance": lim.max_guidance, "max_n": lim.max_n,
        "max_prompt_chars": s.max_prompt_chars, "max_cost": lim.max_cost}
    details["adapters"] = info.get("adapters") or []
    details["controlnets"] = info.get("controlnets") or []  # what control_images may name
    details["ip_adapter"] = info.get("ip_adapter")  # image prompts (ip_adapter_image), or None
    return details


class InfoRoutes:
    """The playground, health, the served models and stats."""

    @api.get("/", response_class=HTMLResponse, tags=["playground"],
             summary="The web playground (a page for people)",
             responses={404: {"description": "The playground is off (serve arg playground)."}})
    async def playground(self):
        """One self-contained page (nothing fetched from other hosts) that calls the public
        endpoints above: ``GET /v1/models`` for the defaults and limits, ``POST /v1/generate``."""
        if not self.s.playground:
            raise ApiError(404, "the playground is off on this server (serve arg playground)",
                           kind="not_found")
        return HTMLResponse(_playground_html(), headers=PAGE_HEADERS)

    @api.get("/healthz", tags=["operations"], summary="Ready to serve?",
             responses={503: {"description": "No generator replica has finished warming up."}})
    async def healthz(self):
        """200 once a generator replica has loaded the model and compiled its warm-up shapes;
        503 (with ``Retry-After``) before that. The body: ``status`` (``ok`` /
        ``warming_up``); ``generator_replicas``: how many generator replicas are in each Ray
        Serve replica state (``STARTING``: loading the model and compiling its warm-up shapes,
        ``RUNNING``: serving, ``UPDATING``: taking a new config, ``RECOVERING``: restarting after
        a failure, ``STOPPING``: removed by a scale-down or redeploy, draining,
        ``PENDING_MIGRATION``: moving off a draining node); ``generator_status``: the
        deployment's (``HEALTHY``, ``UPDATING``, ``UPSCALING``, ``DOWNSCALING``, ``UNHEALTHY``,
        ``DEPLOY_FAILED``; ``missing`` when the application has none); ``scaled_to_zero: true``
        at zero replicas under autoscaling after a first replica was ready (still 200: a
        request starts a replica); ``error`` instead of the states when the Ray controller
        cannot be read (503)."""
        ready, detail = await self.generator.state()
        if ready:
            return {"status": "ok", **detail}
        return JSONResponse({"status": "warming_up", **detail}, status_code=503,
                            headers={"Retry-After": str(self.s.retry_after_s)})

    @api.get("/v1/models", tags=["OpenAI-compatible"], summary="The served models",
             responses={k: ERROR_RESPONSES[k] for k in (401, 429, 500)})
    async def models(self):
        """Every served model, the default first. Once a generator replica has loaded a model
        (the default: at start), ``maxdiff`` adds its defaults, ``limits`` (what requests may
        ask for: sizes, steps, guidance, images) and ``adapters`` (the LoRA adapters loaded,
        serve arg adapters); each adapter is listed as a model ``<model>:<adapter>`` too (the
        OpenAI routes' ``model`` picks it). ``GET /v1/models/{model}`` loads a model to answer."""
        await self._known_infos()
        data = []
        for served in self.catalog.models:
            data += self._entries(served.name, self.generator.infos.get(served.name))
        return {"object": "list", "data": data}

    @api.get("/v1/models/{model}", tags=["OpenAI-compatible"], summary="One served model",
             responses={k: ERROR_RESPONSES[k] for k in (401, 404, 429, 500, 503, 504)})
    async def model(self, model: str, request: Request):
        """One model's ``/v1/models`` entry with its defaults and limits (``maxdiff``); a
        generator replica loads the model to answer if none has yet. ``<model>:<adapter>``
        answers an adapter's entry."""
        name, _, adapter = model.partition(":")
        self.catalog.get(name)  # 404 naming the choices
        info = await self.generator.model_info(name, validation.deadline(request, self.s))
        entries = self._entries(name, info)
        found = next((e for e in entries if e["id"] == model), None)
        if found is None:
            raise ApiError(404, f"model {name!r} has no adapter {adapter!r}; its adapters: "
                           f"{', '.join(a['name'] for a in info['adapters']) or 'none'}",
                           param="model", code="model_not_found")
        return found

    def _entries(self, name: str, info: dict | None) -> list[dict]:
        """``/v1/models`` entries of model ``name``: the model, then its adapters."""
        entry = {"id": name, "object": "model", "created": self.started, "owned_by": "maxdiff"}
        if info is not None:
            entry["maxdiff"] = {"default": name == self.catalog.default.name,
                                **_model_details(self.s, info)}
        adapters = ((info or {}).get("adapters")
                    or [{"name": a.name, "scale": a.scale} for a in self.catalog.get(name).adapters])
        return [entry, *({"id": f"{name}:{a['name']}", "object": "model", "created": self.started,
                          "owned_by": "maxdiff", "parent": name, "maxdiff": {"adapter": a}}
                         for a in adapters)]

    async def _known_infos(self) -> None:
        """Fill the info of models a generator replica has loaded (and reported to the stats
        actor) that this ingress has not asked for yet; the default model's is asked once
        the generator is ready. Loads nothing."""
        missing = [m for m in self.catalog.names if m not in self.generator.infos]
        if not missing:
            return
        try:
            found = await self.board.described.remote([self.catalog.key(m) for m in missing])
        except Exception as e:  # the stats actor is gone: details later
            logger.warning("stats actor unavailable: %s", type(e).__name__)
            found = {}
        for m in missing:
            if self.catalog.key(m) in found:
                self.generator.infos[m] = found[self.catalog.key(m)]
        default = self.catalog.default.name
        if default not in self.generator.infos and (await self.generator.state())[0]:
            try:
                await self.generator.model_info(default, time.monotonic() + 10)
            except ApiError:  # busy or restarting: the entry without details, this time
                pass

    @api.get("/v1/stats", tags=["operations"], summary="Recent batches per generator replica",
             responses={k: ERROR_RESPONSES[k] for k in (401, 429, 500)})
    async def stats(self):
        """Every live generator replica of this application (whichever ingress replica served
        its requests): its node, images served, compiled programs and recent batches (newest
        last), as it last reported them (after every batch and health check) to the
        application's stats actor; ``report_age_s`` says how long ago, ``state`` is Ray
        Serve's. Live: the replicas Ray Serve's controller runs (``live_from: "controller"``);
        the others that reported (scaled down, redeployed, failed; ``STOPPING`` while drained)
        are in ``removed`` (id, node, pid, ``last_seen``) for 10 minutes. When the controller
        cannot be read, ``live_from`` is ``"reports"`` (``live_error`` says why): the replicas
        that reported in the last 10 minutes and have not shut down. ``throughput``: images/s
        and, with the serve arg ``price_per_hour`` (per replica), the cost per 1,000 images of
        each live replica and in total over the last ``stats_window_s``
        (:mod:`serving.cost`)."""
        source: dict = {"live_from": "controller"}
        try:
            live = await self.generator.live_replicas()
        except Exception as e:  # the controller is unreachable: the reports alone, flagged
            live, source = None, {"live_from": "reports", "live_error": f"{type(e).__name__}: {e}"}
        try:
            snap = await self.board.snapshot.remote(live)
        except Exception as e:  # the stats actor is gone: report, never fail
            logger.warning("stats actor unavailable: %s", type(e).__name__)
            self.board = StatsBoard.get(self.app_name)
            snap = {"replicas": {}, "removed": []}
        replicas = snap["replicas"]
        figures = cost.throughput(replicas, time.time(), self.s.stats_window_s,
                                  self.s.price_per_hour, 3 * self.s.health_check_period_s)
        for r in replicas.values():
            r.pop("images_by_second", None)  # summed up in throughput
        return {"replicas": replicas, "removed": snap["removed"], **source,
                "throughput": figures}
