"""A running generation as server-sent events in OpenAI's chunk shapes, then ``data: [DONE]``.
The first chunk opens the message; each chunk with text follows (tokens whose text is held back by
a possible stop string bring their logprobs to the next one); an engine error is one event in
OpenAI's error shape; vLLM's acceptance object rides once, on the usage chunk
(``stream_options.include_usage``), else on the last chunk."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from card.engine.target.verify import TokenLogprob
from card.target_service.frontend import Running
from card.target_service.openai_shapes import FINISH, Shape, error_json, spec_metrics, usage


async def sse(running: Running, watcher: asyncio.Task[None], shape: Shape,
              include_usage: bool) -> AsyncIterator[str]:
    logprobs: list[TokenLogprob] = []  # of tokens whose text is held back (a possible stop string)
    try:
        yield _data(shape.chunk(shape.delta("", first=True), None))
        try:
            async for chunk in running:
                logprobs += chunk.logprobs
                if chunk.text:
                    yield _data(shape.chunk(shape.delta(chunk.text), None, logprobs))
                    logprobs = []
        except Exception as error:  # the generation failed after the response began
            yield _data(error_json(error))
        else:
            if running.result is None:
                return  # cancelled
            result = running.finished()
            last = shape.chunk(shape.delta(None), FINISH.get(result.finish_reason, "stop"), logprobs)
            if not include_usage:
                last["metrics"] = spec_metrics(result.stats)
            yield _data(last)
            if include_usage:
                yield _data({**shape.chunk(None, None), "choices": [],
                             "usage": usage(result.stats, running.serving_draft),
                             "metrics": spec_metrics(result.stats)})
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        running.cancel()


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
