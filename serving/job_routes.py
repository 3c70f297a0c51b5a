"""The ingress's routes for jobs, stored images, webhook secrets and usage
(:mod:`serving.jobs`, :mod:`serving.storage`, :mod:`serving.usage`): a part of
:class:`serving.app.Ingress`, which provides ``s``, ``catalog``, ``generator``, ``jobs``,
``files``, ``accounts`` and ``_base_url``."""

from __future__ import annotations

import asyncio
import time

from fastapi import Query, Request
from fastapi.responses import JSONResponse, Response

from serving import jobs, native_api, openai_api, validation
from serving.answers import Prepared
from serving.api import api, key_of
from serving.errors import ApiError, invalid_all, request_id
from serving.job_schemas import Job, JobList, JobRequest, JobStatus
from serving.schemas import ERROR_RESPONSES, ErrorResponse


class JobRoutes:
    """Jobs (``/v1/jobs``), stored images (``/v1/files``), webhook secrets and usage."""

    # ------------------------------------------------------------------ jobs and files
    @api.post("/v1/jobs", status_code=202, response_model=Job, tags=["jobs"],
              summary="Start a job: a generation or edit answered at once with an id",
              responses={k: v for k, v in ERROR_RESPONSES.items() if k != 406})
    async def create_job(self, body: JobRequest, request: Request):
        """The request ``body`` of ``endpoint`` is checked as that route checks it (422s name
        ``body.<field>``), then runs in the background: ``GET /v1/jobs/{id}`` tells its status
        and, once it succeeded, the route's response with the images as links. ``webhook``
        receives the finished job. At most ``max_active_jobs`` queued or running jobs per API
        key (429)."""
        t0 = time.perf_counter()
        prep = await self._job_prep(body, validation.deadline(request, self.s), t0)
        await self.accounts.check(key_of(request), prep.job.n)  # a 429 now, not a failed job
        base = self._base_url(request)
        job = await self.jobs.submit(body.endpoint, prep, key_of(request), base,
                                     request_id(request), body.webhook, body.metadata)
        return JSONResponse(job, status_code=202, headers={"Location": f"{base}/v1/jobs/"
                                                                       f"{job['id']}"})

    async def _job_prep(self, body: JobRequest, deadline: float, t0: float) -> Prepared:
        """The job's request checked by its route's rules."""
        problems = jobs.request_problems(body)
        if problems:
            raise invalid_all(problems)
        with jobs.nested_errors():
            inner = jobs.parse_body(body.endpoint, body.body)
            if body.endpoint == "/v1/generate":
                return await native_api.prepare_generate(
                    self.s, self.generator, self.catalog, inner, None, inner.output_format,
                    deadline, t0)
            if body.endpoint == "/v1/edit":
                return await native_api.prepare_edit(self.s, self.generator, self.catalog,
                                                     inner, deadline, t0)
            return await openai_api.prepare(self.s, self.generator, self.catalog, inner,
                                            deadline)

    @api.get("/v1/jobs", response_model=JobList, tags=["jobs"], summary="Your recent jobs",
             responses={k: ERROR_RESPONSES[k] for k in (401, 429, 500)})
    async def list_jobs(self, request: Request,
                        limit: int = Query(20, ge=1, le=100, description="How many, newest "
                                           "first."),
                        status: JobStatus | None = Query(None, description="Only jobs in this "
                                                         "state.")):
        """The caller's (its API key's) jobs, newest first."""
        return await self.jobs.recent(key_of(request), limit, status)

    @api.get("/v1/jobs/{job_id}", response_model=Job, tags=["jobs"], summary="A job's state",
             responses={k: ERROR_RESPONSES[k] for k in (401, 404, 429, 500)})
    async def get_job(self, job_id: str, request: Request):
        """Status (queued, running, succeeded, failed, cancelled), and the result or the
        error once it ended. Another API key's job is a 404."""
        return await self.jobs.get(job_id, key_of(request))

    @api.delete("/v1/jobs/{job_id}", response_model=Job, tags=["jobs"], summary="Cancel a job",
                responses={k: ERROR_RESPONSES[k] for k in (401, 404, 429, 500)})
    async def cancel_job(self, job_id: str, request: Request):
        """A queued or running job is cancelled (its device time stops, its webhook is told);
        a finished one is answered as it is."""
        return await self.jobs.cancel(job_id, key_of(request))

    @api.get("/v1/webhooks/secret", tags=["jobs"], summary="Your webhook signing secret",
             responses={k: ERROR_RESPONSES[k] for k in (401, 429, 500)})
    async def webhook_secret(self, request: Request):
        """The secret your jobs' webhooks are signed with (Standard Webhooks: ``whsec_`` +
        base64; one per API key): check each delivery's ``webhook-signature`` with it."""
        return {"secret": self.jobs.secret(key_of(request))}

    @api.get("/v1/files/{name}", tags=["jobs"], summary="A stored image",
             response_class=Response,
             responses={200: {"content": {"image/png": {}, "image/jpeg": {}, "image/webp": {}}},
                        404: {"model": ErrorResponse, "description": "No such image, or it "
                              "expired."}})
    async def file(self, name: str):
        """An image answered as a link (``response_format: "url"``, jobs), until it expires.
        Open without an API key: the link's 128 random bits are the permission."""
        found = await asyncio.to_thread(self.files.read, name)
        if found is None:
            raise ApiError(404, f"no stored image {name!r} (links expire after output_ttl_s)",
                           kind="not_found", code="file_not_found")
        data, media = found
        return Response(data, media_type=media, headers={"Cache-Control": "private, max-age=3600",
                                                         "X-Content-Type-Options": "nosniff"})

    @api.get("/v1/usage", tags=["operations"], summary="Your usage and quotas",
             responses={k: ERROR_RESPONSES[k] for k in (401, 429, 500)})
    async def usage(self, request: Request):
        """The caller's API key: requests, images, steps and device-seconds (its images'
        share of their batches' device time) today (UTC) and in all, with their cost at the
        serve arg ``price_per_hour``; its quotas, when they reset, and its priority class.
        Without API keys: everyone's, as one anonymous key."""
        return await self.accounts.report(key_of(request))
