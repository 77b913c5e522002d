"""Constrained decoding: a request's grammar (SamplingParams.constraint) as a token mask on every
row the target judges, with llguidance (Microsoft's Rust grammar engine, the one vLLM and SGLang
offer beside xgrammar) compiling it against the model's tokenizer.

Why llguidance: it installs as one wheel with no torch, transformers or triton pins (xgrammar
brings its own torch requirement); a JSON-schema mask for a 49k vocabulary costs ~0.1 ms on this
CPU with no precompilation of the vocabulary per grammar (compiles take ~1 ms); its matcher
consumes, validates and rolls back tokens, which is what verification needs; and it reads JSON
schemas, regexes, Lark grammars (GBNF too) and choice lists through one entry point.

How the mask meets verification. The target judges a chain ``[next, *chain]`` row by row, and row
j must be what plain decoding computes after committing ``chain[:j]``
(engine.target.logits_processors.ProcessedRows). ``GrammarState`` keeps one matcher per
generation that has consumed the committed output plus a speculative tail (``_ahead``): the mask
of row j moves the tail to ``chain[:j]`` (rolling back what differs, consuming the rest) and
reads the matcher's mask there, which is the mask plain decoding reads after committing
``chain[:j]``, bit for bit. ``commit`` rolls the tail back and consumes the committed tokens for
real. A chain token the grammar refuses gets -inf in its own row, so no acceptance rule keeps it;
the rows after it are never committed and are masked with the last state the grammar reached
(finite numbers for the rules to read, nothing more).

Ending: the model's EOS ids (the tokens that end a generation) are allowed exactly where the
grammar accepts, and where it can go no further they are all that is allowed, so a finished
grammar ends the generation.

Grammar drafts: where the grammar allows one continuation only (a forced key, a closing brace),
``forced`` gives those tokens, which the generation proposes as a chain with no model
(engine.target.generation); the target verifies them like any chain, so the output is unchanged.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import torch

from card.engine.shared.config import Constraint
from card.engine.shared.errors import InvalidArgument

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stubs only

# JSON as ``json.dumps`` writes it (", " and ": ", no other whitespace): what models write most,
# and it leaves the grammar one way to write each structural piece, so braces, quotes, keys and
# separators are forced (grammar drafts) instead of racing optional whitespace.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ",
                                   "key_separator": ": "}
# compiled grammars kept per tokenizer (a request's constraint compiles once at the front, once
# more where its generation starts: the second is this cache's)
GRAMMAR_CACHE = 64


def grammar_source(constraint: Constraint) -> str:
    """The llguidance grammar for ``constraint`` (not yet checked against a tokenizer)."""
    kind, text = constraint.kind, constraint.text
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "choice":
            lark = "start: " + " | ".join(json.dumps(c) for c in json.loads(text))
            return llguidance.LLMatcher.grammar_from_lark(lark)
        return llguidance.grammar_from("grammar", text)  # Lark, or GBNF converted to Lark
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(f"the {kind} constraint cannot be read: {exc}") from None


class GrammarCompiler:
    """One model's grammars: the llguidance view of its tokenizer (built once, ~1 s) over the
    model's vocabulary (``vocab_size`` rows of logits; ids the tokenizer lacks are never allowed),
    and a bounded cache of compiled grammars. ``eos_ids``: the tokens that end a generation."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: Iterable[int] = ()) -> None:
        self.vocab_size = vocab_size
        self.eos_ids = frozenset(t for t in eos_ids if 0 <= t < vocab_size)
        self._hf = hf_tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[Constraint, str] = OrderedDict()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf  # imports transformers: only where a model is loaded

                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size)
                except ValueError as exc:  # a slow (Python) tokenizer: llguidance reads fast ones
                    raise InvalidArgument(f"this model's tokenizer cannot be constrained: {exc}") from None
            return self._tokenizer

    def check(self, constraint: Constraint) -> str:
        """The compiled grammar; InvalidArgument naming the problem where it does not compile."""
        with self._lock:
            hit = self._compiled.get(constraint)
            if hit is not None:
                self._compiled.move_to_end(constraint)
                return hit
        source = grammar_source(constraint)
        error = llguidance.LLMatcher.validate_grammar(source, self.tokenizer)
        if error:
            raise InvalidArgument(f"the {constraint.kind} constraint does not compile: {error}")
        with self._lock:
            self._compiled[constraint] = source
            while len(self._compiled) > GRAMMAR_CACHE:
                self._compiled.popitem(last=False)
        return source

    def state(self, constraint: Constraint) -> GrammarState:
        """A fresh matcher for one generation."""
        matcher = llguidance.LLMatcher(self.tokenizer, self.check(constraint), log_level=0)
        if matcher.is_error():
            raise InvalidArgument(f"the {constraint.kind} constraint does not compile: {matcher.get_error()}")
        return GrammarState(matcher, self.eos_ids, self.tokenizer.eos_token)


