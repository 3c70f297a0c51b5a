"""The ingress's side of the generator deployment: is a replica ready, calls within a deadline
(one retry when a replica dies), streams, every failure mapped by :func:`serving.errors.failure`.
Light: never imports JAX."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from pipelines.conditioned_requests import EditRequest
from pipelines.requests import GenerationRequest
from serving import errors, sse
from serving.errors import ApiError
from serving.schemas import JobResult
from serving.settings import ServeSettings

logger = logging.getLogger("ray.serve")

GENERATOR = "Generator"  # the generator deployment's name


async def _await(response):
    return await response


def _serve_details() -> dict:
    """Ray Serve's view of every application, deployment and replica (what ``serve.status()``
    summarises: it reads the same controller call, and drops the replicas' ids)."""
    from ray.serve.context import _get_global_client

    return _get_global_client().get_serve_details()


class GeneratorClient:
    """Calls to the generator deployment of application ``app_name`` through ``handle``."""

    def __init__(self, handle: DeploymentHandle, settings: ServeSettings, app_name: str,
                 default_model: str):
        self.handle = handle
        self.s = settings
        self.app_name = app_name
        self.default_model = default_model
        self.infos: dict[str, dict] = {}  # model name -> its defaults and limits, once known
        self._handles: dict[str, DeploymentHandle] = {}
        self._ready_seen = False
        self._state = (0.0, False, {})

    async def state(self) -> tuple[bool, dict]:
        """(ready, detail): ready once a generator replica is RUNNING, i.e. its constructor
        (model load and warm-up compiles) has returned, and while autoscaling has scaled the
        generator to zero after that (``detail["scaled_to_zero"]``: requests wait for a replica
        to start). Cached for a second."""
        at, ready, detail = self._state
        if time.monotonic() - at < 1.0:
            return ready, detail
        try:
            status = await asyncio.to_thread(serve.status)
            app = status.applications.get(self.app_name)
            dep = app.deployments.get(GENERATOR) if app else None
            states = {getattr(k, "value", str(k)): v
                      for k, v in (dep.replica_states if dep else {}).items()}
            running = states.get("RUNNING", 0)
            detail = {"generator_replicas": states, "generator_status":
                      getattr(dep.status, "value", str(dep.status)) if dep else "missing"}
            ready = running > 0
            if not ready and self._ready_seen and self.s.scales_to_zero and detail[
                    "generator_status"] in ("HEALTHY", "UPSCALING"):
                # idle at min_replicas 0: a request is taken and waits for a replica to start
                ready, detail["scaled_to_zero"] = True, True
        except Exception as e:  # controller unreachable: not ready
            ready, detail = False, {"error": f"{type(e).__name__}: {e}"}
        self._state = (time.monotonic(), ready, detail)
        self._ready_seen |= ready
        return ready, detail

    async def live_replicas(self) -> dict[str, str]:
        """The generator deployment's replicas as Ray Serve's controller lists them: replica id
        (the ``replica_id.unique_id`` each replica reports under) -> state (``RUNNING``,
        ``STOPPING``, ...). Raises when the controller cannot be read."""
        details = await asyncio.to_thread(_serve_details)
        app = (details.get("applications") or {}).get(self.app_name) or {}
        dep = (app.get("deployments") or {}).get(GENERATOR) or {}
        return {r["replica_id"]: str(getattr(r["state"], "value", r["state"]))
                for r in dep.get("replicas") or ()}

    async def _check_ready(self) -> None:
        """A 503 (warming up) until a generator replica has been seen ready."""
        if not self._ready_seen and not (await self.state())[0]:
            raise errors.warming_up(self.s.retry_after_s)

    def _handle(self, model: str | None) -> DeploymentHandle:
        """The generator's handle for ``model``: its name is the call's multiplexed model id, so
        Ray Serve routes the call to a replica that holds the model when one can take it."""
        model = model or self.default_model
        if model not in self._handles:
            self._handles[model] = self.handle.options(multiplexed_model_id=model)
        return self._handles[model]

    async def call(self, method: str, arg: Any, deadline: float, rid: str | None = None,
                   model: str | None = None) -> Any:
        """Call a generator method on ``model`` (None: the default) within the deadline; map
        failures to HTTP errors. A call whose replica dies is made once more (Ray Serve routes
        it to a live replica)."""
        from ray.exceptions import RayActorError

        for attempt in ("retrying once", "again"):
            try:
                return await self._call_once(method, arg, deadline, model)
            except RayActorError as e:
                logger.warning("request %s: generator replica lost (%s); %s", rid,
                               type(e).__name__, attempt)
        raise errors.replica_lost(self.s.retry_after_s)

    async def _call_once(self, method: str, arg: Any, deadline: float, model: str | None
                         ) -> Any:
        await self._check_ready()
        handle = getattr(self._handle(model), method)
        left = max(deadline - time.monotonic(), 0)
        response = handle.remote() if arg is None else handle.remote(arg, left)
        try:
            return await asyncio.wait_for(_await(response), max(deadline - time.monotonic(), 0))
        except asyncio.CancelledError:  # the client went away
            response.cancel()
            raise
        except Exception as e:
            err = errors.failure(e, self.s)
            if err is None:
                raise
            if isinstance(e, asyncio.TimeoutError):
                response.cancel()
            raise err from None

    async def model_info(self, model: str, deadline: float) -> dict:
        """``model``'s defaults and limits (asked once, then cached): a generator replica
        loads the model to answer if none holds it."""
        if model not in self.infos:
            self.infos[model] = await self.call("info", None, deadline, model=model)
        return self.infos[model]

    async def run(self, job: GenerationRequest, deadline: float, rid: str | None,
                  model: str | None = None) -> JobResult:
        """Run ``job`` on a generator replica holding ``model`` (None: the default):
        ``generate``, or ``edit`` for an EditRequest."""
        if self.s.log_prompts:
            logger.info("request %s: model=%s prompt=%r negative=%r", rid, model, job.prompt,
                        job.negative_prompt)
        method = "edit" if isinstance(job, EditRequest) else "generate"
        result: JobResult = await self.call(method, job, deadline, rid, model)
        self._ready_seen = True
        return result

    async def stream(self, job: GenerationRequest, deadline: float, rid: str | None,
                     partial_images: int, render, model: str | None = None):
        """Start ``job`` on the generator's ``generate_stream`` and answer its events as
        Server-Sent Events; ``render(event)`` (async) gives the (name, data) pairs to send for
        one generator event. Errors before the first event are ordinary HTTP errors; later ones
        an ``error`` event. Leaving early (client gone) cancels the generator call."""
        await self._check_ready()
        left = max(deadline - time.monotonic(), 0)
        gen = self._handle(model).options(stream=True).generate_stream.remote(job, left,
                                                                              partial_images)

        def failure(e: BaseException) -> ApiError:
            err = errors.failure(e, self.s, streamed=True)
            if err is None:
                logger.error("request %s: stream failed: %s: %s", rid, type(e).__name__, e)
                err = ApiError(500, errors.internal_message(rid), kind="server_error")
            return err

        async def next_event():
            return await asyncio.wait_for(gen.__anext__(),
                                          max(deadline - time.monotonic(), 0) + 5)

        try:
            first = await next_event()
        except asyncio.CancelledError:
            gen.cancel()
            raise
        except StopAsyncIteration:
            raise failure(RuntimeError("the stream ended before it started")) from None
        except Exception as e:
            gen.cancel()
            raise failure(e) from None
        self._ready_seen = True

        def error_event(e: Exception) -> dict:
            err = failure(e)
            return errors.error_body(err.status, err.message, err.kind, request_id=rid)

        # gen.cancel() is a no-op once finished; else the client left: free the slot
        return sse.response(first, next_event, render, error_event, gen.cancel)
