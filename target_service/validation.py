"""Validate once at each edge: a front reads its wire's request (gRPC in servicer.py, OpenAI JSON
in openai_schemas.py) into ``Validator.validate``, which returns a ``ValidRequest`` (TGI's
``validate`` -> ``ValidGenerateRequest``); ``Frontend.start`` takes nothing else and checks nothing
again. Cheap checks come first: the settings, then the prompt's length before any per-token work
(ids by their count, text by its characters), then the one tokenization and the length in tokens.
The token budget is cut to the room the context leaves (the engine would end there, "length");
a request that sets none gets all of that room (vLLM's rule), both cut to the operator's
--max-tokens-cap when there is one. A sampled request that sets no seed gets a fresh one
(``fresh_seed``), which its answer reports so that it can be replayed exactly.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from card.engine.loading.models import LoadedModel
from card.engine.shared.config import (
    ChainPolicy,
    GenerationRequest,
    Mode,
    SamplingParams,
    StopParams,
    TreeParams,
    Verify,
    VerifyPolicy,
    check_logprobs,
)
from card.engine.shared.errors import InvalidArgument
from card.engine.target.grammar import GrammarCompiler, compiler_for
from card.target_service.config import TargetConfig

SERVED_MODES = (Mode.CARD, Mode.CARD_AUTO, Mode.VANILLA)  # sd runs in process only

Prompt = str | Sequence[dict] | Sequence[int]  # text, a conversation ({role, content}), token ids

SEED_BITS = 63  # a fresh seed: fits a signed 64-bit integer, as clients (and JSON parsers) hold one
MAX_SEED = 2**64 - 1  # what a seed may be (the wire's uint64)
MAX_CHOICES = 16  # n: independent samples of one request (each takes a KV slot of its own)


def fresh_seed() -> int:
    """A seed for a sampled request that sets none: from the OS's generator, so that two such
    requests differ (``seed = 0`` for all of them made every "regenerate" the same answer)."""
    return secrets.randbits(SEED_BITS)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request with ``seed`` and n > 1: ``(seed + index) mod
    2**64``. Choice 0 is the request itself (n = 1 is unchanged), and choice i is replayed alone
    by the same request with n = 1 and seed + i."""
    return (seed + index) % (MAX_SEED + 1)


def check_choices(n: int) -> None:
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidArgument(f"n must be in [1, {MAX_CHOICES}], got {n}")


# apply_chat_template's own parameters: a request's chat_template_kwargs only add template
# variables (Qwen3's enable_thinking), never change how the prompt is built or returned
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def check_template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """A request's ``chat_template_kwargs``: template variables only (InvalidArgument else)."""
    if not kwargs:
        return {}
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise InvalidArgument(f"chat_template_kwargs may not set {', '.join(reserved)} (a parameter "
                              "of the chat template's call, not a template variable)")
    bad = [k for k in kwargs if not k.isidentifier()]
    if bad:
        raise InvalidArgument(f"chat_template_kwargs: {bad[0][:40]!r} is not a template variable name")
    return dict(kwargs)


@dataclass(frozen=True)
class ValidRequest:
    """A request proven to fit this target: its prompt tokenized once and within the context
    with its budget, its sampling, stops, logprobs, chain and acceptance rule checked."""

    generation: GenerationRequest
    mode: Mode = Mode.CARD
    draft: str = ""  # a draft pool or worker the request names ("" = the cache's choice)


