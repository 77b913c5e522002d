"""Prefix caching through card-target's OpenAI front, end to end: two card-targets as
subprocesses (caching on by default; off by CARD_TARGET_ENABLE_PREFIX_CACHING=false, the flag's
environment variable), the official ``openai`` package as the client. Questions about one
document asked in turn: the same text with caching on and off, ``usage.prompt_tokens_details.
cached_tokens`` (streamed usage too) says what was reused, and the hit counters add up."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from card.client.trio import HTTP_LISTENING, console_script
from card.engine.shared.kv_pool import PREFILL_CHUNK
from card.engine.shared.prefix_cache import PREFIX_BLOCK
from tests.services.conftest import stop_process
from tests.services.e2e_support import labelled, wait_until
from tests.tiny_models import save_tiny_checkpoint

READY = "card-target: OpenAI API on "  # the line it prints once it serves
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DOC = " ".join(f"Item {i} is the {w} one." for i, w in enumerate(
    ["red", "blue", "green", "small", "large", "old", "new", "fast", "slow", "warm"] * 5))
QUESTIONS = ["Which item is red?", "Which item is old?", "Which one is warm?", "Name a slow item."]


def _env(caching: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARD_")}
    env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if not caching:
        env["CARD_TARGET_ENABLE_PREFIX_CACHING"] = "false"
    return env


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[bool, str]]:
    """{caching: base URL} of two card-targets over one tiny checkpoint (context window 512)."""
    root = tmp_path_factory.mktemp("prefix-http")
    checkpoint = str(save_tiny_checkpoint(root / "target", seed=0))
    procs: list[tuple[subprocess.Popen, Path, Path]] = []
    try:
        for caching in (True, False):
            out, err = root / f"out-{caching}.log", root / f"err-{caching}.log"
            with open(out, "wb") as o, open(err, "wb") as e:
                procs.append((subprocess.Popen(
                    [console_script("card-target"), "--model", checkpoint, "--port", "0", "--http-port", "0",
                     "--metrics-port", "0", "--threads", "1", "--max-batch-size", "2"],
                    stdout=o, stderr=e, stdin=subprocess.DEVNULL, env=_env(caching), start_new_session=True),
                    out, err))
        urls: dict[bool, str] = {}
        for caching, (proc, out, err) in zip((True, False), procs, strict=True):
            match = None

            def listening(out: Path = out, proc: subprocess.Popen = proc, err: Path = err) -> bool:
                nonlocal match
                assert proc.poll() is None, err.read_text()[-3000:]
                text = out.read_text(errors="replace")
                match = HTTP_LISTENING.search(text)
                return match is not None and READY in text  # the model is loaded

            wait_until(listening, 180, "card-target's HTTP front")
            assert match is not None
            urls[caching] = f"http://{match.group(1)}:{match.group(2)}"
            said = "prefix caching on" if caching else "prefix caching off"
            assert said in err.read_text(), err.read_text()[-3000:]
        yield urls
    finally:
        for proc, _, _ in procs:
            stop_process(proc, 30)


def _ask(url: str, prompt: str, stream: bool) -> tuple[str, int, int]:
    """(text, prompt tokens, cached tokens) of a greedy completion."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    args = dict(model=model, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        done = client.completions.create(**args)
        usage = done.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        return done.choices[0].text, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0
    text, usage = "", None
    for chunk in client.completions.create(**args, stream=True, stream_options={"include_usage": True}):
        text += "".join(c.text for c in chunk.choices)
        usage = chunk.usage or usage  # the last chunk's: the request's usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return text, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0


def test_questions_in_turn_reuse_the_document_and_answer_the_same(targets: dict[bool, str]) -> None:
    on = [_ask(targets[True], f"{DOC}\n{q}", stream=i % 2 == 1) for i, q in enumerate(QUESTIONS)]
    off = [_ask(targets[False], f"{DOC}\n{q}", stream=i % 2 == 1) for i, q in enumerate(QUESTIONS)]
    assert [t for t, _, _ in on] == [t for t, _, _ in off]
    prompt_tokens = [p for _, p, _ in on]
    assert all(PREFILL_CHUNK < p < 2 * PREFILL_CHUNK for p in prompt_tokens), prompt_tokens
    cached = [c for _, _, c in on]
    # the document and whatever the question shares with an earlier prompt, in whole blocks (more
    # than one prefill chunk: not cut at chunk boundaries), and never the whole prompt
    assert cached[0] == 0, cached
    assert all(c % PREFIX_BLOCK == 0 and PREFILL_CHUNK < c < p
               for c, p in zip(cached[1:], prompt_tokens[1:], strict=True)), (cached, prompt_tokens)
    assert all(c == 0 for _, _, c in off)

    def counted(caching: bool, name: str, want: float) -> bool:
        model = httpx.get(f"{targets[caching]}/v1/models", timeout=10).json()["data"][0]["id"]
        page = httpx.get(f"{targets[caching]}/metrics", timeout=10).text
        return labelled(page, name, model_name=model) == want

    hits = sum(cached)
    wait_until(lambda: counted(True, "card_target_prefix_cache_hits_total", hits), 30,
               "the prefix cache's hit counter")
    wait_until(lambda: counted(True, "card_target_prefix_cache_queries_total", sum(prompt_tokens)), 30,
               "the prefix cache's query counter")
    assert counted(False, "card_target_prefix_cache_queries_total", 0)  # off: nothing is looked up
