"""A validated request (:class:`Prepared`: the served model, the job for the generator, how its
result becomes the route's body) and the answer built from its result, with the images inline
(``b64_json``) or in the output store as links (``response_format: "url"``,
:mod:`serving.storage`). The synchronous routes and jobs (:mod:`serving.jobs`) answer alike."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pipelines.requests import GenerationRequest
from serving.schemas import JobResult
from serving.storage import OutputStore


@dataclass
class Prepared:
    """A request checked against the model's limits: ``render(result)`` gives the route's body
    and the encoded images (in its entries' order); ``entries``: the body's list of image
    entries (``images`` on the native routes, ``data`` on the OpenAI ones)."""

    model: str
    info: dict
    job: GenerationRequest
    fmt: str
    render: Callable[[JobResult], Awaitable[tuple[dict, list[bytes]]]]
    entries: str


async def answer(prep: Prepared, result: JobResult, response_format: str | None,
                 store: OutputStore, base_url: str, key_id: str | None = None) -> dict:
    """The route's body for ``result``: images as ``b64_json``, or with ``"url"`` stored and
    linked (each entry's ``url`` and ``expires_at``, unix seconds or None)."""
    data, blobs = await prep.render(result)
    if response_format != "url":
        return data

    def put():
        return [store.put(b, prep.fmt, {"model": prep.model, "seed": s, "key_id": key_id})
                for b, s in zip(blobs, result.seeds)]

    stored = await asyncio.to_thread(put)
    for entry, one in zip(data[prep.entries], stored):
        entry.pop("b64_json", None)
        entry["url"] = store.link(one, base_url)
        entry["expires_at"] = None if one.expires_at is None else int(one.expires_at)
    return data
