"""The OpenAI-compatible front and cancellation, end to end: redis-server, card-cache, card-draft and
card-target (``--http-port 0 --api-key``) as subprocesses on loopback; the official ``openai``
package and curl as clients; tiny float64 checkpoints sharing the SmolLM2 tokenizer."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
import uuid

import grpc
import httpx
import openai
import pytest

from card.client.remote import generate_remote
from card.client.trio import LocalTrio, console_script
from card.common.channels import channel
from card.engine.shared.config import MAX_STOP_STRINGS, SamplingParams, StopParams
from card.v1 import cache_pb2, cache_pb2_grpc, target_pb2, target_pb2_grpc
from tests.services.e2e_support import metric, scrape, wait_until
from tests.tiny_models import save_tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

KEY = "sk-test-" + uuid.uuid4().hex
PROMPT = "Write a haiku about the sea."
LONG = 400  # new tokens of a request that is cancelled long before it ends


@pytest.fixture(scope="module")
def trio(redis_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("http-models")
    # the target: the draft's own weights plus idle layers (same tokens, dearer forwards), so the
    # draft gets ahead by construction and speculation shows in usage on a loaded CI core too
    target = str(save_tiny_checkpoint(root / "target", seed=0, idle_layers=8))
    draft = str(save_tiny_checkpoint(root / "draft", seed=0))
    prefix = f"http-{uuid.uuid4().hex[:8]}:"
    trio = LocalTrio(speculation="always",
                     target_model=target, draft_model=draft, draft_name="same", target_threads=1,
                     draft_threads=1, dtype="float64", log_dir=tmp_path_factory.mktemp("http-logs"),
                     redis_url=redis_server.url, metrics=True, http_port=0, start_timeout_s=240,
                     extra_args={"cache": ["--redis-prefix", prefix],
                                 "target": ["--max-model-len", "480", "--api-key", KEY,
                                            "--allow-rejection"]})
    with trio:
        trio.prefix = prefix
        yield trio


@pytest.fixture(scope="module")
def api(trio) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{trio.http_addr}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_id(api) -> str:
    (model,) = api.models.list().data
    return model.id


def card_client_json(trio, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARD_")}
    env["CARD_CLIENT_API_KEY"] = KEY  # the target's key guards gRPC too
    out = subprocess.run([console_script("card-client"), "generate", "--target", trio.target_addr, "--json",
                          *args], capture_output=True, text=True, env=env, timeout=120, check=True)
    return json.loads(out.stdout)


# ---- the same text as card-client -----------------------------------------------------------
def test_chat_completion_equals_card_client_streaming_and_not(trio, api, model_id):
    want = card_client_json(trio, "--chat", "--max-new-tokens", "24", "--ignore-eos", PROMPT)
    messages = [{"role": "user", "content": PROMPT}]
    whole = api.chat.completions.create(model=model_id, messages=messages, max_completion_tokens=24,
                                        temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.content == want["text"]
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 24
    pieces, usage = [], None
    for chunk in api.chat.completions.create(model=model_id, messages=messages, max_tokens=24, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
    assert "".join(pieces) == want["text"]
    assert usage is not None and usage.completion_tokens == 24


def test_completion_is_raw_text_and_speculation_shows_in_usage(trio, api, model_id):
    want = generate_remote(trio.target_addr, PROMPT, chat=False, sampling=SamplingParams(),
                           stop=StopParams(32, ignore_eos=True), draft="same", api_key=KEY)
    got = api.completions.create(model=model_id, prompt=PROMPT, max_tokens=32, temperature=0,
                                 extra_body={"ignore_eos": True, "draft": "same"})
    assert got.choices[0].text == want.text
    card = got.usage.model_extra["card"]
    assert card["mode"] == "card" and card["draft"] == "same"
    assert card["accepted_draft_tokens"] == 32 - card["target_forwards"]  # one prefill forward
    # the draft proposes the target's own tokens at a fraction of its cost; still a race on any
    # one request, so a few requests must show speculation in their usage
    cards = []
    for n in (64, 96, 128):
        reply = api.completions.create(model=model_id, prompt=PROMPT, max_tokens=n, temperature=0,
                                       extra_body={"ignore_eos": True, "draft": "same"})
        card = reply.usage.model_extra["card"]
        assert card["accepted_draft_tokens"] == n - card["target_forwards"]
        assert card["mean_accepted_length"] == pytest.approx(n / card["target_forwards"], abs=1e-4)
        cards.append(card)
        if card["hit_rate"] > 0:
            break
    assert card["hit_rate"] > 0, cards
    plain = api.completions.create(model=model_id, prompt=PROMPT, max_tokens=16, temperature=0,
                                   extra_body={"ignore_eos": True, "mode": "vanilla"})
    card = plain.usage.model_extra["card"]
    assert card["mode"] == "vanilla" and card["draft"] == "" and card["target_forwards"] == 16
    assert card["accepted_draft_tokens"] == 0 and card["hit_rate"] == 0
    ids = api.completions.create(model=model_id, prompt=want.token_ids[:5], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 5


def test_seeded_sampling_and_stop_equal_card_client(trio, api, model_id):
    want = card_client_json(trio, "--no-chat", "--max-new-tokens", "30", "--temperature", "0.9", "--top-p",
                            "0.95", "--seed", "7", "--ignore-eos", PROMPT)
    got = api.completions.create(model=model_id, prompt=PROMPT, max_tokens=30, temperature=0.9, top_p=0.95,
                                 seed=7, extra_body={"ignore_eos": True})
    assert got.choices[0].text == want["text"]
    stop = want["text"][10:14]
    assert stop.strip()
    cut = api.completions.create(model=model_id, prompt=PROMPT, max_tokens=30, temperature=0.9, top_p=0.95,
                                 seed=7, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == want["text"][:want["text"].index(stop)]


# ---- the logits processors (OpenAI's own fields natively, vLLM's through extra_body) ----------------
# what these tiny checkpoints declare as EOS (tests.tiny_models.save_tiny_checkpoint)
TINY_EOS = 2
# sized to this random model's logits (their spread is about 0.1, the top two 0.02 apart), so the
# unprocessed draft still gets tokens right; logit_bias also bans the unprocessed text's 5th token
PROCESSORS = {"frequency_penalty": 0.02, "presence_penalty": 0.01, "logit_bias": {"42": 0.03}}
VLLM_PROCESSORS = {"min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 4}


def _flags(**fields) -> list[str]:
    """card-client generate's flags for these request fields."""
    flags = [f"--logit-bias={t}={b}" for t, b in fields.pop("logit_bias", {}).items()]
    for name, value in fields.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.01, "seed": 7}],
                         ids=["greedy", "seeded"])
