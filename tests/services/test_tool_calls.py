"""Tool calls' reading and writing (target_service.tools) and the request fields that ask for a
constraint (openai_schemas), without a server: Hermes blocks parsed from whole answers and from
streamed text cut anywhere; the tools' grammar accepts the calls it should and refuses others;
each way of asking for a constraint reads into one Constraint, and conflicts are refused."""

from __future__ import annotations

import json

import pytest

from card.engine.shared.config import Constraint
from card.engine.shared.errors import InvalidArgument
from card.target_service.openai_schemas import ChatBody, CompletionBody
from card.target_service.tools import (
    CallStream,
    calls_constraint,
    chosen,
    declared_only,
    parse_calls,
    read_tools,
    template_messages,
)

TOOLS = read_tools([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
])
ANSWER = ('Let me check.\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_whole_answers_parse_into_calls_and_content() -> None:
    content, calls = parse_calls(ANSWER, TOOLS)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_time", {})]
    assert len({c.id for c in calls}) == 2
    # not a call of a known function, or not JSON: content, untouched
    odd = '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>'
    assert parse_calls(odd, TOOLS) == (odd, [])
    assert parse_calls("plain text", TOOLS) == ("plain text", [])


@pytest.mark.parametrize("cut", [1, 3, 7, 11, 64])
def test_streamed_text_cut_anywhere_gives_the_same_calls(cut: int) -> None:
    stream = CallStream(TOOLS)
    content, deltas = "", []
    for i in range(0, len(ANSWER), cut):
        text, calls = stream.feed(ANSWER[i:i + cut])
        content += text
        deltas += calls
    content += stream.finish()
    assert content.strip() == "Let me check."
    assert [d["index"] for d in deltas] == [0, 1]
    assert [(d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas] == \
        [(c.name, json.loads(c.arguments)) for c in parse_calls(ANSWER, TOOLS)[1]]
    held = CallStream(TOOLS)
    assert held.feed("x <tool_ca") == ("x ", [])  # a tag that may be starting is held back
    assert held.finish() == "<tool_ca"


def test_tool_choice_reads() -> None:
    assert chosen(TOOLS, None)[0] == "auto" and chosen([], None)[0] == "none"
    use, named = chosen(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert use == "required" and [t.name for t in named] == ["get_time"]
    with pytest.raises(InvalidArgument, match="not among the tools"):
        chosen(TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(InvalidArgument, match="needs tools"):
        chosen([], "required")
    with pytest.raises(InvalidArgument, match="same name"):
        read_tools([{"type": "function", "function": {"name": "a"}}] * 2)


def test_the_tools_grammar_takes_calls_and_refuses_others() -> None:
    from transformers import AutoTokenizer

    from card.engine.target.grammar import GrammarCompiler
    from tests.tiny_models import SMOLLM2_VOCAB, smollm2_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
    compiler = GrammarCompiler(tok, SMOLLM2_VOCAB, {2})
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    two = good + "\n" + good
    for parallel, text, ok in [(True, good, True), (True, two, True), (False, two, False),
                               (True, good.replace("get_weather", "get_news"), False),
                               (True, good.replace('"city"', '"town"'), False),
                               (True, good.replace('"Paris"', '"Paris", "x": 1'), False)]:
        state = compiler.state(calls_constraint(TOOLS, parallel))
        ids = tok.encode(text)
        whole = state.valid_prefix(ids) == len(ids)
        if whole:
            state.commit(ids)
        assert (whole and bool(state.mask(())[2])) == ok, (parallel, text)
    # the grammar writes the call's frame itself: forced tokens from the start
    state = compiler.state(calls_constraint(TOOLS[:1], False))
    assert tok.decode(state.forced(64)).startswith('<tool_call>\n{"name": "get_weather", "arguments": {')


def test_tool_parameters_are_closed_to_undeclared_properties() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}},
                                               "c": {"type": "object", "additionalProperties": True,
                                                     "properties": {}}}}
    closed = declared_only(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["c"]["additionalProperties"] is True  # said otherwise: kept
    assert "additionalProperties" not in schema  # the request's own schema is not changed


def test_conversation_messages_for_the_template() -> None:
    messages = template_messages([
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}])
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}
    with pytest.raises(InvalidArgument, match="not JSON"):
        template_messages([{"role": "assistant",
                            "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}])


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(("fields", "expected"), [
    ({"response_format": {"type": "json_object"}}, Constraint("json_object")),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     Constraint("json_schema", json.dumps(SCHEMA))),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"regex": "a+"}}, Constraint("regex", "a+")),
    ({"structured_outputs": {"choice": ["x", "y"]}}, Constraint("choice", '["x", "y"]')),
    ({"structured_outputs": {"json": SCHEMA}}, Constraint("json_schema", json.dumps(SCHEMA))),
    ({"guided_json": json.dumps(SCHEMA)}, Constraint("json_schema", json.dumps(SCHEMA))),
    ({"guided_grammar": 'start: "a"'}, Constraint("grammar", 'start: "a"')),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, None),
])
def test_each_way_of_asking_reads_into_one_constraint(fields: dict, expected: Constraint | None) -> None:
    body = ChatBody.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})
    assert body.constraint() == expected


def test_required_tools_read_into_the_tools_grammar_and_conflicts_are_refused() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = ChatBody.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                    "tool_choice": "required"})
    constraint = body.constraint()
    assert constraint is not None and constraint.kind == "grammar" and "<tool_call>" in constraint.text
    both = ChatBody.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                    "tool_choice": "required", "response_format": {"type": "json_object"}})
    with pytest.raises(InvalidArgument, match="one output constraint"):
        both.constraint()
    with pytest.raises(InvalidArgument, match="not served"):
        CompletionBody.model_validate({"prompt": "x",
                                       "structured_outputs": {"structural_tag": "t"}}).constraint()
    completion = CompletionBody.model_validate({"prompt": "x", "response_format": {"type": "json_object"}})
    assert completion.constraint() == Constraint("json_object")
    with pytest.raises(InvalidArgument, match=r"response_format\.type"):
        ChatBody.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                 "response_format": {"type": "yaml"}}).constraint()
