"""A request's running choices as server-sent events (sse-starlette: its keep-alive comments
every PING_S seconds keep an idle stream open through proxies) in OpenAI's chunk shapes, then
``data: [DONE]``.

Each choice's first chunk opens its message; each chunk with text follows (tokens whose text is
held back by a possible stop string bring their logprobs to the next one); a choice's last chunk
carries its finish reason. Choices interleave as their tokens come (n > 1). An engine error is
one event in OpenAI's error shape. vLLM's acceptance object rides once: on the usage chunk
(``stream_options.include_usage``: a chunk with no choices, after every choice ended), else on
the last choice's last chunk, so that a client that did not ask for usage never gets a chunk
without choices. ``stream_options.continuous_usage_stats`` (vLLM's): the usage so far on every
chunk."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence

from sse_starlette import ServerSentEvent

from card.engine.target.generation import Chunk
from card.engine.target.verify import TokenLogprob
from card.target_service.frontend import Running
from card.target_service.openai_shapes import Finished, Shape, combined, error_json, spec_metrics

PING_S = 15  # a comment line on an idle stream: proxies (nginx: 60 s) keep it open

End = BaseException | None  # a choice ended: normally (None) or with the engine's error


async def merged(runnings: Sequence[Running]) -> AsyncIterator[tuple[int, Chunk | End]]:
    """Every choice's chunks as they come, as (index, chunk), and once per choice (index, its
    end). One choice is read directly; several through a queue their pumps feed."""
    if len(runnings) == 1:
        try:
            async for chunk in runnings[0]:
                yield 0, chunk
        except Exception as error:
            yield 0, error
        else:
            yield 0, None
        return
    queue: asyncio.Queue[tuple[int, Chunk | End]] = asyncio.Queue()

    async def pump(index: int, running: Running) -> None:
        try:
            async for chunk in running:
                queue.put_nowait((index, chunk))
        except Exception as error:
            queue.put_nowait((index, error))
        else:
            queue.put_nowait((index, None))

    pumps = [asyncio.create_task(pump(i, r)) for i, r in enumerate(runnings)]
    try:
        left = len(runnings)
        while left:
            index, item = await queue.get()
            left -= not isinstance(item, Chunk)
            yield index, item
    finally:
        for task in pumps:
            task.cancel()


async def sse(runnings: Sequence[Running], watcher: asyncio.Task[None], shape: Shape, *,
              include_usage: bool, continuous_usage: bool) -> AsyncIterator[ServerSentEvent]:
    held: list[list[TokenLogprob]] = [[] for _ in runnings]  # of tokens whose text is held back
    done: list[Finished] = []
    prompt_tokens = len(runnings[0].gen.request.prompt_ids)
    tokens = 0  # committed so far, every choice

    def so_far() -> dict | None:
        if not continuous_usage:
            return None
        return {"usage": {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                          "total_tokens": prompt_tokens + tokens}}

    try:
        for i in range(len(runnings)):
            yield _data(shape.chunk(i, "", first=True, extra=so_far()))
        async for index, item in merged(runnings):
            if isinstance(item, Chunk):
                held[index] += item.logprobs
                tokens += len(item.token_ids)
                if item.text:
                    yield _data(shape.chunk(index, item.text, logprobs=held[index], extra=so_far()))
                    held[index] = []
                continue
            if item is not None:  # the generation failed after the response began
                yield _data(error_json(item))
                break
            running = runnings[index]
            if running.result is None:
                return  # cancelled: the client is gone
            finished = Finished(running.finished(), running.stop_reason)
            done.append(finished)
            extra = so_far() or {}
            if len(done) == len(runnings) and not include_usage:
                extra["metrics"] = spec_metrics(combined([d.result.stats for d in done]))
            yield _data(shape.chunk(index, "", finish=finished, logprobs=held[index], extra=extra))
        else:
            if include_usage:
                ordered = [r.result for r in runnings]
                stats = combined([r.stats for r in ordered if r is not None])
                yield _data(shape.usage_chunk(stats, serving_drafts(runnings)))
        yield ServerSentEvent(data="[DONE]")
    finally:
        watcher.cancel()
        for running in runnings:
            running.cancel()


def serving_drafts(runnings: Sequence[Running]) -> str:
    """The draft workers that served a request's choices ("" for none), each once."""
    return ",".join(dict.fromkeys(r.serving_draft for r in runnings if r.serving_draft))


def _data(obj: dict) -> ServerSentEvent:
    return ServerSentEvent(data=json.dumps(obj, separators=(",", ":")))