def test_logits_processors_through_the_openai_client_equal_plain_decoding(trio, api, model_id, sampling):
    """presence / frequency penalties and logit_bias as the openai package sends them, min_p,
    repetition_penalty and min_tokens in extra_body: card's text equals plain decoding's and
    card-client's flags' through gRPC, and its tokens differ from the unprocessed ones. The draft
    proposes the unprocessed target's tokens: some are kept (a race on any one request, so a few
    lengths are tried; the seeded case samples at a low temperature, as this random model's
    distribution is too flat for a draft's best path to match a draw at 0.1)."""
    base = card_client_json(trio, "--no-chat", "--max-new-tokens", "32", "--ignore-eos", *_flags(**sampling),
                            PROMPT)["token_ids"]
    processors = {**PROCESSORS, "logit_bias": {**PROCESSORS["logit_bias"], str(base[4]): -1.0}}

    def complete(n: int, mode: str):
        return api.completions.create(model=model_id, prompt=PROMPT, max_tokens=n, **sampling, **processors,
                                      extra_body={"ignore_eos": True, "mode": mode, **VLLM_PROCESSORS})

    kept = []
    for n in (32, 64, 96):
        card, plain = complete(n, "card"), complete(n, "vanilla")
        assert card.choices[0].text == plain.choices[0].text
        assert card.usage.completion_tokens == plain.usage.completion_tokens == n
        kept.append(card.usage.model_extra["card"]["accepted_draft_tokens"])
        if kept[-1]:
            break
    assert kept[-1] > 0, kept
    want = card_client_json(trio, "--no-chat", "--max-new-tokens", str(n), "--ignore-eos",
                            *_flags(**processors, **VLLM_PROCESSORS, **sampling), PROMPT)
    assert want["text"] == plain.choices[0].text
    assert want["token_ids"][:32] != base  # the processors changed the output


