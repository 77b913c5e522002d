"""Structured outputs and tool calls through the OpenAI API, as an agent framework meets them: the
real ``openai`` package against a local trio (redis-server, card-cache, the model-free card-draft,
card-target as subprocesses) serving the embedded SmolLM2-135M-Instruct.

- ``chat.completions.parse(response_format=PydanticModel)`` returns a valid instance;
- a ``json_schema`` answer validates against its schema; ``json_object`` parses;
- vLLM's ``structured_outputs`` (regex, choice) and ``guided_choice`` hold;
- ``tool_choice`` required / a named function: ``tool_calls`` with JSON arguments that validate,
  finish_reason ``tool_calls``; streamed, the deltas reassemble into the same calls;
- ``tool`` messages and assistant ``tool_calls`` in the conversation are served;
- bad schemas and bad tool choices are a 400 naming the problem;
- card (speculating, with the grammar's drafts) answers what plain decoding (mode vanilla)
  answers, token for token (greedy and seeded), through the API.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from card.client.remote import generate_remote
from card.client.trio import LocalTrio
from card.engine.shared.config import Constraint, SamplingParams, StopParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: float
    continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 24}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def trio(redis_server, tmp_path_factory, smollm2_gguf):
    with LocalTrio(speculation="always", target_model=str(smollm2_gguf), draft_model="ngram",
                   draft_name="ngram", target_threads=1, draft_threads=1,
                   log_dir=tmp_path_factory.mktemp("structured-logs"), redis_url=redis_server.url,
                   http_port=0, start_timeout_s=400,
                   extra_args={"cache": ["--redis-prefix", f"structured-{uuid.uuid4().hex[:8]}:"]}) as trio:
        yield trio


@pytest.fixture(scope="module")
def api(trio) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{trio.http_addr}/v1", api_key="EMPTY", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model_id(api) -> str:
    (served,) = api.models.list().data
    return served.id


def test_parse_returns_a_valid_pydantic_instance(api, model_id) -> None:
    completion = api.chat.completions.parse(
        model=model_id, messages=[{"role": "user", "content": "Describe the city of Tokyo as JSON."}],
        response_format=City, max_tokens=80, temperature=0)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, City)
    assert City.model_validate_json(message.content or "") == message.parsed


def test_json_schema_and_json_object_answers_hold(api, model_id) -> None:
    schema = City.model_json_schema()
    schema["additionalProperties"] = False
    answer = api.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Describe Nairobi."}], max_tokens=80,
        temperature=0.7, seed=3,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": schema, "strict": True}})
    text = answer.choices[0].message.content or ""
    value = json.loads(text)
    assert set(value) == set(schema["required"]) and value["continent"] in ("Europe", "Asia", "Africa",
                                                                           "America", "Oceania")
    City.model_validate(value)
    obj = api.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "A JSON object "
                                                                 "about a cat, please."}],
                                      max_tokens=60, temperature=0, response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    else:  # cut by the budget: a prefix of an object
        assert (obj.choices[0].message.content or "").startswith("{")


def test_vllm_structured_outputs_and_guided_fields(api, model_id) -> None:
    regex = api.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Give me a date."}], max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"}})
    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", regex.choices[0].message.content or "")
    for extra in ({"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
                  {"guided_choice": ["yes", "no", "maybe"]}):
        answer = api.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=8,
            temperature=0.8, seed=5, extra_body=extra)
        assert answer.choices[0].message.content in ("yes", "no", "maybe")
    completion = api.completions.create(model=model_id, prompt="The answer is", max_tokens=8, temperature=0,
                                        extra_body={"guided_regex": r" (true|false)"})
    assert completion.choices[0].text in (" true", " false")


def _check_call(call, tools=TOOLS) -> dict:
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id and call.function.name in spec
    args = json.loads(call.function.arguments)
    params = spec[call.function.name]
    assert set(args) == set(params["required"])
    for key, rule in params["properties"].items():
        if "enum" in rule:
            assert args[key] in rule["enum"]
    return args


def test_a_required_tool_call_comes_back_as_tool_calls(api, model_id) -> None:
    answer = api.chat.completions.create(model=model_id, messages=ASK_WEATHER, tools=TOOLS,
                                         tool_choice="required", max_tokens=80, temperature=0,
                                         parallel_tool_calls=False)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert choice.message.tool_calls and len(choice.message.tool_calls) == 1
    assert choice.message.content is None
    _check_call(choice.message.tool_calls[0])
    # parallel calls allowed: a small model may call again and again until the budget; every
    # whole call comes back as a call
    several = api.chat.completions.create(model=model_id, messages=ASK_WEATHER, tools=TOOLS,
                                          tool_choice="required", max_tokens=80, temperature=0)
    assert several.choices[0].finish_reason == "tool_calls"
    for call in several.choices[0].message.tool_calls or []:
        _check_call(call)
    named = api.chat.completions.create(model=model_id, messages=ASK_WEATHER, tools=TOOLS, max_tokens=60,
                                        tool_choice={"type": "function", "function": {"name": "get_time"}},
                                        temperature=0.9, seed=1, parallel_tool_calls=False)
    (call,) = named.choices[0].message.tool_calls or []
    assert call.function.name == "get_time" and named.choices[0].finish_reason == "tool_calls"
    _check_call(call)


def test_streamed_tool_call_deltas_reassemble(api, model_id) -> None:
    whole = api.chat.completions.create(model=model_id, messages=ASK_WEATHER, tools=TOOLS,
                                        tool_choice="required", max_tokens=80, temperature=0)
    calls: dict[int, dict] = {}
    finish = None
    stream = api.chat.completions.create(model=model_id, messages=ASK_WEATHER, tools=TOOLS,
                                         tool_choice="required", max_tokens=80, temperature=0, stream=True)
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                slot = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = delta.id or slot["id"]
                if delta.function is not None:
                    slot["name"] += delta.function.name or ""
                    slot["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    expected = whole.choices[0].message.tool_calls or []
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in expected]
    assert all(c["id"] for c in calls.values())


def test_a_conversation_with_tool_results_is_served(api, model_id) -> None:
    first = api.chat.completions.create(model=model_id, messages=ASK_WEATHER, tools=TOOLS,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        max_tokens=60, temperature=0)
    call = (first.choices[0].message.tool_calls or [])[0]
    messages = [*ASK_WEATHER,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.id, "type": "function",
                     "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                {"role": "tool", "tool_call_id": call.id,
                 "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    answer = api.chat.completions.create(model=model_id, messages=messages, tools=TOOLS, max_tokens=24,
                                         temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(("extra", "needle"), [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}, "objectx"),
    ({"extra_body": {"structured_outputs": {"regex": "([a-z"}}}, "regex"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"}, "name"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}},
     "one output constraint"),
])
def test_bad_constraints_are_a_400_naming_the_problem(api, model_id, extra, needle) -> None:
    with pytest.raises(openai.BadRequestError, match=re.escape(needle)):
        api.chat.completions.create(model=model_id, messages=ASK_WEATHER, max_tokens=8, **extra)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 9}],
                         ids=["greedy", "seeded"])
def test_constrained_card_answers_what_plain_decoding_answers(api, model_id, sampling) -> None:
    """Speculating (the model-free drafter and the grammar's drafts) or not, the same tokens."""
    schema = City.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    answers = {}
    for mode in ("vanilla", "card"):
        answer = api.chat.completions.create(
            model=model_id, messages=[{"role": "user", "content": "Describe Lima as JSON."}], max_tokens=64,
            response_format=fmt, extra_body={"mode": mode}, **sampling)
        answers[mode] = answer
    assert answers["card"].choices[0].message.content == answers["vanilla"].choices[0].message.content
    card, plain = answers["card"].usage, answers["vanilla"].usage
    assert card is not None and plain is not None and card.model_extra is not None
    assert card.model_extra["card"]["target_forwards"] < plain.completion_tokens  # drafts were kept


def test_the_same_through_card_v1(trio) -> None:
    """gRPC users set SamplingParams.constraint; a bad one is refused naming the problem."""
    regex = r"[A-Z][a-z]+, [A-Z][a-z]+"
    remote = generate_remote(trio.target_addr, "Name two capitals.", timeout_s=300, stop=StopParams(24),
                             sampling=SamplingParams(constraint=Constraint("regex", regex)))
    assert re.fullmatch(regex, remote.text), remote.text
    with pytest.raises(Exception, match="objectx"):
        generate_remote(trio.target_addr, "x", stop=StopParams(4), timeout_s=60,
                        sampling=SamplingParams(constraint=Constraint("json_schema", '{"type": "objectx"}')))


def test_langchain_structured_output_and_tools(trio, model_id) -> None:
    """LangChain's ChatOpenAI as an agent framework uses it, unmodified: ``with_structured_output``
    (json_schema, and function calling: a named tool) gives a valid instance, and ``bind_tools``
    with a required call gives a tool call with its arguments."""
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=f"http://{trio.http_addr}/v1", api_key="EMPTY", model=model_id, max_retries=0,
                      timeout=300, temperature=0, max_tokens=80)
    for method in ("json_schema", "function_calling"):
        city = chat.with_structured_output(City, method=method).invoke("Describe the city of Rome.")
        assert isinstance(city, City), method
    called = chat.bind_tools(TOOLS, tool_choice="required", parallel_tool_calls=False).invoke(
        "What is the weather like in Paris right now?")
    (call,) = called.tool_calls
    assert call["name"] in ("get_weather", "get_time") and isinstance(call["args"], dict) and call["id"]
