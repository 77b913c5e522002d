"""Constrained decoding (engine.target.grammar): a request's grammar masks every row the target
judges, so constrained card (and sd, and the model-free drafter, and the grammar's own drafts)
equals constrained plain decoding token for token, greedy and seeded, alone and batched; and the
output matches the constraint.

Tiny random models over the SmolLM2 tokenizer (vocab 49152) make the masks real; the negative
controls show the comparisons can fail: a mask on one side only, or verification rows masked
with the committed state instead of the chain's.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence

import pytest
import torch
from transformers import AutoTokenizer

from card.engine.inprocess.sources import NgramCard, SyncDraft
from card.engine.shared.config import (
    Constraint,
    GenerationRequest,
    NgramConfig,
    SamplingParams,
    StopParams,
    TreeParams,
    Verify,
    VerifyPolicy,
)
from card.engine.shared.errors import InvalidArgument
from card.engine.shared.kv_pool import KVPool
from card.engine.shared.session import StepResult
from card.engine.shared.tree import NO_NODE, Chain, Correction
from card.engine.target.chain_source import ChainSource, NoDraft
from card.engine.target.generation import Generation, GenerationResult
from card.engine.target.grammar import GrammarCompiler, GrammarState
from card.engine.target.scheduler import TargetEngine, finish_alone
from tests.engine.support import run_batched
from tests.tiny_models import SMOLLM2_VOCAB, sharpened, smollm2_tokenizer_dir, tiny_model

EOS = 2
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"},
                                           "city": {"enum": ["Paris", "London", "Tokyo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
CONSTRAINTS = {
    "json_schema": Constraint("json_schema", json.dumps(SCHEMA)),
    "json_object": Constraint("json_object"),
    "regex": Constraint("regex", r"[0-9]{3}-[a-z]{2,6}"),
    "choice": Constraint("choice", json.dumps(["positive", "negative", "neutral"])),
    "grammar": Constraint("grammar", 'start: "(" item ("," item)* ")"\nitem: /[a-c]{1,3}/'),
}
SAMPLINGS = {"greedy": SamplingParams(), "seeded": SamplingParams(temperature=0.9, seed=7)}
PROMPT = [1, 504, 3287, 28, 253, 1463, 30]


@functools.cache
def tokenizer():
    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())


@functools.cache
def compiler() -> GrammarCompiler:
    return GrammarCompiler(tokenizer(), SMOLLM2_VOCAB, {EOS})


@functools.cache
def target() -> torch.nn.Module:
    return sharpened(tiny_model("llama", seed=0, vocab=SMOLLM2_VOCAB, hidden=32), 20.0)


@functools.cache
def draft() -> torch.nn.Module:
    return sharpened(tiny_model("llama", seed=0, vocab=SMOLLM2_VOCAB, hidden=32, perturb=0.02), 20.0)


def decode(ids: list[int]) -> str:
    return tokenizer().decode(ids, skip_special_tokens=True)


def request(constraint: Constraint | None, sampling: SamplingParams, max_new: int = 40,
            prompt: Sequence[int] = PROMPT, ignore_eos: bool = False) -> GenerationRequest:
    sampling = SamplingParams(sampling.temperature, seed=sampling.seed, constraint=constraint)
    stop = StopParams(max_new_tokens=max_new, ignore_eos=ignore_eos)
    return GenerationRequest(tuple(prompt), sampling, stop)


def generation(req: GenerationRequest, source: ChainSource, drafts: bool = True,
               grammars: GrammarCompiler | None = None) -> Generation:
    return Generation(req, source, eos_ids=frozenset({EOS}), decode=decode, context_window=512,
                      mode="test", vocab_size=SMOLLM2_VOCAB, grammars=grammars or compiler(),
                      grammar_drafts=drafts)


def run(req: GenerationRequest, source: ChainSource, drafts: bool = True,
        grammars: GrammarCompiler | None = None) -> GenerationResult:
    return finish_alone(target(), generation(req, source, drafts, grammars))


def sources() -> dict[str, ChainSource]:
    return {
        "sd": SyncDraft(draft(), gamma=4),
        "ngram": NgramCard(TreeParams(width=2, branch=2, max_depth=12, max_chain=8), SMOLLM2_VOCAB,
                           NgramConfig(), None, 512),
    }


def check_output(kind: str, result: GenerationResult) -> None:
    """A finished output matches its constraint (one cut by the budget is a prefix of one)."""
    if result.finish_reason != "eos":
        return
    text = result.text
    if kind == "json_schema":
        value = json.loads(text)
        assert set(value) == {"name", "age", "city"} and value["city"] in ("Paris", "London", "Tokyo")
        assert isinstance(value["age"], int) and isinstance(value["name"], str)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,6}", text), text
    elif kind == "choice":
        assert text in ("positive", "negative", "neutral")
    else:
        assert re.fullmatch(r"\(([a-c]{1,3})(,[a-c]{1,3})*\)", text), text


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_constrained_speculation_equals_constrained_plain_decoding(kind: str, sampling: str) -> None:
    req = request(CONSTRAINTS[kind], SAMPLINGS[sampling])
    plain = run(req, NoDraft(), drafts=False)
    check_output(kind, plain)
    assert plain.token_ids, "nothing was generated"
    for name, source in sources().items():
        for drafts in (False, True):
            result = run(req, source, drafts)
            assert result.token_ids == plain.token_ids, (name, drafts, decode(result.token_ids))
            assert result.finish_reason == plain.finish_reason
    # the grammar's drafts alone (no model drafts, chains the grammar forces): the same again
    gen = generation(req, NoDraft(), drafts=True)
    assert finish_alone(target(), gen).token_ids == plain.token_ids


@pytest.mark.parametrize("kind", ["regex", "choice"])
def test_past_the_end_with_ignore_eos_speculation_still_equals_plain_decoding(kind: str) -> None:
    """With ignore_eos the generation goes on past an EOS the grammar allowed: EOS is passed
    over by the grammar alike in plain decoding and inside a chain's rows."""
    for sampling in SAMPLINGS.values():
        req = request(CONSTRAINTS[kind], sampling, max_new=30, ignore_eos=True)
        plain = run(req, NoDraft(), drafts=False)
        assert EOS in plain.token_ids and len(plain.token_ids) == 30
        for source in sources().values():
            assert run(req, source).token_ids == plain.token_ids
        assert run(req, _Oracle(plain.token_ids, len(PROMPT)), drafts=False).token_ids == plain.token_ids


