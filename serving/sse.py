"""Server-Sent Events framing for the streaming routes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi.responses import StreamingResponse


def frame(name: str, data: dict) -> bytes:
    """One event: ``event: NAME`` and ``data: JSON``, then a blank line."""
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


def response(first: dict, next_event: Callable[[], Awaitable[dict]],
             render: Callable[[dict], Awaitable[list[tuple[str, dict]]]],
             error: Callable[[Exception], dict], close: Callable[[], None]) -> StreamingResponse:
    """The event stream of a generator stream that sent ``first``: each event as the (name,
    data) pairs ``render`` gives for it, until the ``result`` event or the stream's end. A
    failure later is one ``error`` event with the body ``error(exception)`` gives. ``close`` runs
    once the response ends, finished or not (the client left)."""

    async def events() -> AsyncIterator[bytes]:
        ev = first
        try:
            while True:
                for name, data in await render(ev):
                    yield frame(name, data)
                if ev["type"] == "result":
                    return
                try:
                    ev = await next_event()
                except StopAsyncIteration:
                    return
                except (asyncio.CancelledError, GeneratorExit):
                    raise
                except Exception as e:
                    yield frame("error", error(e))
                    return
        finally:
            close()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
