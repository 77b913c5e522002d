"""The request bodies of the OpenAI-compatible API (pydantic), and how each reads into the one
validation (card.target_service.validation): ``body.valid(validator)``.

What a vLLM client sends works as it does there: an omitted ``max_tokens`` is the rest of the
context (within card-target's --max-tokens-cap); a sampled request without ``seed`` gets a fresh
one, reported in the answer (``seed``, and the ``x-card-seed`` header) so that it can be replayed
exactly; ``n`` up to MAX_CHOICES independent samples (choice i with seed ``seed + i``);
``stop_token_ids`` and ``include_stop_str_in_output``; ``chat_template_kwargs``;
``stream_options.continuous_usage_stats``. Fields this server does not know (``metadata``,
``store``, ``user``, ``service_tier``, ...) are ignored, with one debug line naming them. Fields it
knows and does not serve, where they would change the output (``echo``, ``suffix``, beam search,
...: ``NOT_SERVED``), are refused with 400, never ignored.

Structured outputs (engine.target.grammar; one constraint per request): ``response_format``
``json_object`` / ``json_schema`` (both endpoints, as vLLM), vLLM's ``structured_outputs``
(``json``, ``json_object``, ``regex``, ``choice``, ``grammar``) and its older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``; ``tools`` with ``tool_choice``
(target_service.tools): ``required`` or a named function constrain the output to Hermes
``<tool_call>`` blocks, ``auto`` parses them out of the text; ``tool`` messages and assistant
``tool_calls`` reach the chat template.
The logits processors are served as vLLM serves them
(``presence_penalty``, ``frequency_penalty``, ``logit_bias`` from OpenAI's API; ``min_p``,
``repetition_penalty``, ``min_tokens`` vLLM's extensions; engine.target.logits_processors), card's
output still plain decoding's with them.

Extensions: ``mode`` ("card", "card-auto": the model-free lookup or the draft, whichever is
faster for the request, or "vanilla"), ``draft`` (a draft pool, or a worker name), ``top_k``
(-1 or 0: off), ``ignore_eos``, ``verify`` ("exact", the default; "rejection": speculative
sampling, the target's distribution but not plain decoding's tokens for the seed; or "loose":
FLy, lossy) with ``verify_entropy_threshold`` and ``verify_window``. Defaults follow OpenAI's
API, not card-client's: ``temperature`` and ``top_p`` 1.0. ``logprobs``: completions 0-20
alternatives; chat ``logprobs`` with ``top_logprobs`` <= 20.
"""

from __future__ import annotations

import abc
import json
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from card.engine.shared.config import MAX_LOGIT_BIAS_ENTRIES, ChainPolicy, Constraint, SamplingParams
from card.engine.shared.errors import InvalidArgument, NotFound
from card.target_service import tools as tool_calls
from card.target_service.validation import Prompt, Validator, ValidRequest, check_choices

log = logging.getLogger(__name__)

# Fields of OpenAI's or vLLM's requests that change the output and that card-target does not serve:
# refused (400) when set to anything but their default (None, or an empty list, is never refused).
NOT_SERVED: dict[str, object] = {
    "use_beam_search": False, "length_penalty": 1.0, "allowed_token_ids": None,
    "bad_words": None, "prompt_logprobs": None, "truncate_prompt_tokens": None, "prompt_embeds": None,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "logits_processors": None,
    "return_tokens_as_token_ids": False, "documents": None, "continue_final_message": False,
    "add_generation_prompt": True, "prediction": None, "audio": None, "modalities": None,
    "functions": None, "function_call": None, "web_search_options": None,
}


class _Open(BaseModel):
    """A part of a body: unknown fields are kept aside (``model_extra``) and ignored."""

    model_config = ConfigDict(extra="allow")

    def unknown(self, where: str = "") -> list[str]:
        """The names of the fields given here (and in the parts below) that this server does not
        know, dotted from ``where``."""
        names = [f"{where}{name}" for name in self.model_extra or {}]
        for name in type(self).model_fields:
            value = getattr(self, name)
            parts = value if isinstance(value, list) else [value]
            for i, part in enumerate(parts):
                if isinstance(part, _Open):
                    index = f"[{i}]" if isinstance(value, list) else ""
                    names += part.unknown(f"{where}{name}{index}.")
        return names


class StreamOptions(_Open):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage so far on every chunk