_compilers: weakref.WeakKeyDictionary[Any, dict[int, GrammarCompiler]] = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(hf_tokenizer: Any, vocab_size: int, eos_ids: Iterable[int] = ()) -> GrammarCompiler:
    """The one GrammarCompiler of a loaded tokenizer and vocabulary (built on first use)."""
    with _compilers_lock:
        per_vocab = _compilers.setdefault(hf_tokenizer, {})
        compiler = per_vocab.get(vocab_size)
        if compiler is None:
            compiler = per_vocab[vocab_size] = GrammarCompiler(hf_tokenizer, vocab_size, eos_ids)
        return compiler


class GrammarState:
    """One generation's grammar: a matcher over the committed output plus a speculative tail
    ``_ahead`` (see the module's docstring)."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_ids: frozenset[int], grammar_eos: int) -> None:
        self._matcher = matcher
        self._ending = torch.tensor(sorted(eos_ids), dtype=torch.int64)
        self._eos_set = eos_ids
        self._grammar_eos = grammar_eos
        self._ahead: list[int] = []  # consumed beyond the committed output

    # ---- the committed output ----------------------------------------------------------------
    def commit(self, tokens: Sequence[int]) -> None:
        """Tokens the target committed: consumed for real. An ending token is not the grammar's
        (it ends the generation, or, with ``ignore_eos``, is passed over) and is skipped, here
        and in every prefix, so a chain's rows see what plain decoding's see."""
        self._to([])
        body = self._body(tokens)
        if body and not self._matcher.consume_tokens(body):
            raise AssertionError(f"the grammar refused a committed token: {self._matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The grammar can take no more tokens (only an ending token is allowed)."""
        self._to([])
        return self._matcher.is_stopped()

    def forced(self, limit: int, after: Sequence[int] = ()) -> list[int]:
        """Up to ``limit`` tokens the grammar forces after the committed output and ``after`` (a
        chain the grammar allows): tokens that need no model (none where more than one
        continuation is allowed)."""
        self._to(after)
        if limit <= 0 or len(self._ahead) != len(self._body(after)):
            return []
        return list(self._matcher.compute_ff_tokens()[:limit])

    def valid_prefix(self, chain: Sequence[int]) -> int:
        """How many of ``chain``'s first tokens the grammar allows after the committed output
        (a chain is cut there: the target would refuse the next one anyway)."""
        self._to([])
        end = next((i for i, t in enumerate(chain) if t in self._eos_set), len(chain))
        valid = len(self._valid(chain[:end]))
        return valid + (valid == end < len(chain))  # an ending token where the grammar allows it

    # ---- rows --------------------------------------------------------------------------------
    def mask(self, prefix: Sequence[int]) -> torch.Tensor:
        """Allowed tokens [vocab] (bool) after the committed output + ``prefix``."""
        self._to(prefix)
        m = self._matcher
        allowed = torch.frombuffer(bytearray(m.compute_logit_bias()), dtype=torch.uint8) != 0
        if 0 <= self._grammar_eos < allowed.numel():
            allowed[self._grammar_eos] = False  # the grammar's EOS stands for every ending token
        if self._ending.numel():
            allowed[self._ending] = m.is_accepting() or m.is_stopped()
        return allowed

    def _body(self, tokens: Sequence[int]) -> list[int]:
        """``tokens`` without ending tokens."""
        return [t for t in tokens if t not in self._eos_set]

    def _valid(self, tokens: Sequence[int]) -> list[int]:
        """``tokens``' longest prefix the matcher takes from where it is."""
        head = list(tokens)
        return head[:self._matcher.validate_tokens(head)] if head else head

    def _to(self, prefix: Sequence[int]) -> None:
        """Move the speculative tail to ``prefix`` (as far as the grammar takes it)."""
        prefix = self._body(prefix)
        ahead = self._ahead
        same = 0
        limit = min(len(ahead), len(prefix))
        while same < limit and ahead[same] == prefix[same]:
            same += 1
        if same < len(ahead):
            self._matcher.rollback(len(ahead) - same)
            del ahead[same:]
        if same < len(prefix) and len(ahead) == same:
            more = list(self._valid(prefix[same:]))
            if more:
                self._matcher.consume_tokens(more)
                ahead += more

