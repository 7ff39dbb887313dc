"""Server-sent events: the one place where stream chunks become bytes on the wire.

A stream is ``data: {json}\\n\\n`` per chunk and ``data: [DONE]\\n\\n`` at the end.  An error that
happens after the response has started (status 200 already sent) cannot change the status any
more, so it is sent as one ``data: {"error": {...}}`` event before ``[DONE]`` (what vLLM and
OpenAI do); the stream is never cut without a terminator.
"""

from __future__ import annotations

import json
import logging
from typing import AsyncIterator

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from server.errors import APIError

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(chunk: BaseModel) -> str:
    """Null fields are left out (``delta`` carries only what changed, ``usage`` only when sent),
    except each choice's ``finish_reason`` and ``logprobs``, which OpenAI always sends."""
    data = chunk.model_dump(mode="json", exclude_none=True)
    for choice in data.get("choices", ()):
        choice.setdefault("logprobs", None)
        choice.setdefault("finish_reason", None)
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _error_event(exc: APIError) -> str:
    return f"data: {exc.to_response().model_dump_json()}\n\n"


async def sse_events(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield sse_event(chunk)
    except APIError as exc:
        yield _error_event(exc)
    except Exception as exc:  # noqa: BLE001 - the status is already 200; report in-band
        log.error("error while streaming", exc_info=exc)
        yield _error_event(APIError(500, "Internal server error while streaming; see the server log.",
                                    code="internal_error"))
    yield DONE


def sse_response(chunks: AsyncIterator[BaseModel]) -> StreamingResponse:
    return StreamingResponse(sse_events(chunks), media_type="text/event-stream", headers=HEADERS)