@pytest.mark.parametrize("mode", [Verify.REJECTION, Verify.LOOSE])
def test_rejection_and_loose_keep_the_output_in_the_grammar(mode: Verify) -> None:
    """The lossy-in-tokens rules (drawn chains judged by speculative sampling; FLy's loose keep)
    read the masked rows too: a token the grammar refuses is never kept (a refused committed token
    would fail the grammar's commit), so the output stays in the grammar."""
    verify = VerifyPolicy(mode, entropy_threshold=0.0, window=2)
    for kind in ("json_schema", "regex", "grammar"):
        base = request(CONSTRAINTS[kind], SAMPLINGS["seeded"])
        req = GenerationRequest(base.prompt_ids, base.sampling, base.stop, verify=verify)
        draw = req.chain_draw
        result = run(req, SyncDraft(draft(), gamma=4, draw=draw))
        check_output(kind, result)
        # every committed token is one the grammar took
        state = compiler().state(CONSTRAINTS[kind])
        body = [t for t in result.token_ids if t != EOS]
        assert state.valid_prefix(body) == len(body)


def test_short_choices_and_regexes_finish_and_match() -> None:
    """The grammar ends the generation: EOS is allowed where the grammar accepts, and is all that
    is allowed where it can go no further."""
    for kind in ("regex", "choice", "grammar"):
        for sampling in SAMPLINGS.values():
            result = run(request(CONSTRAINTS[kind], sampling, max_new=60), SyncDraft(draft(), gamma=4))
            if kind != "grammar":  # a random model may take the grammar's repetition far
                assert result.finish_reason == "eos", (kind, result.text)
            check_output(kind, result)


def test_grammar_drafts_are_accepted_and_verified() -> None:
    """A choice's tokens after its first are forced: the grammar drafts them, the target keeps
    them; the forward count drops below plain decoding's."""
    req = request(Constraint("choice", json.dumps(["the quick brown fox jumps over the lazy dog"])),
                  SamplingParams(), max_new=30)
    plain = finish_alone(target(), generation(req, NoDraft(), drafts=False))
    gen = generation(req, NoDraft(), drafts=True)
    drafted = finish_alone(target(), gen)
    assert drafted.token_ids == plain.token_ids
    assert drafted.text == "the quick brown fox jumps over the lazy dog"
    assert gen.grammar_drafted > 0
    assert drafted.stats.target_forwards < plain.stats.target_forwards


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_constrained_batched_equals_alone(sampling: str) -> None:
    """Eight constrained generations in flight (mixed constraints, sd and the model-free drafter
    beside plain decoding) each equal the same request decoded alone without drafts."""
    kinds = list(CONSTRAINTS)
    reqs = [request(CONSTRAINTS[kinds[i % len(kinds)]],
                    SamplingParams(SAMPLINGS[sampling].temperature, seed=i), max_new=24,
                    prompt=[*PROMPT, 40 + i]) for i in range(8)]
    alone = [run(r, NoDraft(), drafts=False).token_ids for r in reqs]
    gens = [generation(r, (NoDraft() if i % 3 == 0 else SyncDraft(draft(), gamma=4) if i % 3 == 1
                           else sources()["ngram"])) for i, r in enumerate(reqs)]
    engine = TargetEngine(target(), KVPool(target(), slots=8, max_len=512), max_batch_tokens=400)
    tokens = run_batched(engine, gens, join_every=1)
    assert [tokens[i] for i in range(len(reqs))] == alone