class Validator:
    """This target's limits (its model, the context a KV slot holds, the operator's settings)
    and the one check of a request against them."""

    def __init__(self, model: LoadedModel, context_window: int, config: TargetConfig) -> None:
        self.model = model
        self.context_window = context_window
        self.config = config
        self.vocab_size = int(getattr(getattr(model.model, "config", None), "vocab_size", 0) or 0)
        vocab = model.tokenizer.get_vocab() if hasattr(model.tokenizer, "get_vocab") else {}
        self.token_chars = max(map(len, vocab), default=0)  # 0: no character bound

    @property
    def grammars(self) -> GrammarCompiler:
        """The model's grammar compiler (the one Frontend.start's generations use)."""
        model = self.model
        return compiler_for(model.tokenizer, model.model.get_input_embeddings().num_embeddings, model.eos_ids)

    def validate(self, prompt: Prompt, *, sampling: SamplingParams, chain: ChainPolicy,
                 chat: bool | None = None, max_new_tokens: int | None = None, stop: Sequence[str] = (),
                 ignore_eos: bool = False, verify: str = "", entropy_threshold: float | None = None,
                 window: int | None = None, logprobs: int | None = None, mode: str = "card",
                 draft: str = "", seeded: bool = True, stop_token_ids: Sequence[int] = (),
                 include_stop_str: bool = False,
                 template_kwargs: Mapping[str, Any] | None = None,
                 tools: Sequence[Mapping[str, Any]] | None = None) -> ValidRequest:
        """``chat``: the chat template for text (None = the model's default; a conversation takes
        it unless False), with ``template_kwargs`` as template variables; ``verify`` with its FLy
        settings (the server's where None); ``max_new_tokens`` None: the rest of the context;
        ``seeded`` False: the request set no seed, a sampled one gets a fresh one; ``tools``: the
        function definitions the chat template is shown (OpenAI's ``tools``). A constraint
        (``sampling.constraint``) is compiled against the model's tokenizer here: one that does
        not compile is refused with the compiler's words."""
        parsed = Mode.parse(mode, SERVED_MODES, " (sd runs in-process only: card-client generate "
                            "--inprocess --mode sd)")
        policy = self._verify_policy(verify, entropy_threshold, window)
        if max_new_tokens is not None and max_new_tokens < 1:
            raise InvalidArgument(f"the token budget must be >= 1, got {max_new_tokens}")
        if not 0 <= sampling.seed <= MAX_SEED:
            raise InvalidArgument(f"seed must be in [0, 2**64 - 1], got {sampling.seed}")
        if not seeded and not sampling.greedy:  # greedy takes no draws: its seed plays no part
            sampling = dataclasses.replace(sampling, seed=fresh_seed())
        cap = self.config.max_tokens_cap
        # the stops checked before any per-token work; the budget is set once the prompt's room is known
        budget = StopParams(1, tuple(stop), ignore_eos, tuple(stop_token_ids), include_stop_str)
        self.check_vocab("stop_token_ids", budget.stop_token_ids)
        self._check_processors(sampling, max_new_tokens)
        check_logprobs(logprobs)
        chain.over(TreeParams())  # refuse bad values here, not at the cache mid-request
        kwargs = check_template_kwargs(template_kwargs)
        if tools:
            kwargs["tools"] = [dict(t) for t in tools]
        if sampling.constraint is not None:  # compiled once here; the generation takes it from the cache
            self.grammars.check(sampling.constraint)
        ids = self._prompt_ids(prompt, chat, kwargs)
        room = self.context_window - len(ids)
        wanted = (max_new_tokens or room) if cap is None else min(max_new_tokens or room, cap)
        budget = dataclasses.replace(budget, max_new_tokens=min(wanted, room))
        request = GenerationRequest(tuple(ids), sampling, budget, chain, policy, logprobs)
        return ValidRequest(request, parsed, draft)

    def _check_processors(self, sampling: SamplingParams, max_new_tokens: int | None) -> None:
        """What SamplingParams cannot check alone: logit_bias's ids within this model's
        vocabulary, and min_tokens within the budget the request set (vLLM's rule: min_tokens <=
        max_tokens; a budget the server chose, or the context's end, just ends the generation
        sooner, "length")."""
        bad = [t for t, _ in sampling.logit_bias if self.vocab_size and t >= self.vocab_size]
        if bad:
            raise InvalidArgument(f"logit_bias holds {len(bad)} token id(s) outside the vocabulary "
                                  f"[0, {self.vocab_size}), e.g. {bad[0]}")
        if max_new_tokens is not None and sampling.min_tokens > max_new_tokens:
            raise InvalidArgument(f"min_tokens ({sampling.min_tokens}) must be at most the token budget "
                                  f"({max_new_tokens})")

    def check_vocab(self, what: str, ids: Sequence[int]) -> None:
        bad = [t for t in ids if t < 0 or (self.vocab_size and t >= self.vocab_size)]
        if bad:
            raise InvalidArgument(f"{what} holds {len(bad)} token id(s) outside the vocabulary "
                                  f"[0, {self.vocab_size}), e.g. {bad[0]}")

    def _verify_policy(self, mode: str, entropy_threshold: float | None, window: int | None) -> VerifyPolicy:
        """A request's acceptance rule, the server's FLy settings where it sets none; loose is
        refused when this server does not allow it (--no-allow-loose); rejection is verified
        exactly unless it allows it (--allow-rejection), and then with its q floor and coins no
        draft can predict (engine.target.verify)."""
        verify = Verify.parse(mode)
        if verify is Verify.LOOSE and not self.config.allow_loose:
            raise InvalidArgument("verify loose (lossy) is not allowed on this server (--no-allow-loose); "
                                  "ask for verify exact")
        c = self.config
        threshold = c.loose_entropy_threshold if entropy_threshold is None else entropy_threshold
        window = c.loose_window if window is None else window
        if verify is Verify.REJECTION:
            if not c.allow_rejection:  # it would trust the draft with q (docs/architecture.md): exact
                return VerifyPolicy(Verify.EXACT, threshold, window)  # is lossless whatever the draft
            return VerifyPolicy(verify, threshold, window, q_floor=c.rejection_q_floor, secret_coins=True)
        return VerifyPolicy(verify, threshold, window)

    def _prompt_ids(self, prompt: Prompt, chat: bool | None, template_kwargs: dict[str, Any]) -> list[int]:
        if isinstance(prompt, str):
            self._check_chars(prompt)
            ids = self.model.encode_prompt(prompt, chat, template_kwargs)
        elif not len(prompt):
            raise InvalidArgument("the prompt is empty")
        elif all(isinstance(m, dict) for m in prompt):  # stops at the first id: a count, not a scan
            messages = [m for m in prompt if isinstance(m, dict)]
            self._check_chars("".join(str(m.get("content") or "") for m in messages))
            ids = self.model.encode_prompt(messages, True if chat is None else chat, template_kwargs)
        else:
            self._check_length(f"{len(prompt)} tokens", len(prompt))  # before any per-id work
            ids = [t for t in prompt if isinstance(t, int) and not isinstance(t, bool)]
            if len(ids) != len(prompt):
                raise InvalidArgument("a prompt is text, a list of messages, or a list of token ids")
            self.check_vocab("the prompt", ids)
        if not ids:
            raise InvalidArgument("the prompt is empty")
        self._check_length(f"{len(ids)} tokens", len(ids))
        return ids

    def _check_chars(self, text: str) -> None:
        """A text too long for the context whatever its tokens, refused before it is tokenized: a
        token covers at most ``token_chars`` of its characters, whitespace aside (a normalizer
        may collapse it), or twice that where a normalizer merges a letter and its accent."""
        if self.token_chars:
            least = len("".join(text.split())) // (2 * self.token_chars)
            self._check_length(f"{len(text)} characters (at least {least} tokens)", least)

    def _check_length(self, what: str, tokens: int) -> None:
        """InvalidArgument when a prompt of ``tokens`` tokens leaves no room for a new one."""
        window, model = self.context_window, self.model
        if tokens < window:
            return
        if window < model.context_window:
            raise InvalidArgument(
                f"the prompt has {what} but this card-target holds {window} tokens per request "
                f"(--max-model-len; the context window of {model.name} is {model.context_window}); "
                "room is needed for at least one new token")
        raise InvalidArgument(f"the prompt has {what} but the context window of {model.name} is {window} "
                              "tokens (room is needed for at least one new token)")
