"""Frozen parameter sets shared by every decoding mode, validated once where they are built."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from card.engine.loading.devices import resolve_device
from card.engine.shared.errors import InvalidArgument

NGRAM = "ngram"  # the draft "model" spec of the model-free drafter (--draft-model / card-draft --model)


class Mode(enum.Enum):
    """How a request decodes, parsed once where it enters (a flag, a request field):

        vanilla    the target alone
        sd         classic draft-then-verify (in process only)
        card       the target verifies chains of a tree a draft grows beside it
        card-auto  card, the drafter chosen per generation by measured pace: the model-free
                   lookup or the draft worker (card.engine.target.drafting_policy)
    """

    VANILLA = "vanilla"
    SD = "sd"
    CARD = "card"
    CARD_AUTO = "card-auto"

    @classmethod
    def parse(cls, value: str, allowed: tuple[Mode, ...] = (), hint: str = "") -> Mode:
        """The mode ``value`` names, among ``allowed`` (all when empty); InvalidArgument else."""
        names = [m.value for m in allowed or tuple(cls)]
        if value not in names:
            raise InvalidArgument(f"mode must be one of {', '.join(names)}, got {value!r}{hint}")
        return cls(value)


class DrafterKind(enum.Enum):
    """What grows card's trees, parsed once from the flags (``from_flags``) where a command reads
    them; everything downstream asks the kind.

        neural    a draft model (engine.draft.drafter)
        cascade   the draft model with the n-gram statistics beneath it (``--cascade ngram``)
        ngram     the n-gram statistics alone, no draft model (``--draft-model ngram``)
    """

    NEURAL = "neural"
    CASCADE = "cascade"
    NGRAM = "ngram"

    @classmethod
    def from_flags(cls, model: str, cascade: str = "none") -> DrafterKind:
        """The kind a draft model spec and ``--cascade`` name; InvalidArgument for a cascade
        beneath no model."""
        if cascade not in ("none", NGRAM):
            raise InvalidArgument(f"--cascade must be none or {NGRAM}, got {cascade!r}")
        if model == NGRAM:
            if cascade != "none":
                raise InvalidArgument("--cascade puts n-gram statistics beneath a draft model; "
                                      "--draft-model ngram is the statistics alone")
            return cls.NGRAM
        return cls.NEURAL if cascade == "none" else cls.CASCADE

    def check_mode(self, mode: Mode) -> None:
        """Only card grows trees: any kind but a plain draft model needs mode card."""
        if self is not DrafterKind.NEURAL and mode is not Mode.CARD:
            raise InvalidArgument(f"the {self.value} drafter grows card's trees; mode {mode.value} has none")

    @property
    def needs_model(self) -> bool:
        return self is not DrafterKind.NGRAM

    @property
    def uses_ngram(self) -> bool:
        """Its drafting reads n-gram statistics (the --ngram-* settings apply)."""
        return self is not DrafterKind.NEURAL

    @property
    def cascade(self) -> str:
        """The ``--cascade`` value that names it (card-draft's flag)."""
        return NGRAM if self is DrafterKind.CASCADE else "none"

    def label(self, model_label: str) -> str:
        """What a registry shows as a worker's model."""
        if self is DrafterKind.NGRAM:
            return NGRAM
        return f"{model_label}+{NGRAM}" if self is DrafterKind.CASCADE else model_label


# A temperature below this samples as greedy: the scaled logits ``logits / temperature`` overflow to
# inf (and the softmax to NaN) long before a temperature reaches the smallest float, and under it the
# filtered distribution is one-hot on the argmax anyway (vLLM's _SAMPLING_EPS, same value).
SAMPLING_EPS = 1e-5
# Temperatures above this are refused: a distribution that flat is noise whatever the model, and a
# value like 1e300 is a mistake or a probe.
MAX_TEMPERATURE = 100.0
# Stop strings per request, and characters per stop string. Each front (gRPC, OpenAI HTTP) gets the
# limit from StopParams; the engine's per-token stop matching is bounded by these (stopping.py).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
# Stop token ids per request (vLLM's ``stop_token_ids``): a set lookup per committed token.
MAX_STOP_TOKEN_IDS = 64


# Bounds on the logits processors of a request (engine.target.logits_processors), vLLM's ranges
# (vllm/sampling_params.py ``_verify_args``) where it has one: presence and frequency penalties in
# [-2, 2] (OpenAI's too); logit_bias values in [-100, 100] and at most 300 entries (OpenAI's API);
# a repetition penalty above 0, capped here (vLLM has no cap): past 100 it only divides small
# positive logits further, and a value like 1e300 is a mistake or a probe.
MAX_PENALTY = 2.0
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300


# A request's output constraint (engine.target.grammar): its kinds, and bounds on its text (a JSON
# schema, a regex, a Lark grammar or a JSON list of choices): a grammar compiles in time and memory
# that grow with its text, so the text is bounded where the request is built.
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_CONSTRAINT_CHARS = 64 * 1024
MAX_CHOICES = 256


@dataclass(frozen=True)
class Constraint:
    """What the output must match: ``kind`` one of CONSTRAINT_KINDS, ``text`` its description:

        json_schema   a JSON schema (as JSON text)
        json_object   any JSON object (text empty)
        regex         a regular expression the whole output matches
        choice        a JSON list of strings, the output one of them
        grammar       a Lark grammar (llguidance's dialect; GBNF is read too)

    Checked here for form (kind, size, JSON where JSON is due); whether a schema, regex or grammar
    compiles is checked against the model's tokenizer where the request enters
    (engine.target.grammar.GrammarCompiler.check), before any work."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidArgument(f"constraint kind must be one of {', '.join(CONSTRAINT_KINDS)}, "
                                  f"got {self.kind!r}")
        if not isinstance(self.text, str) or len(self.text) > MAX_CONSTRAINT_CHARS:
            raise InvalidArgument(f"a {self.kind} constraint is text of at most "
                                  f"{MAX_CONSTRAINT_CHARS} characters")
        if self.kind == "json_object":
            object.__setattr__(self, "text", "")
            return
        if not self.text:
            raise InvalidArgument(f"a {self.kind} constraint needs its text "
                                  "(schema, regex, choices or grammar)")
        if self.kind in ("json_schema", "choice"):
            try:
                value = json.loads(self.text)
            except ValueError as exc:
                raise InvalidArgument(f"the {self.kind} constraint is not valid JSON: {exc}") from None
            if self.kind == "json_schema" and not isinstance(value, dict | bool):
                raise InvalidArgument("a JSON schema must be a JSON object")
            if self.kind == "choice" and not (isinstance(value, list) and 0 < len(value) <= MAX_CHOICES
                                              and all(isinstance(c, str) and c for c in value)):
                raise InvalidArgument(f"choice: a list of 1 to {MAX_CHOICES} non-empty strings")


@dataclass(frozen=True)
class SamplingParams:
    """How the target picks each token.

    ``temperature`` below SAMPLING_EPS (0 included) is greedy. Otherwise the token at committed
    position ``t`` is drawn from the target's (temperature, min-p, top-k, top-p)-filtered
    distribution with a uniform number derived from ``(seed, t)`` only, so every mode (vanilla, sd,
    card) that sees the same target logits at position ``t`` commits the same token there.

    The logits processors (vLLM's semantics, engine.target.logits_processors) change the target's
    logits before either: ``logit_bias`` ((token id, bias) pairs, sorted by id), ``min_tokens``
    (EOS and the stop token ids are suppressed until that many tokens are generated),
    ``repetition_penalty`` (over prompt and output tokens), ``presence_penalty`` and
    ``frequency_penalty`` (over output tokens). ``min_p`` filters after the temperature (sampled
    requests only, as in vLLM).

    ``constraint``: the output must match it (a JSON schema, a regex, ...): the grammar's mask
    is one more processor, applied last (engine.target.grammar), and EOS is allowed only where the
    grammar accepts.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE):
            raise InvalidArgument(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], "
                                  f"got {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed < 0:
            raise InvalidArgument(f"seed must be >= 0, got {self.seed}")
        self._check_processors()

    def _check_processors(self) -> None:
        if not (0.0 <= self.min_p <= 1.0):  # NaN fails too
            raise InvalidArgument(f"min_p must be in [0, 1], got {self.min_p}")
        if not (0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise InvalidArgument(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], "
                                  f"got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise InvalidArgument(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], "
                                      f"got {getattr(self, name)}")
        if self.min_tokens < 0:
            raise InvalidArgument(f"min_tokens must be >= 0, got {self.min_tokens}")
        bias = self.logit_bias
        entries = dict(bias).items() if isinstance(bias, dict) else bias  # a dict reads as its items
        if len(entries) > MAX_LOGIT_BIAS_ENTRIES:  # counted before anything is copied or checked
            raise InvalidArgument(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(entries)}")
        try:
            pairs = tuple(sorted((int(t), float(b)) for t, b in entries))
        except (TypeError, ValueError):
            raise InvalidArgument("logit_bias maps token ids (integers) to numbers") from None
        if any(t < 0 for t, _ in pairs):
            raise InvalidArgument(f"logit_bias: token ids must be >= 0, got {pairs[0][0]}")
        if len({t for t, _ in pairs}) != len(pairs):
            raise InvalidArgument("logit_bias: a token id appears twice")
        if not all(-MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for _, b in pairs):
            raise InvalidArgument(f"logit_bias: biases must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        object.__setattr__(self, "logit_bias", pairs)

    @property
    def greedy(self) -> bool:
        """Greedy decoding: temperature 0, or one so small that dividing by it would overflow."""
        return self.temperature < SAMPLING_EPS

    @property
    def adjusts_logits(self) -> bool:
        """Some logits processor changes the target's logits (so also its argmax: a greedy
        request's token is then read off the processed logits, never the device's argmax)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logit_bias) or self.min_tokens > 0
                or self.constraint is not None)


@dataclass(frozen=True)
class StopParams:
    """When a generation ends: EOS (every EOS id of the model), a stop string, a stop token id, or
    a token budget.

    At most MAX_STOP_STRINGS stop strings of 1 to MAX_STOP_CHARS characters each and
    MAX_STOP_TOKEN_IDS stop token ids (>= 0; the vocabulary is the front's to check): the one rule
    every front applies by building this value (InvalidArgument otherwise, before any work).
    The text is cut before a stop string, and before the text of a stop token id, unless
    ``include_stop_str`` (vLLM's ``include_stop_str_in_output``): then it ends with the stop
    string, or the stop token's text. A stop token id, like EOS, stays in the token ids.
    """

    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidArgument(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        rule = f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters each"
        if isinstance(self.stop, str):  # one string is one stop string, not a sequence of characters
            object.__setattr__(self, "stop", (self.stop,))
        if len(self.stop) > MAX_STOP_STRINGS:  # counted before anything is copied or scanned
            raise InvalidArgument(f"{rule}; got {len(self.stop)}")
        stop = tuple(self.stop)
        if not all(isinstance(s, str) for s in stop):
            raise InvalidArgument(f"{rule}; got something other than a string")
        if any(not s for s in stop):
            raise InvalidArgument("stop strings must not be empty")
        if (longest := max(map(len, stop), default=0)) > MAX_STOP_CHARS:
            raise InvalidArgument(f"{rule}; got one of {longest} characters")
        object.__setattr__(self, "stop", stop)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:  # counted before it is copied
            raise InvalidArgument(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} token ids; "
                                  f"got {len(self.stop_token_ids)}")
        ids = tuple(self.stop_token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise InvalidArgument("stop_token_ids must be token ids (integers >= 0)")
        object.__setattr__(self, "stop_token_ids", ids)


# The longest chain anything verifies, and the deepest tree anything grows: bounds on knobs that
# callers set (a request's ChainPolicy, card-client --max-chain, the cache's OpenSession, the
# flags), checked where TreeParams is built, so no path can walk or verify an unbounded chain (the
# cache's model-free lookup loops max_chain times under a session's lock; the target verifies a
# chain in one forward). Why 64: a chain's j-th token commits with probability alpha**j, and at
# alpha = 0.9 (a long copy) the 64th does so one time in a thousand, while its row costs what a
# row always costs; the defaults are 6 to 12 (NGRAM_CHAIN). 64 rows plus t_next also stay inside
# the static step's 128-row bucket (card.engine.shared.static_step.ROW_BUCKETS), leaving the largest
# (256) for the rest of the batch, and 64 is the loose window's bound (VerifyPolicy). The depth
# bound is twice that: a tree deeper than two longest chains holds layers that no chain reaches
# before a correction re-roots it (the model-free drafter's NGRAM_DEPTH is twice its chain, 24).
MAX_CHAIN = 64
MAX_TREE_DEPTH = 2 * MAX_CHAIN


@dataclass(frozen=True)
class TreeParams:
    """Shape of the draft tree and of the chains the target verifies.

    width:      K, primary nodes per layer (the tier C).
    branch:     k, children kept per expanded node (the tier B); 0 means ``width``.
    max_depth:  layers grown below the root before the drafter idles until a correction (at most
                MAX_TREE_DEPTH).
    max_chain:  most drafted tokens the target verifies in one forward (at most MAX_CHAIN).
    b_extension: extend the chain by the best secondary-tier child of its last node.
    min_path_prob: cut the chain before the first token whose path score (the draft's
                probability of the prefix up to it) is below this; 0 never cuts. A row pays when
                its chance of acceptance exceeds its verify cost over the time per token: on a
                GPU an extra row is nearly free; on a CPU it costs a slice of a forward.
    """

    width: int = 4
    branch: int = 0
    max_depth: int = 8
    max_chain: int = 8
    b_extension: bool = True
    min_path_prob: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.width <= 64:
            raise InvalidArgument(f"tree width K must be in [1, 64], got {self.width}")
        if not 0 <= self.branch <= 64:
            raise InvalidArgument(f"branch k must be in [0, 64], got {self.branch}")
        if not 1 <= self.max_depth <= MAX_TREE_DEPTH:
            raise InvalidArgument(f"max_depth must be in [1, {MAX_TREE_DEPTH}], got {self.max_depth}")
        if not 0 <= self.max_chain <= MAX_CHAIN:
            raise InvalidArgument(f"max_chain must be in [0, {MAX_CHAIN}], got {self.max_chain}")
        if not 0.0 <= self.min_path_prob <= 1.0:
            raise InvalidArgument(f"min_path_prob must be in [0, 1], got {self.min_path_prob}")

    def with_overrides(self, **overrides: Any) -> TreeParams:
        """These params with every override that is not None applied: the one way flags (or a
        request's ChainPolicy) go over a default. Names are checked by ``dataclasses.replace``,
        values by ``__post_init__`` (flags arrive as click's dict of them, so typed as Any)."""
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})

    @property
    def chain(self) -> ChainPolicy:
        """The chain fields, every one set (what a session uses)."""
        return ChainPolicy(self.max_chain, self.min_path_prob, self.b_extension)

    @property
    def k(self) -> int:
        return self.branch or self.width


@dataclass(frozen=True)
class ChainPolicy:
    """The chain fields of TreeParams that one request may set for its own cache session.

    The tree's shape (width, branch, depth) belongs to the draft worker that grows it; how much of
    the tree the target verifies per forward is the request's to choose. ``None`` keeps the
    serving side's value. ``over(tree)`` validates through TreeParams.
    """

    max_chain: int | None = None
    min_path_prob: float | None = None
    b_extension: bool | None = None

    def over(self, tree: TreeParams) -> TreeParams:
        return tree.with_overrides(**dataclasses.asdict(self))

    @property
    def empty(self) -> bool:
        return all(v is None for v in dataclasses.asdict(self).values())


@dataclass(frozen=True)
class NgramConfig:
    """max_order / min_order: the longest and shortest n-grams matched; table_mb: the shared
    table's budget (0: no shared table, each session drafts from its own text alone);
    max_followers: followers kept per n-gram; corpus: a text file whose n-grams warm the shared
    table at start; lookahead: cascade only, the n-gram tokens a neural draft's forward checks
    below each node it expands."""

    max_order: int = 4
    min_order: int = 2
    table_mb: float = 64.0
    max_followers: int = 8
    corpus: str | None = None
    lookahead: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_order <= self.max_order <= 16:
            raise InvalidArgument(f"n-gram orders must satisfy 1 <= min ({self.min_order}) <= max "
                                  f"({self.max_order}) <= 16")
        if not (math.isfinite(self.table_mb) and self.table_mb >= 0):
            raise InvalidArgument(f"the n-gram table budget must be >= 0 MB, got {self.table_mb}")
        if not 0 <= self.lookahead <= 64:
            raise InvalidArgument(f"lookahead must be in [0, 64], got {self.lookahead}")
        if self.max_followers < 1:
            raise InvalidArgument(f"max_followers must be >= 1, got {self.max_followers}")
        if self.corpus is not None and not Path(self.corpus).is_file():
            raise InvalidArgument(f"the n-gram corpus {self.corpus} is not a file")

    @property
    def budget_bytes(self) -> int:
        return int(self.table_mb * 2**20)


class Verify(enum.Enum):
    """How the target judges a drafted chain (engine.target.verify).

        exact   a drafted token is kept only where it is the target's own token (greedy, or the
                seeded draw at that position): the output is plain decoding's, token for token
        loose   FLy (arXiv 2511.22972), lossy: a mismatch is also kept where the target is unsure
                there (its top-3 entropy reaches ``entropy_threshold``) and the target agrees with
                the ``window - 1`` drafted tokens after it; a differently worded continuation
                survives, the output is no longer plain decoding's
        rejection speculative sampling (Leviathan et al., Chen et al.) along a chain *drawn* from
                the draft's distributions (``ChainDraw``): drafted x is kept with probability
                min(1, p(x)/q(x)), after a rejection the token comes from norm(max(0, p - q)),
                after a whole chain from p. Each token follows the target's distribution (lossless
                in distribution), but the tokens are not plain decoding's for the same seed. A
                greedy request is verified exactly: there p is one-hot and the rules agree
    """

    EXACT = "exact"
    LOOSE = "loose"
    REJECTION = "rejection"

    @classmethod
    def parse(cls, value: str) -> Verify:
        try:
            return cls(value or "exact")
        except ValueError:
            raise InvalidArgument(f"verify must be one of {', '.join(v.value for v in cls)}, "
                                  f"got {value!r}") from None


MAX_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's top_logprobs bound)


def check_logprobs(n: int | None) -> None:
    """None (no logprobs) or 0 to MAX_LOGPROBS alternatives per token; InvalidArgument otherwise."""
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise InvalidArgument(f"logprobs must be in [0, {MAX_LOGPROBS}] alternatives per token, got {n}")


@dataclass(frozen=True)
class VerifyPolicy:
    """The request's acceptance rule; the FLy thresholds matter to ``loose`` only (the paper's
    defaults: top-3 entropy 0.3 nats, a window of 6 tokens).

    ``q_floor`` and ``secret_coins`` matter to ``rejection`` only, and are the server's, not the
    request's (card-target sets both; in process the draft is the caller's own): a drafted token
    whose claimed q is below ``q_floor`` is never kept, and the rule is scaled so that the output
    still follows p exactly (engine.target.verify); a draft that lies about q can then raise a
    token's probability by at most a factor 1 + 2 / q_floor (0: the classic rule, no bound).
    ``secret_coins``: the rule's coins come from a key drawn per request, not from the seed, so a
    draft that knows or guesses the seed (0 for every unseeded request) cannot predict them."""

    mode: Verify = Verify.EXACT
    entropy_threshold: float = 0.3
    window: int = 6
    q_floor: float = 0.0
    secret_coins: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.q_floor) and 0.0 <= self.q_floor < 1.0):
            raise InvalidArgument(f"the rejection q floor must be in [0, 1), got {self.q_floor}")
        if not (math.isfinite(self.entropy_threshold) and self.entropy_threshold >= 0):
            raise InvalidArgument(f"the loose entropy threshold must be a number >= 0, got "
                                  f"{self.entropy_threshold}")
        if not 2 <= self.window <= 64:
            raise InvalidArgument(f"the loose window must be in [2, 64] tokens, got {self.window}")

    @property
    def lossy(self) -> bool:
        return self.mode is Verify.LOOSE

    def effective(self, sampling: SamplingParams) -> Verify:
        """The rule that runs for a request sampled with ``sampling``: a greedy rejection request
        is verified exactly (p is one-hot there: the rules agree, and the output is plain
        decoding's)."""
        return Verify.EXACT if self.mode is Verify.REJECTION and sampling.greedy else self.mode


# Tier-B entries per expanded node of a drawn (rejection) session, at least: they are the support
# of q, and the rule keeps a drafted token with probability sum(min(p, q)) <= p's mass on them. On
# MT-Bench at temperature 1.0 (Qwen2.5-Coder 0.5B -> 1.5B, 3 x 64 tokens, --no-backoff, one run)
# drafted tokens kept per verified chain went 1.25 (exact) -> 1.38 (rejection, k = 4) -> 2.11
# (rejection, k = 16); the wire and the tree carry 16 entries per node for a few hundred bytes.
DRAW_BRANCH = 16


@dataclass(frozen=True)
class ChainDraw:
    """How a ``rejection`` session's chains are chosen: drawn, not the best path. Below the root,
    each token is drawn from its parent's tier-B entries (the draft's top-k children) at
    ``temperature``, renormalised (the proposal q the target's rule divides by); the draw goes on
    below a drawn token that is a tier-C node and stops after one that is not. The generator is
    seeded from ``seed`` and is not the target's (its uniforms are keyed by position), so the
    chain is independent of the target's coins, which the rule needs."""

    temperature: float
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and SAMPLING_EPS <= self.temperature <= MAX_TEMPERATURE):
            raise InvalidArgument(f"a drawn chain's temperature must be in [{SAMPLING_EPS:g}, "
                                  f"{MAX_TEMPERATURE:g}], got {self.temperature}")
        if self.seed < 0:
            raise InvalidArgument(f"a drawn chain's seed must be >= 0, got {self.seed}")


@dataclass(frozen=True)
class GenerationRequest:
    """Everything one generation needs besides the models. ``logprobs``: None, or report each
    committed token's log-probability with that many likeliest alternatives (0 to MAX_LOGPROBS)."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: StopParams = field(default_factory=StopParams)
    chain: ChainPolicy = field(default_factory=ChainPolicy)
    verify: VerifyPolicy = field(default_factory=VerifyPolicy)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        check_logprobs(self.logprobs)

    @property
    def chain_draw(self) -> ChainDraw | None:
        """How this request's chains are to be chosen: drawn for a sampled ``rejection`` request,
        else (None) the best path."""
        if self.verify.mode is Verify.REJECTION and not self.sampling.greedy:
            return ChainDraw(self.sampling.temperature, self.sampling.seed)
        return None


# Layer shape by hardware, measured on the Qwen2.5-Coder 0.5B -> 1.5B pair (docs/performance.md).
# CPU: three primary nodes per layer, 4 secondary children each. With the draft in fp32 (MKL) a
# layer of K nodes cost nearly K/2 single-token forwards and K=1 won (1.84x vs 1.25x for K=4); the
# int8 draft's layer is nearly flat in K (26 / 30 / 36 ms for K = 1 / 2 / 4 on the AVX-512 box),
# and the wider tier turns secondary hits (after which the tree below the new root is empty) into
# hits: GSM8K 5x64 in one interleaved run, K=1 1.49x, K=2 1.56x, K=3 1.67x, K=4 (depth 6) 1.59x.
# Depth 8, not deeper: an int8 draft fills it during a verification and then idles, and in-process
# the target borrows its core meanwhile (card.engine.inprocess.core_lending); depth 16 kept the draft busy and
# the target on half the cores (1.25x vs 1.41x, GSM8K 3x64, round 2).
# GPUs forward K nodes for about the price of one, so the wider tree pays there.
# No wait for longer chains (the design's "the target never waits"): an in-process policy that
# waited for 2-token chains raised card's accepted length on GSM8K 10x128 from 2.84 to 3.27 but not
# its speed (4.77 vs 4.79 tok/s), and was removed.
# min_path_prob stays 0: on the AVX-512 box a verified row costs ~15 ms of a ~105 ms token, and
# cutting at 0.2 or 0.35 gave no gain on GSM8K or MT-Bench (docs/performance.md).
CPU_TREE = TreeParams(width=3, branch=4, max_depth=8, max_chain=6)
GPU_TREE = TreeParams()
# The model-free drafter (card.engine.draft.ngram) grows a layer in microseconds, so its tree is deep: the
# chain a target gets right after a correction is what survives below the hit, and a tree that
# reaches twice the chain length leaves a full chain there while a copy goes on. Its chains are
# long: a copy runs for dozens of tokens, and a verified row costs a 1.5B target on this CPU
# little beside reading its weights (code editing, Qwen2.5-Coder 1.5B: chains of 6 gave 3.68x
# vanilla at accepted length 4.58, transformers' prompt lookup with 10 candidates 4.36x at 6.06).
NGRAM_DEPTH = 24
NGRAM_CHAIN = 12


def default_tree_params(device_type: str, drafter: DrafterKind = DrafterKind.NEURAL) -> TreeParams:
    """The tree shape for a model running on ``device_type`` ("cpu", "cuda", ...), grown by
    ``drafter``."""
    tree = CPU_TREE if device_type == "cpu" else GPU_TREE
    if drafter is DrafterKind.NGRAM:
        return dataclasses.replace(tree, max_depth=NGRAM_DEPTH, max_chain=max(tree.max_chain, NGRAM_CHAIN))
    return tree


def tree_params(device: str, drafter: DrafterKind = DrafterKind.NEURAL, **overrides: Any) -> TreeParams:
    """The hardware default for ``device`` (a device spec, ``auto`` included) and ``drafter``,
    with every flag that was given (not None) over it: what every entry point builds its tree
    settings with."""
    return default_tree_params(resolve_device(device).type, drafter).with_overrides(**overrides)
