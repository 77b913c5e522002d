"""Tool calls on the OpenAI API: ``tools`` and ``tool_choice`` read into a constraint (required or
a named function: the output is tool calls, by grammar) or a parser (auto: calls are read out of
the text), in the model family's format; calls returned as ``tool_calls`` (whole, or as stream
deltas); and the conversation's ``tool`` messages and assistant ``tool_calls`` made ready for the
chat template.

The format: Hermes / Qwen's (Qwen2.5, Qwen3, Hermes 2/3, and SmolLM3's templates write it)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, on lines of their own. It is the only format served: a template that shows
another (``[TOOL_CALLS]``, ``<|python_tag|>``) is refused for required and named calls, where the
grammar would force a format the model was not taught (``ToolFormat.of``); auto still parses
Hermes blocks. The grammar writes the JSON as ``json.dumps`` does, each call's ``arguments``
under its function's ``parameters`` schema, objects closed to properties they do not declare
(``declared_only``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from card.engine.shared.config import Constraint
from card.engine.shared.errors import InvalidArgument
from card.engine.target.grammar import JSON_OPTIONS

MAX_TOOLS = 128  # functions per request (each a branch of the grammar)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
_FOREIGN_FORMATS = ("[TOOL_CALLS]", "<|python_tag|>", "<function=", "functools[")


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]


def read_tools(tools: list[dict[str, Any]] | None) -> list[Tool]:
    """OpenAI's ``tools`` (``{"type": "function", "function": {name, description, parameters}}``),
    checked: InvalidArgument naming the problem."""
    if not tools:
        return []
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument(f"tools: at most {MAX_TOOLS} functions, got {len(tools)}")
    out: list[Tool] = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        is_function = isinstance(tool, dict) and tool.get("type", "function") == "function"
        if not (is_function and isinstance(fn, dict)):
            raise InvalidArgument(f"tools[{i}]: a tool is {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise InvalidArgument(f"tools[{i}].function.name must be 1 to 64 letters, digits, _ . or -")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InvalidArgument(f"tools[{i}].function.parameters must be a JSON schema (an object)")
        out.append(Tool(name, params))
    if len({t.name for t in out}) != len(out):
        raise InvalidArgument("tools: two functions have the same name")
    return out


def chosen(tools: list[Tool], tool_choice: str | dict[str, Any] | None) -> tuple[str, list[Tool]]:
    """(``none`` / ``auto`` / ``required``, the functions it may call) for a ``tool_choice``; a
    named function reads as required over that one function."""
    if tool_choice is None:
        return ("auto" if tools else "none"), tools
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidArgument(f"tool_choice must be none, auto, required or a named function, "
                                  f"got {tool_choice!r}")
        if tool_choice != "none" and not tools:
            raise InvalidArgument(f"tool_choice {tool_choice} needs tools")
        return tool_choice, tools
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise InvalidArgument('tool_choice: a named function is '
                              '{"type": "function", "function": {"name": ...}}')
    named = [t for t in tools if t.name == name]
    if not named:
        raise InvalidArgument(f"tool_choice names {name!r}, which is not among the tools")
    return "required", named


def check_format(chat_template: str | None) -> None:
    """Required and named calls force Hermes blocks: refused where the model's template teaches
    another format."""
    template = chat_template or ""
    if OPEN not in template and any(marker in template for marker in _FOREIGN_FORMATS):
        raise InvalidArgument("this model's chat template writes tool calls in a format card-target "
                              "does not constrain (it serves Hermes/Qwen <tool_call> blocks); use "
                              "tool_choice auto")


def declared_only(schema: Any) -> Any:
    """``schema`` with every object that does not say otherwise closed to undeclared properties
    (``additionalProperties: false``): a function takes the parameters it declares. JSON Schema
    leaves objects open by default, and a grammar that allows any further key lets a small model
    add keys until its budget ends the call unclosed."""
    if isinstance(schema, list):
        return [declared_only(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: declared_only(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def calls_constraint(tools: list[Tool], parallel: bool) -> Constraint:
    """The output as tool calls of ``tools``: one block (``parallel`` False), or one or more; each
    call's arguments under its function's parameters (``declared_only``)."""
    bodies = [{"type": "object", "properties": {"name": {"const": t.name},
                                                "arguments": declared_only(t.parameters)},
               "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = {"x-guidance": JSON_OPTIONS, "anyOf": bodies}
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    lark = (f"{start}\ncall: {json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE)}\n"
            f"body: %json {json.dumps(schema)}\n")
    return Constraint("grammar", lark)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_json(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _call(block: str, names: set[str]) -> ToolCall | None:
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    return ToolCall(value["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse_calls(text: str, tools: list[Tool]) -> tuple[str | None, list[ToolCall]]:
    """(the content outside the call blocks, or None where nothing else was said; the calls) of a
    whole answer. A block that is not a call of one of ``tools`` stays in the content."""
    names = {t.name for t in tools}
    calls: list[ToolCall] = []
    content, last = [], 0
    for match in _BLOCK.finditer(text):
        call = _call(match.group(1), names)
        if call is None:
            continue
        calls.append(call)
        content.append(text[last:match.start()])
        last = match.end()
    content.append(text[last:])
    rest = "".join(content).strip() if calls else "".join(content)
    return (rest or None), calls


class CallStream:
    """One streamed choice's text split into content and calls: content is released up to any
    point where a call block may begin; a block is released as one tool-call delta when it
    closes; what is left at the end (an unclosed block) is content."""

    def __init__(self, tools: list[Tool]) -> None:
        self.names = {t.name for t in tools}
        self.held = ""
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content to send now, tool-call deltas to send now)."""
        self.held += text
        content, deltas = "", list[dict[str, Any]]()
        while True:
            start = self.held.find(OPEN)
            if start < 0:
                keep = _partial_open(self.held)  # a tail that may still become "<tool_call>"
                content += self.held[:len(self.held) - keep]
                self.held = self.held[len(self.held) - keep:]
                return content, deltas
            end = self.held.find(CLOSE, start)
            if end < 0:
                content += self.held[:start]
                self.held = self.held[start:]
                return content, deltas
            block = self.held[start + len(OPEN):end].strip()
            call = _call(block, self.names)
            if call is None:
                content += self.held[:end + len(CLOSE)]
            else:
                content += self.held[:start]
                deltas.append(call.as_json(self.calls))
                self.calls += 1
            self.held = self.held[end + len(CLOSE):].lstrip("\n") if call else self.held[end + len(CLOSE):]

    def finish(self) -> str:
        """The text still held (an unclosed block): content."""
        rest, self.held = self.held, ""
        return rest


def _partial_open(text: str) -> int:
    """The length of ``text``'s longest suffix that is a proper prefix of OPEN."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as chat templates read it: an assistant's ``tool_calls`` with their
    ``arguments`` as objects (OpenAI sends JSON text; Qwen's and Hermes' templates write them
    with ``tojson``), a ``tool`` message with its ``tool_call_id`` and ``name``."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for call in calls:
                fn = dict(call.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise InvalidArgument(f"an assistant tool call's arguments are not JSON: "
                                              f"{args[:60]!r}") from None
                fixed.append({**call, "function": fn})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out