# ---- negative controls: the comparisons above can fail ------------------------------------------
def test_control_mask_on_one_side_only_differs() -> None:
    """Plain decoding constrained, speculation unconstrained: the tokens differ (so the equality
    above is no accident of a model that writes JSON on its own)."""
    for sampling in SAMPLINGS.values():
        constrained = run(request(CONSTRAINTS["json_schema"], sampling), NoDraft(), drafts=False)
        free = run(request(None, sampling), SyncDraft(draft(), gamma=4))
        assert free.token_ids != constrained.token_ids


class _CommittedStateOnly(GrammarState):
    """A broken state: every row is masked with the committed output's state (the grammar is
    not advanced along the chain), chains are not cut, and a refused committed token is skipped
    instead of failing."""

    def mask(self, prefix: Sequence[int]) -> torch.Tensor:
        return super().mask(())

    def valid_prefix(self, chain: Sequence[int]) -> int:
        return len(chain)

    def commit(self, tokens: Sequence[int]) -> None:
        self._to([])
        for t in tokens:
            if t != EOS and self._matcher.validate_tokens([t]) == 1:
                self._matcher.consume_token(t)


class _BrokenCompiler(GrammarCompiler):
    def state(self, constraint: Constraint) -> GrammarState:
        good = super().state(constraint)
        return _CommittedStateOnly(good._matcher, self.eos_ids, self.tokenizer.eos_token)


class _Oracle(NoDraft):
    """Chains of the reference output's next tokens: each is kept whole where every row of it is
    judged as plain decoding judged it."""

    def __init__(self, reference: Sequence[int], prompt_len: int) -> None:
        self.reference, self.prompt_len = list(reference), prompt_len
        self.committed: Sequence[int] = ()

    def open(self, committed: Sequence[int]) -> None:
        self.committed = committed

    def step(self, correction: Correction) -> StepResult:
        done = len(self.committed) - self.prompt_len
        tokens = tuple(self.reference[done:done + 8])
        return StepResult(Chain(tokens, (NO_NODE,) * len(tokens), correction.epoch))


def test_control_rows_masked_with_the_committed_state_differ() -> None:
    """Chains of plain decoding's own tokens are kept whole with the real state, and not when a
    chain's rows are masked without following the chain: the comparison catches a grammar that
    is not advanced along the chain (or not rolled back: the rows then see the wrong state)."""
    broken = _BrokenCompiler(tokenizer(), SMOLLM2_VOCAB, {EOS})
    for kind in ("json_schema", "regex", "choice", "grammar"):
        for name, sampling in SAMPLINGS.items():
            req = request(CONSTRAINTS[kind], sampling)
            plain = run(req, NoDraft(), drafts=False)
            oracle = run(req, _Oracle(plain.token_ids, len(PROMPT)), drafts=False)
            assert oracle.token_ids == plain.token_ids
            assert oracle.stats.target_forwards < plain.stats.target_forwards
            wrong = run(req, _Oracle(plain.token_ids, len(PROMPT)), drafts=False, grammars=broken)
            assert wrong.token_ids != plain.token_ids, (kind, name)


# ---- the constraint's edge -----------------------------------------------------------------------
@pytest.mark.parametrize(("kind", "text", "needle"), [
    ("json_schema", '{"type": "objectx"}', "objectx"),
    ("json_schema", "{not json", "not valid JSON"),
    ("regex", "([a-z", "regex"),
    ("choice", "[]", "choice"),
    ("grammar", "start: undefined_rule", "undefined_rule"),
    ("yaml", "a: 1", "kind"),
])
def test_bad_constraints_are_refused_naming_the_problem(kind: str, text: str, needle: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(needle)):
        compiler().check(Constraint(kind, text))


def test_grammar_state_rolls_back_along_chains() -> None:
    """Row masks of a chain equal the masks plain decoding reads after committing its prefix,
    whatever order the rows are read in."""
    c = CONSTRAINTS["json_schema"]
    text_ids = tokenizer().encode('{"name": "Al", "age": 3, "city": "Tokyo"}')
    spec = compiler().state(c)
    rows = [spec.mask(text_ids[:j]) for j in (5, 2, 9, 0, len(text_ids), 3)]
    for j, row in zip((5, 2, 9, 0, len(text_ids), 3), rows, strict=True):
        fresh = compiler().state(c)
        fresh.commit(text_ids[:j])
        assert torch.equal(fresh.mask(()), row), j
    done = compiler().state(c)
    done.commit(text_ids)
    allowed = done.mask(())
    assert done.finished and allowed.nonzero().flatten().tolist() == [EOS]
