"""OpenAI/vLLM request semantics as a vLLM user meets them: the real ``openai`` package, curl and
gRPC against a local trio (redis-server, card-cache, card-draft, card-target as subprocesses, no
option a vLLM user would not set beyond the model), every answer held against in-process plain
decoding of the same float64 checkpoint.

- an omitted ``max_tokens`` (or gRPC ``max_new_tokens`` 0) is the rest of the context;
- a sampled request without ``seed`` gets a fresh one, returned (``seed``, ``x-card-seed``, gRPC
  ``Final.seed``) and replaying the answer; an explicit 0 stays 0;
- ``n`` choices, choice i with seed ``seed + i``, streaming included;
- ``stop_token_ids`` and ``include_stop_str_in_output``, card equal to plain decoding token for
  token, greedy and seeded, alone and 8 in flight;
- unknown fields ignored (one debug line), known ones that would change the output refused;
- ``/tokenize``, ``/detokenize``, ``--chat-template`` and ``chat_template_kwargs``.

The draft is the target's own weights and the target has idle layers (same tokens, dearer
forwards), so the draft is ahead and stops fall inside multi-token commits."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from card.common.channels import channel
from card.common.tensors import ids_from_msg, ids_to_msg
from card.engine.loading.models import ModelConfig, load_model
from card.engine.shared.config import SamplingParams, StopParams
from card.engine.shared.errors import InvalidArgument
from card.target_service.config import TargetConfig
from card.target_service.openai_schemas import ChatBody, CompletionBody
from card.target_service.validation import MAX_CHOICES, Validator, choice_seed
from card.v1 import common_pb2, target_pb2, target_pb2_grpc
from tests.services.e2e_support import torch_threads, vanilla_reference
from tests.tiny_models import save_tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WINDOW = 144  # --max-model-len: prompt + new tokens of a request (room for more than 128 new ones)
PROMPT = "Write a haiku about the sea."
BUDGET = 32  # new tokens of the stop cases
# a Qwen3-style template: enable_thinking false adds an empty thinking block to the generation prompt
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
            "{% endif %}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("semantics-model") / "target"
    return save_tiny_checkpoint(path, seed=0, idle_layers=4)


@pytest.fixture(scope="module")
def trio(redis_server, checkpoint, tmp_path_factory):
    from card.client.trio import LocalTrio

    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    trio = LocalTrio(speculation="always", target_model=str(checkpoint), draft_model=str(checkpoint),
                     draft_name="same", target_threads=1, draft_threads=1, dtype="float64",
                     log_dir=tmp_path_factory.mktemp("semantics-logs"), redis_url=redis_server.url,
                     http_port=0, start_timeout_s=240,
                     extra_args={"cache": ["--redis-prefix", f"sem-{uuid.uuid4().hex[:8]}:"],
                                 "target": ["--max-model-len", str(WINDOW),
                                            "--chat-template", str(template)]})
    with trio:
        yield trio


@pytest.fixture(scope="module")
def model(checkpoint):
    loaded = load_model(ModelConfig(str(checkpoint), dtype="float64", exact=True))
    loaded.tokenizer.chat_template = TEMPLATE  # as --chat-template sets it in the target
    return loaded


@pytest.fixture(scope="module")
def reference(model):
    """In-process plain decoding on one thread (the target's): what every answer must equal."""
    run = vanilla_reference(model)

    def one_thread(ids: list[int], sampling: SamplingParams, stop: StopParams):
        with torch_threads(1):
            return run(ids, sampling, stop)

    return one_thread


@pytest.fixture(scope="module")
def prompt_ids(model) -> list[int]:
    return model.encode_prompt(PROMPT, chat=False)


@pytest.fixture(scope="module")
def api(trio) -> openai.OpenAI:
    # as a vLLM user points the client at a local server: any key, the base URL
    return openai.OpenAI(base_url=f"http://{trio.http_addr}/v1", api_key="EMPTY", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(api) -> str:
    (served,) = api.models.list().data
    return served.id


def sampled(seed: int, temperature: float = 0.9) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_p=0.95, seed=seed)


def first_new(tokens: list[int], start: int) -> int:
    """A position >= start whose token appears there for the first time (a stop token id that
    ends the generation exactly there)."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


# ---- max_tokens --------------------------------------------------------------------------------
def test_no_max_tokens_is_the_rest_of_the_context(trio, api, model_id, prompt_ids):
    got = api.completions.create(model=model_id, prompt=prompt_ids, temperature=0,
                                 extra_body={"ignore_eos": True})
    rest = WINDOW - len(prompt_ids)
    assert rest > 128  # the old default cut every such answer at 128 tokens
    assert got.usage.completion_tokens == rest and got.choices[0].finish_reason == "length"
    request = target_pb2.GenerateRequest(prompt=PROMPT, chat=target_pb2.CHAT_OFF, ignore_eos=True,
                                         mode="vanilla")  # max_new_tokens 0: the rest, as over HTTP
    with channel(trio.target_addr) as ch:
        final = list(target_pb2_grpc.TargetServiceStub(ch).Generate(request, timeout=120))[-1].final
    assert final.stats.new_tokens == rest and final.text == got.choices[0].text


# ---- seeds -------------------------------------------------------------------------------------
def test_a_request_without_a_seed_gets_a_fresh_one_that_replays_it(api, model_id, prompt_ids, reference):
    body = dict(model=model_id, prompt=prompt_ids, max_tokens=16, temperature=1.0,
                extra_body={"ignore_eos": True})
    first = api.completions.with_raw_response.create(**body)
    second = api.completions.with_raw_response.create(**body)
    answers = [first.parse(), second.parse()]
    seeds = [a.model_extra["seed"] for a in answers]
    assert [int(first.headers["x-card-seed"]), int(second.headers["x-card-seed"])] == seeds
    assert seeds[0] != seeds[1] and all(0 < s < 2**63 for s in seeds)
    assert answers[0].choices[0].text != answers[1].choices[0].text  # "regenerate" regenerates
    for answer, seed in zip(answers, seeds, strict=True):
        replay = api.completions.create(**{**body, "seed": seed})
        assert replay.choices[0].text == answer.choices[0].text and replay.model_extra["seed"] == seed
        want = reference(prompt_ids, SamplingParams(temperature=1.0, seed=seed),
                         StopParams(16, ignore_eos=True))
        assert answer.choices[0].text == want.text
    # an explicit 0 is a seed like any: kept, and the same answer each time (it was every unseeded one's)
    zero = [api.completions.create(**{**body, "seed": 0}) for _ in range(2)]
    assert [z.model_extra["seed"] for z in zero] == [0, 0]
    assert zero[0].choices[0].text == zero[1].choices[0].text != answers[0].choices[0].text
    # greedy draws nothing: its seed stays 0
    greedy = api.completions.create(**{**body, "temperature": 0})
    assert greedy.model_extra["seed"] == 0


def test_grpc_without_a_seed_gets_one_in_final(trio, prompt_ids, reference):
    def final(sampling: common_pb2.SamplingParams) -> target_pb2.Final:
        request = target_pb2.GenerateRequest(prompt=PROMPT, chat=target_pb2.CHAT_OFF, sampling=sampling,
                                             max_new_tokens=16, ignore_eos=True)
        with channel(trio.target_addr) as ch:
            return list(target_pb2_grpc.TargetServiceStub(ch).Generate(request, timeout=60))[-1].final

    drawn = final(common_pb2.SamplingParams(temperature=0.8))
    assert drawn.seed != 0
    budget = StopParams(16, ignore_eos=True)
    want = reference(prompt_ids, SamplingParams(temperature=0.8, seed=drawn.seed), budget)
    assert ids_from_msg(drawn.token_ids) == want.token_ids
    zero = final(common_pb2.SamplingParams(temperature=0.8, seed=0))  # set: presence, kept
    assert zero.seed == 0
    assert ids_from_msg(zero.token_ids) == reference(prompt_ids, SamplingParams(temperature=0.8, seed=0),
                                                     budget).token_ids


# ---- n -------------------------------------------------------------------------------------------
def test_n_choices_are_the_requests_of_seed_plus_i(api, model_id, prompt_ids, reference):
    assert choice_seed(7, 0) == 7 and choice_seed(7, 3) == 10 and choice_seed(2**64 - 1, 1) == 0
    messages = [{"role": "user", "content": PROMPT}]
    kwargs = dict(model=model_id, messages=messages, max_tokens=20, temperature=0.9, seed=11,
                  extra_body={"ignore_eos": True})
    whole = api.chat.completions.create(n=3, **kwargs)
    assert [c.index for c in whole.choices] == [0, 1, 2] and whole.model_extra["seed"] == 11
    texts = [c.message.content for c in whole.choices]
    assert len(set(texts)) == 3  # independent samples
    assert whole.usage.completion_tokens == 60
    assert whole.usage.prompt_tokens == api.chat.completions.create(n=1, **kwargs).usage.prompt_tokens
    for i, text in enumerate(texts):  # choice i is the request alone with seed 11 + i
        alone = api.chat.completions.create(**{**kwargs, "seed": 11 + i})
        assert alone.choices[0].message.content == text
    # streaming: the same choices, interleaved by index
    pieces: dict[int, str] = {}
    finished = set()
    for chunk in api.chat.completions.create(n=3, stream=True, **kwargs):
        for choice in chunk.choices:
            pieces[choice.index] = pieces.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished.add(choice.index)
    assert [pieces[i] for i in range(3)] == texts and finished == {0, 1, 2}
    # no seed: one drawn for the request, choice i replayed by seed + i
    drawn = api.completions.create(model=model_id, prompt=prompt_ids, n=2, max_tokens=12, temperature=1.0,
                                   extra_body={"ignore_eos": True})
    seed = drawn.model_extra["seed"]
    for i, choice in enumerate(drawn.choices):
        want = reference(prompt_ids, SamplingParams(temperature=1.0, seed=seed + i),
                         StopParams(12, ignore_eos=True))
        assert choice.text == want.text


@pytest.mark.parametrize("n", [0, MAX_CHOICES + 1])
def test_n_is_bounded(api, model_id, n):
    with pytest.raises(openai.BadRequestError, match=f"n must be in \\[1, {MAX_CHOICES}\\]"):
        api.completions.create(model=model_id, prompt="hi", n=n, max_tokens=2)


# ---- stop_token_ids, include_stop_str_in_output: card == plain decoding ---------------------------
def stop_cases(prompt_ids: list[int], reference) -> list[tuple[SamplingParams, StopParams, str]]:
    """(sampling, stops, what ends it) cases whose ends fall mid-answer: a stop token id (its text
    left out or kept) and a stop string kept in the text; greedy and seeded."""
    cases = []
    for k, sampling in enumerate([SamplingParams(), sampled(3), sampled(4, 0.7)]):
        free = reference(prompt_ids, sampling, StopParams(BUDGET, ignore_eos=True))
        p = first_new(free.token_ids, 6 + 3 * k)
        ids = (free.token_ids[p], 48000)
        cases.append((sampling, StopParams(BUDGET, ignore_eos=True, stop_token_ids=ids,
                                           include_stop_str=k % 2 == 1), "token"))
        text = free.text
        stop = text[len(text) // 2: len(text) // 2 + 3]
        if stop.strip():
            cases.append((sampling, StopParams(BUDGET, stop=(stop,), ignore_eos=True, include_stop_str=True),
                          "string"))
    return cases


def http_body(model_id: str, prompt_ids: list[int], sampling: SamplingParams, stop: StopParams) -> dict:
    extra = {"ignore_eos": True, "stop_token_ids": list(stop.stop_token_ids),
             "include_stop_str_in_output": stop.include_stop_str}
    body = dict(model=model_id, prompt=prompt_ids, max_tokens=stop.max_new_tokens,
                temperature=sampling.temperature, top_p=sampling.top_p, extra_body=extra)
    if not sampling.greedy:
        body["seed"] = sampling.seed
    if stop.stop:
        body["stop"] = list(stop.stop)
    return body


def test_stop_token_ids_end_where_plain_decoding_ends(trio, api, model_id, prompt_ids, reference, model):
    """One case by hand against an oracle that is not the stop code: the tokens end at the stop
    token (kept), the text is the decode of the tokens before it (or of all with
    include_stop_str_in_output), over HTTP and gRPC, card and vanilla."""
    free = reference(prompt_ids, sampled(3), StopParams(40, ignore_eos=True))
    p = first_new(free.token_ids, 10)
    stop_id = free.token_ids[p]
    for include in (False, True):
        want_text = model.decode(free.token_ids[: p + 1 if include else p])
        for mode in ("card", "vanilla"):
            extra = {"ignore_eos": True, "stop_token_ids": [stop_id], "mode": mode,
                     "include_stop_str_in_output": include}
            got = api.completions.create(model=model_id, prompt=prompt_ids, max_tokens=40, temperature=0.9,
                                         top_p=0.95, seed=3, extra_body=extra)
            choice = got.choices[0]
            assert choice.text == want_text and choice.finish_reason == "stop"
            assert choice.model_extra["stop_reason"] == stop_id and got.usage.completion_tokens == p + 1
            request = target_pb2.GenerateRequest(
                prompt_ids=ids_to_msg(prompt_ids), max_new_tokens=40, ignore_eos=True, mode=mode,
                sampling=common_pb2.SamplingParams(temperature=0.9, top_p=0.95, seed=3),
                stop_token_ids=[stop_id], include_stop_str_in_output=include)
            with channel(trio.target_addr) as ch:
                final = list(target_pb2_grpc.TargetServiceStub(ch).Generate(request, timeout=60))[-1].final
            assert ids_from_msg(final.token_ids) == free.token_ids[: p + 1]
            assert final.text == want_text and final.finish_reason == "stop"
    # negative control: without the stop id the answer runs on past it
    assert len(free.token_ids) == 40 and model.decode(free.token_ids) != model.decode(free.token_ids[:p])


def test_stops_through_card_equal_plain_decoding_alone_and_eight_in_flight(api, model_id, prompt_ids,
                                                                           reference):
    cases = stop_cases(prompt_ids, reference)
    assert len(cases) >= 5
    wants = [reference(prompt_ids, sampling, stop) for sampling, stop, _ in cases]
    assert all(w.finish_reason == "stop" and len(w.token_ids) < BUDGET for w in wants)  # each ends early

    def ask(case: tuple[SamplingParams, StopParams, str]):
        sampling, stop, _ = case
        return api.completions.create(**http_body(model_id, prompt_ids, sampling, stop))

    alone = [ask(case) for case in cases]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, (cases * 2)[:8]))
    for got, want in zip(alone + together, wants + (wants * 2)[:8], strict=True):
        assert got.choices[0].text == want.text
        assert got.usage.completion_tokens == len(want.token_ids)
        assert got.choices[0].finish_reason == "stop"
    assert any(got.usage.model_extra["card"]["accepted_draft_tokens"] > 0 for got in alone + together)
    # negative control: another seed gives another answer, so equality above is not for free
    k = next(i for i, c in enumerate(cases) if not c[0].greedy)
    sampling, stop, _ = cases[k]
    other = reference(prompt_ids, dataclasses.replace(sampling, seed=sampling.seed + 100), stop)
    assert other.text != wants[k].text


# ---- fields ----------------------------------------------------------------------------------------
def test_fields_a_client_adds_are_ignored_and_streams_carry_usage(api, model_id):
    messages = [{"role": "user", "content": PROMPT}]
    plain = api.chat.completions.create(model=model_id, messages=messages, max_tokens=8, temperature=0)
    extras = dict(metadata={"run": "x"}, store=False, service_tier="auto", user="someone",
                  extra_body={"no_such_field": 1, "chat_template_kwargs": {}})
    noisy = api.chat.completions.create(model=model_id, messages=messages, max_tokens=8, temperature=0,
                                        **extras)
    assert noisy.choices[0].message.content == plain.choices[0].message.content
    usage = []
    text = ""
    options = {"include_usage": True, "continuous_usage_stats": True}
    for chunk in api.chat.completions.create(model=model_id, messages=messages, max_tokens=8, temperature=0,
                                             stream=True, stream_options=options, **extras):
        usage.append(chunk.usage.completion_tokens)
        text += "".join(c.delta.content or "" for c in chunk.choices)
    assert text == plain.choices[0].message.content
    assert usage == sorted(usage) and usage[-1] == 8


@pytest.mark.parametrize("extra", [{"guided_json": {"type": "objectx"}}, {"use_beam_search": True},
                                   {"add_generation_prompt": False}, {"chat_template": "{{ 1 }}"},
                                   {"chat_template_kwargs": {"tokenize": False}}, {"stop_token_ids": [10**6]},
                                   {"seed": 2**64}])
def test_fields_that_would_change_the_output_are_refused(api, model_id, extra):
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=2, extra_body=extra)


def test_unknown_fields_make_one_debug_line(model, caplog):
    validator = Validator(model, WINDOW, TargetConfig(model=ModelConfig("default")))
    body = {"model": model.name, "prompt": "hi", "store": True, "use_beam_search": False,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True, "other": 1}}
    with caplog.at_level(logging.DEBUG, logger="card.target_service.openai_schemas"):
        CompletionBody.model_validate(body).valid(validator)
    lines = [r.getMessage() for r in caplog.records if "ignored fields" in r.getMessage()]
    assert lines == ["ignored fields this server does not know: store, use_beam_search, stream_options.other"]
    message = {"role": "user", "content": "hi", "reasoning": "none"}
    chat = ChatBody.model_validate({"model": model.name, "messages": [message]})
    assert chat.unknown() == ["messages[0].reasoning"]


# ---- templates, /tokenize, /detokenize ------------------------------------------------------------
def test_tokenize_detokenize_and_chat_template_kwargs(trio, model, prompt_ids, model_id):
    url = f"http://{trio.http_addr}"
    got = httpx.post(f"{url}/tokenize", json={"model": model_id, "prompt": PROMPT}, timeout=30).json()
    assert got == {"count": len(prompt_ids), "max_model_len": WINDOW, "tokens": prompt_ids}
    back = httpx.post(f"{url}/detokenize", json={"tokens": prompt_ids}, timeout=30).json()
    assert back == {"prompt": PROMPT}
    messages = [{"role": "user", "content": PROMPT}]
    plain = httpx.post(f"{url}/tokenize", json={"messages": messages}, timeout=30).json()
    assert plain["tokens"] == model.encode_prompt(messages, True)  # the --chat-template's
    thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    off = httpx.post(f"{url}/tokenize", json={"messages": messages, **thinking}, timeout=30).json()
    assert model.decode(off["tokens"]).endswith("<think>\n\n</think>\n\n") and off["count"] > plain["count"]
    assert not model.decode(plain["tokens"]).endswith("</think>\n\n")
    # the chat endpoint reads the same prompt: its usage counts the thinking block
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0)
    thinking_off = api.chat.completions.create(model=model_id, messages=messages, max_tokens=1,
                                               extra_body=thinking)
    assert thinking_off.usage.prompt_tokens == off["count"]
    for bad in ({"tokens": [-1]}, {"tokens": [10**6]}):
        assert httpx.post(f"{url}/detokenize", json=bad, timeout=30).status_code == 400
    assert httpx.post(f"{url}/tokenize", json={}, timeout=30).status_code == 400
    other = httpx.post(f"{url}/tokenize", json={"model": "other", "prompt": "x"}, timeout=30)
    assert other.status_code == 404


def test_chat_template_flag_reads_a_file_or_the_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    base = ModelConfig("default")
    assert TargetConfig(model=base, chat_template=str(path)).chat_template_text == TEMPLATE
    inline = TargetConfig(model=base, chat_template="{{ messages[0]['content'] }}\\n").chat_template_text
    assert inline == "{{ messages[0]['content'] }}\n"  # one line on a command line, escapes read
    with pytest.raises(InvalidArgument, match="neither a file nor a Jinja template"):
        TargetConfig(model=base, chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(InvalidArgument, match="does not parse as Jinja"):
        TargetConfig(model=base, chat_template="{% for %}")


# ---- curl, as the vLLM docs show it ----------------------------------------------------------------
def test_curl_chat_without_model_or_max_tokens(trio):
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    # a long question: the rest of the context, what an answer without max_tokens gets, is short
    body = json.dumps({"messages": [{"role": "user", "content": " ".join([PROMPT] * 12)}],
                       "temperature": 0.7, "ignore_eos": True, "metadata": {"k": "v"}})
    out = subprocess.run([curl, "-si", f"http://{trio.http_addr}/v1/chat/completions", "-H",
                          "Content-Type: application/json", "-d", body],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    head, _, payload = out.partition("\n\n")  # text mode: the CRLFs read as newlines
    reply = json.loads(payload)
    seed = reply["seed"]
    assert f"x-card-seed: {seed}" in head.lower()
    assert reply["usage"]["completion_tokens"] < 40
    assert reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"] == WINDOW
    assert reply["choices"][0]["finish_reason"] == "length"


# ---- the stream's keep-alive -------------------------------------------------------------------
def test_an_idle_stream_gets_keep_alive_comments(model, monkeypatch):
    """sse-starlette's pings (a comment line) ride a stream while the answer is under way, so a
    proxy does not close it; the openai client skips them. In-process front, pings every 20 ms."""
    from card.engine.shared.kv_pool import KVPool
    from card.engine.target.scheduler import TargetEngine
    from card.target_service import openai_api
    from card.target_service.engine_loop import EngineLoop
    from card.target_service.frontend import Frontend
    from card.target_service.openai_api import HttpServer, create_app

    loop = EngineLoop(TargetEngine(model.model, KVPool(model.model, slots=1, max_len=WINDOW)), threads=1)
    loop.start()
    front = Frontend(TargetConfig(model=ModelConfig("default")), None)
    front.ready(model, loop)
    server = HttpServer(create_app(front), "127.0.0.1", 0, grace_s=1.0)
    server.start()
    body = {"prompt": PROMPT, "max_tokens": 60, "temperature": 0.5, "stream": True, "ignore_eos": True}
    default = openai_api.PING_S

    def stream(ping_s: float) -> tuple[int, list[str]]:
        monkeypatch.setattr(openai_api, "PING_S", ping_s)
        with httpx.stream("POST", f"http://127.0.0.1:{server.port}/v1/completions", json=body,
                          timeout=60) as reply:
            return int(reply.headers["x-card-seed"]), list(reply.iter_lines())

    try:
        seed, lines = stream(0.02)
        assert any(line.startswith(":") for line in lines), "no keep-alive comment on a running stream"
        assert [line for line in lines if line.startswith("data:")][-1] == "data: [DONE]"
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert {e["seed"] for e in events} == {seed} and seed != 0
        # negative control: at the default 15 s, a stream this short gets none
        assert not any(line.startswith(":") for line in stream(default)[1])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="EMPTY", max_retries=0)
        text = "".join(c.choices[0].text for c in client.completions.create(
            model=model.name, prompt=PROMPT, max_tokens=60, temperature=0.5, seed=seed, stream=True,
            extra_body={"ignore_eos": True}) if c.choices)
        assert text == "".join(c["text"] for e in events for c in e["choices"])  # pings skipped, replayed
    finally:
        server.stop(5)
        loop.stop()


# ---- an agent-style client ---------------------------------------------------------------------
def test_langchain_chat_openai_as_an_agent_framework_builds_it(trio, model_id, model, reference):
    """LangChain's ``ChatOpenAI``, constructed as an agent framework does (the base URL, any key,
    the served name, nothing vLLM-specific): a multi-turn conversation with a system prompt, the
    same conversation streamed (LangChain asks for the usage chunk), a concurrent batch, a stop
    sequence and a seeded sample, each answer equal to plain decoding of the chat-templated prompt."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    base = dict(base_url=f"http://{trio.http_addr}/v1", api_key="EMPTY", model=model_id, max_retries=0,
                timeout=120)
    turns = [SystemMessage("You are terse."), HumanMessage(PROMPT), AIMessage("Waves fold over stones."),
             HumanMessage("Another, about the wind.")]
    roles = {"system": "system", "human": "user", "ai": "assistant"}
    ids = model.encode_prompt([{"role": roles[m.type], "content": m.content} for m in turns])

    greedy = ChatOpenAI(**base, temperature=0, max_tokens=BUDGET)
    answer = greedy.invoke(turns)
    want = reference(ids, SamplingParams(), StopParams(BUDGET))
    assert answer.content == want.text and want.token_ids  # a real answer, not an empty match
    assert answer.response_metadata["finish_reason"] == want.finish_reason
    assert answer.usage_metadata["input_tokens"] == len(ids)
    assert answer.usage_metadata["output_tokens"] == len(want.token_ids)

    chunks = list(greedy.stream(turns, stream_usage=True))  # the usage chunk, as LangChain asks for it
    assert "".join(c.content for c in chunks) == want.text
    assert sum((c.usage_metadata or {}).get("output_tokens", 0) for c in chunks) == len(want.token_ids)

    # a batch runs concurrently (LangChain's thread pool): each answer is the request alone
    prompts = [[HumanMessage(f"{PROMPT} Number {i}.")] for i in range(4)]
    batch = greedy.batch(prompts, config={"max_concurrency": 4})
    for message, prompt in zip(batch, prompts, strict=True):
        alone = reference(model.encode_prompt([{"role": "user", "content": prompt[0].content}]),
                          SamplingParams(), StopParams(BUDGET))
        assert message.content == alone.text

    # a stop sequence LangChain passes per call: the text is cut before it
    cut = next(i for i in range(4, len(want.text)) if want.text[i].isalpha())
    stop = want.text[cut:cut + 2]
    stopped = greedy.invoke(turns, stop=[stop])
    assert stopped.content == want.text[:want.text.index(stop)]
    assert stopped.response_metadata["finish_reason"] == "stop"

    seeded = ChatOpenAI(**base, temperature=0.9, top_p=0.95, seed=5, max_tokens=BUDGET).invoke(turns)
    drawn = reference(ids, SamplingParams(temperature=0.9, top_p=0.95, seed=5), StopParams(BUDGET))
    assert seeded.content == drawn.text
    assert drawn.text != want.text  # negative control: the seed and temperature reached the server