def test_min_tokens_holds_a_forced_eos_back(api, model_id):
    """logit_bias +100 on the EOS makes it every step's token: one token, then six with
    min_tokens 5 (EOS held back five times, then taken), in card and in plain decoding alike."""
    def complete(mode: str, **extra):
        return api.completions.create(model=model_id, prompt=PROMPT, max_tokens=20, temperature=0,
                                      logit_bias={str(TINY_EOS): 100}, extra_body={"mode": mode, **extra})

    assert complete("vanilla").usage.completion_tokens == 1
    for mode in ("vanilla", "card"):
        held = complete(mode, min_tokens=5)
        assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop", mode


def _chat_logprobs(api, model_id, mode: str, stream: bool, **sampling) -> list[dict]:
    kwargs = dict(model=model_id, messages=[{"role": "user", "content": PROMPT}], max_completion_tokens=40,
                  logprobs=True, top_logprobs=4, extra_body={"ignore_eos": True, "mode": mode, "draft": ""},
                  **sampling)
    if not stream:
        reply = api.chat.completions.create(**kwargs)
        return [e.model_dump() for e in reply.choices[0].logprobs.content]
    out = []
    for chunk in api.chat.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            out += [e.model_dump() for e in chunk.choices[0].logprobs.content]
    return out


def _same_logprobs(a: list[dict], b: list[dict]) -> None:
    assert [e["token"] for e in a] == [e["token"] for e in b]
    for x, y in zip(a, b, strict=True):
        assert abs(x["logprob"] - y["logprob"]) <= 1e-5
        assert [t["token"] for t in x["top_logprobs"]] == [t["token"] for t in y["top_logprobs"]]
        assert all(abs(t["logprob"] - u["logprob"]) <= 1e-5
                   for t, u in zip(x["top_logprobs"], y["top_logprobs"], strict=True))


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 5}],
                         ids=["greedy", "seeded"])