class _Common(_Open):
    """Fields both endpoints take."""

    model: str | None = None  # None: the served model (as vLLM)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False  # null as false: clients send what their own defaults hold
    stream_options: StreamOptions | None = None
    n: int | None = 1
    # the logits processors (OpenAI's three, then vLLM's extensions): ``processors()``
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    user: str | None = None  # an end-user id for the operator's logs; never changes output
    # ---- vLLM's ----
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    # structured outputs: vLLM's ``structured_outputs`` ({json, regex, choice, grammar,
    # json_object}) and its older ``guided_*`` fields; ``constraints()``
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None  # OpenAI's (chat), vLLM's on completions too
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # ---- extensions ----
    mode: Literal["card", "card-auto", "vanilla"] = "card"
    draft: str = ""
    top_k: int | None = None
    ignore_eos: bool = False
    verify: Literal["exact", "rejection", "loose"] = "exact"
    verify_entropy_threshold: float | None = None  # loose: FLy's gate (the server's by default)
    verify_window: int | None = None  # loose: FLy's deferred window (the server's by default)

    def logprobs_wanted(self) -> int | None:
        """Alternatives per token to report, or None for no logprobs."""
        return None

    def constraints(self) -> list[Constraint]:
        """The output constraints this body asks for (at most one is served)."""
        out = []
        rf = self.response_format or {}
        kind = rf.get("type", "text")
        if kind == "json_object":
            out.append(Constraint("json_object"))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise InvalidArgument("response_format.json_schema needs {name, schema[, strict]}")
            out.append(_schema_constraint(spec["schema"], "response_format.json_schema.schema"))
        elif kind != "text":
            raise InvalidArgument(f"response_format.type must be text, json_object or json_schema, "
                                  f"got {kind!r}")
        so = dict(self.structured_outputs or {})
        if "json" in so and so["json"] is not None:
            out.append(_schema_constraint(so.pop("json"), "structured_outputs.json"))
        if so.pop("json_object", None):
            out.append(Constraint("json_object"))
        for key, kind in (("regex", "regex"), ("grammar", "grammar")):
            if so.get(key) is not None:
                if not isinstance(so[key], str):
                    raise InvalidArgument(f"structured_outputs.{key} must be a string")
                out.append(Constraint(kind, so.pop(key)))
        if so.get("choice") is not None:
            out.append(_choice_constraint(so.pop("choice"), "structured_outputs.choice"))
        asked = [k for k, v in so.items() if v not in (None, False, "", [], {})]
        if asked:
            raise InvalidArgument(f"structured_outputs.{asked[0]}: not served by card-target (json, "
                                  "json_object, regex, choice and grammar are)")
        if self.guided_json is not None:
            out.append(_schema_constraint(self.guided_json, "guided_json"))
        if self.guided_regex is not None:
            out.append(Constraint("regex", self.guided_regex))
        if self.guided_choice is not None:
            out.append(_choice_constraint(self.guided_choice, "guided_choice"))
        if self.guided_grammar is not None:
            out.append(Constraint("grammar", self.guided_grammar))
        return out

    def constraint(self) -> Constraint | None:
        found = self.constraints()
        if len(found) > 1:
            raise InvalidArgument("one output constraint per request (response_format, tools with "
                                  "tool_choice required, structured_outputs, guided_*)")
        return found[0] if found else None

    def tool_list(self) -> list[dict[str, Any]] | None:
        """The tools the chat template is shown (chat only)."""
        return None

    def refusals(self) -> list[str]:
        """The fields set here that would change the output and are not served."""
        extra = self.model_extra or {}
        return _asked({name: _differs(extra[name], default) for name, default in NOT_SERVED.items()
                       if name in extra})

    def processors(self) -> dict[str, Any]:
        """The logits processors' SamplingParams fields (vLLM's defaults where unset; their bounds
        are SamplingParams', the vocabulary and the budget the Validator's). logit_bias's keys are
        token ids written as JSON strings."""
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:  # counted before a key is parsed
            raise InvalidArgument(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}")
        try:
            pairs = tuple((int(token), value) for token, value in bias.items())
        except ValueError:
            raise InvalidArgument("logit_bias: keys must be token ids (integers)") from None
        return {"presence_penalty": self.presence_penalty or 0.0,
                "frequency_penalty": self.frequency_penalty or 0.0, "logit_bias": pairs,
                "min_p": self.min_p or 0.0,
                "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
                "min_tokens": self.min_tokens or 0}

    @abc.abstractmethod
    def prompt_input(self) -> tuple[Prompt, bool]:
        """What the body asks to continue, and whether through the chat template."""

    def budget(self) -> int | None:
        return self.max_tokens

    def template_kwargs(self) -> dict[str, Any] | None:
        return None

    def check_model(self, validator: Validator) -> None:
        check_model(self.model, validator)

    def valid(self, validator: Validator) -> ValidRequest:
        """This body read into the one validation, with OpenAI's defaults (temperature and top_p 1;
        no seed: a fresh one when it samples; no budget: the rest of the context)."""
        refused = self.refusals()
        if refused:
            raise InvalidArgument(f"{', '.join(refused)}: not served by card-target "
                                  "(it would change the output)")
        self.check_model(validator)
        check_choices(self.choices)
        unknown = self.unknown()
        if unknown:
            log.debug("ignored fields this server does not know: %s", ", ".join(unknown))
        if self.top_k is not None and self.top_k < -1:
            raise InvalidArgument(f"top_k must be >= 0 (0 or -1 disables it), got {self.top_k}")
        sampling = SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=max(self.top_k or 0, 0),  # vLLM's -1 is off, as card's 0
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed or 0,
            constraint=self.constraint(),
            **self.processors(),
        )
        prompt, chat = self.prompt_input()
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return validator.validate(
            prompt, chat=chat, sampling=sampling, chain=ChainPolicy(), max_new_tokens=self.budget(),
            stop=stop, ignore_eos=self.ignore_eos, verify=self.verify,
            entropy_threshold=self.verify_entropy_threshold, window=self.verify_window,
            logprobs=self.logprobs_wanted(), mode=self.mode, draft=self.draft, seeded=self.seed is not None,
            stop_token_ids=tuple(self.stop_token_ids or ()), include_stop_str=self.include_stop_str_in_output,
            template_kwargs=self.template_kwargs(), tools=self.tool_list())

    @property
    def choices(self) -> int:
        """How many independent samples (``n``; null: one)."""
        return 1 if self.n is None else self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionBody(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = None

    def refusals(self) -> list[str]:
        return super().refusals() + _asked({
            "echo": self.echo, "best_of > n": self.best_of is not None and self.best_of > self.choices,
            "suffix": self.suffix, "add_special_tokens: false": (self.model_extra or {}).get(
                "add_special_tokens") is False})

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompt_input(self) -> tuple[Prompt, bool]:
        prompt: Any = self.prompt  # one of the shapes pydantic checked
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidArgument("one prompt per request (a batch of prompts is n requests)")
            return prompt[0], False
        return prompt, False


class TextPart(_Open):
    type: Literal["text"]
    text: str


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template reads it."""
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": self.text}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return out

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # variables of the template (enable_thinking)
    chat_template: str | None = None  # per request: refused (vLLM's default too); --chat-template

    def prompt_input(self) -> tuple[Prompt, bool]:
        return tool_calls.template_messages([m.for_template() for m in self.messages]), True

    def check_model(self, validator: Validator) -> None:
        super().check_model(validator)
        if self.tool_use()[0] == "required":  # the grammar writes Hermes blocks: the model's format?
            tool_calls.check_format(getattr(validator.model.tokenizer, "chat_template", None))

    def tool_use(self) -> tuple[str, list[tool_calls.Tool]]:
        """(none / auto / required, the functions the answer may call)."""
        return tool_calls.chosen(tool_calls.read_tools(self.tools), self.tool_choice)

    def tool_list(self) -> list[dict[str, Any]] | None:
        return self.tools or None

    def constraints(self) -> list[Constraint]:
        out = super().constraints()
        use, functions = self.tool_use()
        if use == "required":
            out.append(tool_calls.calls_constraint(functions, self.parallel_tool_calls is not False))
        return out

    def budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_kwargs(self) -> dict[str, Any] | None:
        return self.chat_template_kwargs

    def logprobs_wanted(self) -> int | None:
        if self.top_logprobs and not self.logprobs:  # 0 alone asks for nothing, as vLLM reads it
            raise InvalidArgument("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def refusals(self) -> list[str]:
        return super().refusals() + _asked({
            "chat_template (per request; start card-target with --chat-template)": self.chat_template,
            "add_special_tokens: true": (self.model_extra or {}).get("add_special_tokens") is True})


# ---- /tokenize and /detokenize (vLLM's shapes) -------------------------------------------------------
class TokenizeBody(_Open):
    """POST /tokenize: ``prompt`` (raw text, ``add_special_tokens`` default true) or ``messages``
    (through the chat template with its generation prompt, as a chat request reads them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def check_model(self, validator: Validator) -> None:
        check_model(self.model, validator)


class DetokenizeBody(_Open):
    model: str | None = None
    tokens: list[int]

    def check_model(self, validator: Validator) -> None:
        check_model(self.model, validator)


def check_model(model: str | None, validator: Validator) -> None:
    """NotFound unless a body names a served model (any --served-model-name, or none, as vLLM
    takes it)."""
    names = validator.config.accepted_names(validator.model.name)
    if model is not None and model not in names:
        raise NotFound(f"model {model!r} is not served here; GET /v1/models lists "
                       f"{', '.join(map(repr, names))}")


def _schema_constraint(schema: object, where: str) -> Constraint:
    """A JSON schema given as an object (or as JSON text) as a constraint."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise InvalidArgument(f"{where}: not valid JSON") from None
    if not isinstance(schema, dict | bool):
        raise InvalidArgument(f"{where}: a JSON schema is an object")
    return Constraint("json_schema", json.dumps(schema))


def _choice_constraint(choices: object, where: str) -> Constraint:
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise InvalidArgument(f"{where}: a list of strings")
    return Constraint("choice", json.dumps(choices))


def _differs(value: object, default: object) -> bool:
    """A not-served field's value asks for something: not None, not empty, not the default."""
    return value is not None and value != default and not (default is None and value in ([], {}, ""))


def _asked(fields: dict[str, object]) -> list[str]:
    return [name for name, value in fields.items() if value]
