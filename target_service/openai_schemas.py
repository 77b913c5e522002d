"""The request bodies of the OpenAI-compatible API (pydantic), and how each reads into the one
validation (card.target_service.validation): ``body.valid(validator)``. Fields that would change
the output and are not served (``n > 1``, tools, ...) are refused with 400, never ignored; so is
any field this server does not know. The logits processors are served as vLLM serves them
(``presence_penalty``, ``frequency_penalty``, ``logit_bias`` from OpenAI's API; ``min_p``,
``repetition_penalty``, ``min_tokens`` vLLM's extensions; engine.target.logits_processors), card's
output still plain decoding's with them. Extensions: ``mode`` ("card",
"card-auto": the model-free lookup or the draft, whichever is faster for the request, or
"vanilla"), ``draft`` (a draft pool, or a worker name), ``top_k``, ``ignore_eos``, ``verify``
("exact", the default; "rejection": speculative sampling, the target's distribution but not plain
decoding's tokens for the seed; or "loose": FLy, lossy) with ``verify_entropy_threshold`` and
``verify_window``. Defaults follow OpenAI's API, not card-client's: ``temperature`` and ``top_p``
1.0; ``seed`` makes sampling reproducible (default 0). ``logprobs``: completions 0-20
alternatives; chat ``logprobs`` with ``top_logprobs`` <= 20.
"""

from __future__ import annotations

import abc
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from card.engine.shared.config import MAX_LOGIT_BIAS_ENTRIES, ChainPolicy, SamplingParams
from card.engine.shared.errors import InvalidArgument, NotFound
from card.target_service.validation import Prompt, Validator, ValidRequest


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints take; unknown fields are an error (extra="forbid")."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    # the logits processors (OpenAI's three, then vLLM's extensions): ``processors()``
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    user: str | None = None  # an end-user id for the operator's logs; never changes output
    # extensions
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

    def refusals(self) -> list[str]:
        """The fields set here that would change the output and are not served."""
        return _asked({"n > 1": self.n not in (None, 1)})

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

    def valid(self, validator: Validator) -> ValidRequest:
        """This body read into the one validation, with OpenAI's defaults (temperature and top_p 1)."""
        refused = self.refusals()
        if refused:
            raise InvalidArgument(f"{', '.join(refused)}: not served by card-target "
                                  "(it would change the output)")
        names = validator.config.accepted_names(validator.model.name)  # any --served-model-name
        if self.model not in names:
            raise NotFound(f"model {self.model!r} is not served here; GET /v1/models lists "
                           f"{', '.join(map(repr, names))}")
        sampling = SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=self.top_k or 0,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed or 0,
            **self.processors(),
        )
        prompt, chat = self.prompt_input()
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return validator.validate(
            prompt, chat=chat, sampling=sampling, chain=ChainPolicy(), max_new_tokens=self.budget(),
            stop=stop, ignore_eos=self.ignore_eos, verify=self.verify,
            entropy_threshold=self.verify_entropy_threshold, window=self.verify_window,
            logprobs=self.logprobs_wanted(), mode=self.mode, draft=self.draft)


class CompletionBody(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = None

    def refusals(self) -> list[str]:
        return super().refusals() + _asked({"echo": self.echo, "best_of > 1": self.best_of not in (None, 1),
                                            "suffix": self.suffix})

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompt_input(self) -> tuple[Prompt, bool]:
        prompt: Any = self.prompt  # one of the shapes pydantic checked
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidArgument("one prompt per request (a batch of prompts is n requests)")
            return prompt[0], False
        return prompt, False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    def prompt_input(self) -> tuple[Prompt, bool]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text}
                for m in self.messages], True

    def budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_wanted(self) -> int | None:
        if self.top_logprobs and not self.logprobs:  # 0 alone asks for nothing, as vLLM reads it
            raise InvalidArgument("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def refusals(self) -> list[str]:
        return super().refusals() + _asked({
            "tools": self.tools or self.tool_choice not in (None, "none"),
            "response_format": self.response_format and self.response_format.get("type") != "text"})


def _asked(fields: dict[str, object]) -> list[str]:
    return [name for name, value in fields.items() if value]