def test_logprobs_are_the_same_with_speculation_and_without(api, model_id, sampling):
    """The openai client's own parsing of chat logprobs: card equals vanilla to 1e-5, streaming
    equals non-streaming, one entry per generated token, four alternatives each."""
    want = _chat_logprobs(api, model_id, "vanilla", False, **sampling)
    assert len(want) == 40 and all(len(e["top_logprobs"]) == 4 for e in want)
    assert all(e["bytes"] == list(e["token"].encode()) for e in want)
    _same_logprobs(_chat_logprobs(api, model_id, "card", False, **sampling), want)
    _same_logprobs(_chat_logprobs(api, model_id, "card", True, **sampling), want)
    # top_logprobs 0 without logprobs asks for nothing (as vLLM reads it): served, no logprobs
    plain = api.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}],
                                        max_completion_tokens=2, top_logprobs=0, **sampling)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_shape_and_the_acceptance_metrics_object(trio, model_id):
    """Completions' logprobs (tokens, token_logprobs, top_logprobs, text_offset) and vLLM's
    metrics.speculative_decoding, whose counts add up as AIPerf checks them."""
    body = {"model": model_id, "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "logprobs": 2,
            "ignore_eos": True, "draft": "same"}
    headers = {"Authorization": f"Bearer {KEY}"}
    url = f"http://{trio.http_addr}/v1/completions"
    reply = httpx.post(url, json=body, headers=headers, timeout=60).json()
    lp = reply["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 48
    assert "".join(lp["tokens"]) == reply["choices"][0]["text"]
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert all(len(top) <= 2 and max(top.values()) >= v - 1e-9
               for top, v in zip(lp["top_logprobs"], lp["token_logprobs"], strict=True))
    spec = reply["metrics"]["speculative_decoding"]
    hist = spec["acceptance_histogram"]
    assert sum(hist) == spec["num_spec_steps"]
    assert sum(j * c for j, c in enumerate(hist)) == spec["num_accepted_draft_tokens"]
    assert spec["num_accepted_draft_tokens"] <= spec["num_draft_tokens"]
    card = reply["usage"]["card"]
    assert spec["num_accepted_draft_tokens"] == card["accepted_draft_tokens"] == 48 - card["target_forwards"]
    if spec["num_spec_steps"]:
        assert spec["mean_acceptance_length"] == pytest.approx(
            1 + spec["num_accepted_draft_tokens"] / spec["num_spec_steps"], abs=1e-5)
    assert card["verify"] == "exact" and card["lossy"] is False
    # streaming: the object rides once, on the usage chunk
    events = []
    with httpx.stream("POST", url, headers=headers, timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    carrying = [e for e in events if "metrics" in e]
    assert len(carrying) == 1 and carrying[0]["usage"]["completion_tokens"] == 48
    streamed = [t for e in events for c in e["choices"] if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]


def test_a_loose_request_is_marked_lossy(api, model_id):
    reply = api.completions.create(model=model_id, prompt=PROMPT, max_tokens=16, temperature=0,
                                   extra_body={"ignore_eos": True, "verify": "loose", "verify_window": 2,
                                               "verify_entropy_threshold": 0.0})
    card = reply.usage.model_extra["card"]
    # the draft is the target's own model: each drafted token is the target's, loose keeps none
    # that is not (the counter counts kept mismatches only), and the text is the exact one
    assert card["verify"] == "loose" and card["lossy"] is True and card["loose_kept_tokens"] == 0
    exact = api.completions.create(model=model_id, prompt=PROMPT, max_tokens=16, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert reply.choices[0].text == exact.choices[0].text


def test_a_rejection_request_verifies_drawn_chains_through_the_trio(api, model_id):
    """verify rejection end to end: the draw goes target -> cache -> draft, the draft's drawn
    nodes come back, every chain reaches the target with its proposal (no fallback to exact), and
    a greedy rejection request is plain decoding's (verified exactly, and says so)."""
    body = {"ignore_eos": True, "verify": "rejection", "seed": 5}
    # the tiny models' softmax is nearly flat: a low temperature makes drafted tokens worth verifying;
    # whether the draft is ahead on any one request is a race on a loaded core, so a few requests
    # must show verified chains, and none may fall back to exact verification
    cards = []
    for seed in range(5, 13):  # it stops at the first request with drafted tokens
        reply = api.completions.create(model=model_id, prompt=PROMPT, max_tokens=48, temperature=0.05,
                                       extra_body={**body, "seed": seed})
        card = reply.usage.model_extra["card"]
        assert card["verify"] == "rejection" and card["lossy"] is False
        assert card["rejection_fallbacks"] == 0, card
        cards.append(card)
        if card["draft_tokens"] > 0:
            break
    assert any(c["draft_tokens"] > 0 for c in cards), cards
    greedy = api.completions.create(model=model_id, prompt=PROMPT, max_tokens=16, temperature=0,
                                    extra_body=body)
    plain = api.completions.create(model=model_id, prompt=PROMPT, max_tokens=16, temperature=0,
                                   extra_body={"ignore_eos": True, "mode": "vanilla"})
    assert greedy.choices[0].text == plain.choices[0].text
    assert greedy.usage.model_extra["card"]["verify"] == "exact"


def test_curl_streams_server_sent_events(trio, model_id):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    # plain decoding: one token per forward, so the pieces count what streaming splits (with a
    # draft as good as this test's, speculation commits several tokens per piece)
    body = json.dumps({"model": model_id, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                       "stream": True, "ignore_eos": True, "mode": "vanilla"})
    cmd = [curl, "-sN", f"http://{trio.http_addr}/v1/completions", "-H", f"Authorization: Bearer {KEY}",
           "-H", "Content-Type: application/json", "-d", body]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    events = [line[len("data: "):] for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert sum(1 for t in texts if t) >= 6  # token by token (a piece per forward), not one blob
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_grpc_call_without_a_deadline_is_served(trio):
    """A call with no deadline (time_remaining() ~ forever) waits for its KV slot without limit."""
    request = target_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=4, mode="vanilla")
    with channel(trio.target_addr, KEY) as ch:
        replies = list(target_pb2_grpc.TargetServiceStub(ch).Generate(request))
    assert replies[-1].final.stats.new_tokens == 4


# ---- refusals, auth, health --------------------------------------------------------------------
@pytest.mark.parametrize("extra", [{"n": 17}, {"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21},
                                   {"verify": "lossy"}, {"verify": "loose", "verify_window": 1},
                                   {"tools": [{"type": "function", "function": {"name": "f"}}],
                                    "tool_choice": {"type": "function", "function": {"name": "g"}}},
    {"presence_penalty": 2.5}, {"logit_bias": {"49152": 1}},
    {"min_tokens": 5}, {"repetition_penalty": 0}, {"top_p": 0}, {"guided_regex": "(a+"},
    {"stop": [chr(97 + i) for i in range(MAX_STOP_STRINGS + 1)]}])
def test_fields_that_would_change_output_are_refused(api, model_id, extra):
    with pytest.raises(openai.BadRequestError) as err:
        api.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=4, extra_body=extra)
    assert err.value.status_code == 400 and err.value.body["message"]


def test_unknown_model_is_404(api):
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="no-such-model", prompt="hi", max_tokens=2)


def test_api_key_is_required_on_every_path_but_health(trio, model_id):
    for key in ("wrong", None):
        client = openai.OpenAI(base_url=f"http://{trio.http_addr}/v1", api_key=key or "x", max_retries=0,
                               default_headers={} if key else {"Authorization": ""})
        with pytest.raises(openai.AuthenticationError) as err:
            client.models.list()
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    health = httpx.get(f"http://{trio.http_addr}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert httpx.get(f"http://{trio.http_addr}/metrics", timeout=10).status_code == 401
    page = httpx.get(f"http://{trio.http_addr}/metrics", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=10).text
    assert "card_target_generations_total" in page
    # gRPC: the same key, as metadata (tests/services/test_target_auth.py has the rest)
    request = target_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=2, mode="vanilla")
    with grpc.insecure_channel(trio.target_addr) as ch, pytest.raises(grpc.RpcError) as err:
        list(target_pb2_grpc.TargetServiceStub(ch).Generate(request, timeout=30))
    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED


# ---- cancellation ------------------------------------------------------------------------------
def cache_sessions(trio) -> int:
    with grpc.insecure_channel(trio.cache_addr) as ch:
        status = cache_pb2_grpc.CacheServiceStub(ch).Status(cache_pb2.StatusRequest(), timeout=5)
    return len(status.sessions)


def draft_sessions(trio) -> float:
    return metric(scrape(trio.drafts[0].metrics_port), "card_draft_active_sessions")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def http_cancel(trio, model_id: str) -> None:
    """Open a long streaming generation, read its first pieces, drop the connection."""
    body = {"model": model_id, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"http://{trio.http_addr}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as reply:
        lines = reply.iter_lines()
        for _ in range(3):
            next(lines)
    # leaving the block closes the connection mid-stream


def grpc_cancel(trio, *, deadline: bool) -> None:
    request = target_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=LONG, ignore_eos=True)
    with channel(trio.target_addr, KEY) as ch:
        stream = target_pb2_grpc.TargetServiceStub(ch).Generate(request, timeout=0.4 if deadline else 60)
        if deadline:
            with pytest.raises(grpc.RpcError) as err:
                for _ in stream:
                    pass
            assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        else:
            next(stream)
            stream.cancel()


def background_load(trio, model_id: str, n: int, stop: threading.Event) -> list[threading.Thread]:
    """``n`` clients generating back to back until ``stop``: the batch a cancelled request leaves."""
    api = openai.OpenAI(base_url=f"http://{trio.http_addr}/v1", api_key=KEY, max_retries=0, timeout=120)

    def client() -> None:
        while not stop.is_set():
            api.completions.create(model=model_id, prompt=PROMPT, max_tokens=60, temperature=0,
                                   extra_body={"ignore_eos": True})

    threads = [threading.Thread(target=client, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.parametrize("how", ["http", "grpc-cancel", "grpc-deadline"])
def test_a_cancelled_request_frees_its_session_within_a_second_under_load(trio, model_id, how):
    stop = threading.Event()
    threads = background_load(trio, model_id, 2, stop)
    try:
        wait_until(lambda: cache_sessions(trio) == 2, what="the load to run")
        done = threading.Event()

        def cancelled() -> None:
            if how == "http":
                http_cancel(trio, model_id)
            else:
                grpc_cancel(trio, deadline=how == "grpc-deadline")
            done.set()

        worker = threading.Thread(target=cancelled)
        worker.start()
        wait_until(lambda: cache_sessions(trio) == 3 or done.is_set(), what="the request to start")
        assert done.wait(30)
        t0 = time.monotonic()
        # the load's two sessions stay; the cancelled one is gone from cache and draft within 1 s
        wait_until(lambda: cache_sessions(trio) <= 2 and draft_sessions(trio) <= 2, timeout_s=1.0,
                   what="the cancelled request's session and draft state to go")
        assert time.monotonic() - t0 <= 1.0
        worker.join()
    finally:
        stop.set()
        for t in threads:
            t.join(120)


def test_fifty_cancelled_requests_leave_nothing(trio, model_id, redis_server):
    target = next(p for p in trio.processes if p.name == "card-target")
    ways = [lambda: http_cancel(trio, model_id), lambda: grpc_cancel(trio, deadline=False),
            lambda: grpc_cancel(trio, deadline=True)]
    for i in range(10):  # warm-up: allocator pools, KV slot pages, thread pools
        ways[i % 3]()
    wait_until(lambda: cache_sessions(trio) == 0, what="no session after the warm-up")
    before = rss_mib(target.proc.pid), rss_mib(trio.drafts[0].proc.pid)
    for i in range(50):
        ways[i % 3]()
    wait_until(lambda: cache_sessions(trio) == 0 and draft_sessions(trio) == 0, timeout_s=5,
               what="no live session in the cache or the draft")
    assert metric(scrape(trio.drafts[0].metrics_port), "card_draft_kv_slots") == 0
    assert metric(scrape(trio.metrics_ports["card-cache"]), "card_cache_sessions_open") == 0
    client = redis_server.client()
    assert list(client.scan_iter(f"{trio.prefix}session:*")) == []
    after = rss_mib(target.proc.pid), rss_mib(trio.drafts[0].proc.pid)
    for b, a in zip(before, after, strict=True):
        assert a - b < 48, f"resident memory grew from {b:.0f} to {a:.0f} MiB over 50 cancelled requests"


# ---- card.client.bench.peer --client quiet against this front ----------------------------------
def test_the_quiet_peer_client_measures_the_front_and_compares_outputs(trio, model_id, tmp_path):
    """`peer run --client quiet` (httpx threads that never spin): every level's figures from the
    streamed replies, the server's own TTFT and acceptance from /metrics read around each level,
    and every output kept; `report` says how many of a second server's outputs equal the first's
    (greedy card = plain decoding), and a changed output shows (the negative control)."""
    from click.testing import CliRunner

    from card.client.bench import peer

    base = ["run", "--client", "quiet", "--url", f"http://{trio.http_addr}", "--model", model_id,
            "--prompts", "mt_bench:3", "--concurrency", "1,2", "--tokens", "8", "--api-key", KEY,
            "--out", str(tmp_path)]
    for label, extra in (("plain", '{"mode": "vanilla"}'), ("card", "{}")):
        result = CliRunner().invoke(peer.main, [*base, "--label", label, "--extra", extra])
        assert result.exit_code == 0, result.output
    plain, card = (json.loads((tmp_path / f"{label}.json").read_text()) for label in ("plain", "card"))
    for run in (plain, card):
        assert run["client"] == "quiet" and set(run["levels"]) == {"1", "2"}
        for row in run["levels"].values():
            assert row["requests"] == 3 and row["errors"] == 0
            assert row["output_tok_s"] > 0 and row["ttft_ms"] > 0 and row["itl_ms"] > 0
            assert row["server_ttft_ms"] > 0  # from the target's /metrics, behind its key
        assert all(len(texts) == 3 and all(texts) for texts in run["texts"].values())
    # acceptance comes from the spec_decode counters' movement: plain decoding never moves them
    # (whether 8-token card requests get chains in time depends on the box, so no claim for card)
    assert not any("acceptance_rate" in row for row in plain["levels"].values())
    rates = [row["acceptance_rate"] for row in card["levels"].values() if "acceptance_rate" in row]
    assert all(0.0 <= rate <= 1.0 for rate in rates)
    assert card["texts"] == plain["texts"]
    changed = dict(card, label="changed", texts={lv: [t + "!" if i == 0 else t for i, t in enumerate(texts)]
                                                 for lv, texts in card["texts"].items()})
    (tmp_path / "changed.json").write_text(json.dumps(changed))
    reports = [str(tmp_path / f"{label}.json") for label in ("plain", "card", "changed")]
    result = CliRunner().invoke(peer.main, ["report", *reports])
    assert result.exit_code == 0, result.output
    assert "card: outputs equal to plain's: 3/3 at 1, 3/3 at 2" in result.output
    assert "changed: outputs equal to plain's: 2/3 at 1, 2/3 at 2" in result.output
