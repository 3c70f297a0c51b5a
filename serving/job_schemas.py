"""The HTTP models of jobs (``/v1/jobs``, :mod:`serving.job_routes`): a job's request
(:class:`JobRequest`), the job as the API shows it (:class:`Job`, its :class:`JobWebhook`) and
a list of them (:class:`JobList`). Pydantic; FastAPI shows them at ``/docs``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class JobRequest(BaseModel):
    """``POST /v1/jobs``: a request to one of the generation routes, run in the background."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    endpoint: Literal["/v1/generate", "/v1/edit", "/v1/images/generations"] = Field(
        description="The route whose body `body` is.")
    body: dict = Field(description="That route's JSON body (stream is not allowed). The images "
                       "of a job are always stored and linked (response_format 'url').")
    webhook: str | None = Field(None, description="An http(s) URL that receives the finished "
                                "job (POST, JSON, signed as Standard Webhooks: see "
                                "/v1/webhooks/secret); retried when it does not answer 2xx.")
    metadata: dict[str, str] | None = Field(None, description="Your own labels, returned "
                                            "with the job (at most 16, 512 characters each).")


JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]


class JobWebhook(BaseModel):
    url: str
    status: Literal["pending", "delivered", "failed"]
    attempts: int
    last_status_code: int | None = None


class Job(BaseModel):
    id: str
    object: Literal["job"] = "job"
    status: JobStatus
    endpoint: str
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    request_id: str | None = None
    result: dict | None = Field(None, description="The route's response, images as links.")
    error: dict | None = Field(None, description="Why it failed: an error body.")
    metadata: dict[str, str] | None = None
    webhook: JobWebhook | None = None


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Job]
