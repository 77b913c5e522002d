"""Prefix caching (card.engine.shared.prefix_cache, KVPool.acquire_prefix): a prompt that starts
with whole prefill chunks another prompt computed takes their keys and values instead of
prefilling them, and every output is the same token for token as with caching off (greedy and
seeded, alone and 8 in flight, fp32 and bf16); the reused keys and values are the very bits a cold
prefill writes. Negative controls: keys and values computed at other chunk boundaries, or after a
one-token-different parent, are other bits and give other logits, and the index refuses them."""

from __future__ import annotations

import os

import pytest
import torch

from card.engine.draft.drafter import Drafter
from card.engine.inprocess.runner import InProcessRunner, RunnerConfig
from card.engine.loading.invariant import make_exact
from card.engine.loading.models import LoadedModel
from card.engine.shared.config import (
    ChainDraw,
    GenerationRequest,
    Mode,
    SamplingParams,
    StopParams,
    TreeParams,
)
from card.engine.shared.kv_pool import PREFILL_CHUNK, KVPool, Segment, forward
from card.engine.shared.prefix_cache import PREFIX_BLOCK, PrefixCache, chain
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine
from tests.engine.support import VOCAB, LetterTokenizer, letters, run_batched
from tests.tiny_models import tiny_model

B = PREFILL_CHUNK
WINDOW = 1536


def _model(dtype: torch.dtype) -> torch.nn.Module:
    model = tiny_model("llama", seed=0, vocab=VOCAB, dtype=dtype)
    make_exact(model, exact=True, prepack=True)  # row-invariant linears, as load_model makes them
    return model


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


DOC = _tokens(700, seed=1)  # a shared document: two whole prefill chunks and a part
K = PREFIX_BLOCK
# what the questions below reuse: DOC's whole prefix blocks, and for the prompt of exactly two
# chunks its whole blocks but the one holding its last token (a token is always prefilled)
REUSED = [0, len(DOC) // K * K, len(DOC) // K * K, (2 * B - 1) // K * K]


def _requests(sampled: bool, n: int = 4) -> list[GenerationRequest]:
    """Questions about DOC asked in turn: the document, then a different question each (one of
    them ends exactly at a block edge: its last block is not reused, a token is always left)."""
    prompts = [DOC + _tokens(5 + 7 * i, seed=10 + i) for i in range(n - 1)] + [DOC[:2 * B]]
    return [GenerationRequest(tuple(p), SamplingParams(0.9, seed=i) if sampled else SamplingParams(),
                              StopParams(max_new_tokens=12, ignore_eos=True))
            for i, p in enumerate(prompts)]


def _gen(model: torch.nn.Module, r: GenerationRequest) -> Generation:
    return Generation(r, NoDraft(), eos_ids=frozenset(), decode=letters, context_window=WINDOW,
                      mode="vanilla", vocab_size=model.config.vocab_size)


def _engine(model: torch.nn.Module, caching: bool, slots: int = 2, **kwargs: object) -> TargetEngine:
    return TargetEngine(model, KVPool(model, slots=slots, max_len=WINDOW, prefix_caching=caching), **kwargs)


def _in_turn(engine: TargetEngine, requests: list[GenerationRequest]) -> list[Generation]:
    gens = []
    for r in requests:
        gen = _gen(engine.model, r)
        for _ in engine.stream(gen):
            pass
        gens.append(gen)
    return gens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sampled", [False, True])
def test_questions_in_turn_equal_caching_off(dtype: torch.dtype, sampled: bool) -> None:
    model = _model(dtype)
    requests = _requests(sampled)
    cold = _in_turn(_engine(model, caching=False), requests)
    engine = _engine(model, caching=True)
    warm = _in_turn(engine, requests)
    assert [g.result.token_ids for g in warm] == [g.result.token_ids for g in cold]
    # the cache was really used (the test could fail): the document's blocks for every later
    # question (not at prefill-chunk boundaries: an exact prefill's rows do not depend on them)
    assert [g.stats.cached_tokens for g in warm] == REUSED
    assert all(g.stats.cached_tokens == 0 for g in cold)
    pairs = zip(warm[1:], cold[1:], strict=True)
    assert all(w.stats.target_forwards < c.stats.target_forwards for w, c in pairs)
    assert engine.pool.prefix is not None and engine.pool.prefix.hits == sum(REUSED)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sampled", [False, True])
def test_eight_in_flight_equal_caching_off(dtype: torch.dtype, sampled: bool) -> None:
    """8 questions at once on 4 slots after one warm-up: hits from free slots (no copy) and from
    live ones (rows copied), and every output equals the same request with caching off."""
    model = _model(dtype)
    requests = _requests(sampled, n=9)
    cold = _in_turn(_engine(model, caching=False, slots=1), requests)
    engine = _engine(model, caching=True, slots=4)
    _in_turn(engine, requests[:1])
    gens = [_gen(model, r) for r in requests[1:]]
    batched = run_batched(engine, gens, join_every=1)
    assert [batched[i] for i in range(8)] == [g.result.token_ids for g in cold[1:]]
    assert all(g.stats.cached_tokens > 0 for g in gens)
    assert engine.pool.free_slots == 4


def test_the_copy_and_the_free_slot_paths() -> None:
    """A prefix held by a live session is copied into another slot (every layer, the same bits);
    one held by a free slot is taken with that slot; a slot taken by another prompt forgets it."""
    model = _model(torch.float32)
    engine = _engine(model, caching=True, slots=3)
    pool = engine.pool
    assert pool.prefix is not None
    gen = _gen(model, _requests(False)[0])
    engine.add(gen)
    while gen.prefilling:
        engine.step()
    live = gen.slot
    assert live is not None and pool.prefix.rows(live) == len(gen.request.prompt_ids) // K * K
    prompt = [*DOC[:2 * B], 1, 2, 3]
    got = pool.acquire_prefix(prompt)
    assert got is not None and got[0] != live and got[1] == 2 * B
    for t in (*pool.keys, *pool.values):
        assert torch.equal(t[got[0], :, :2 * B], t[live, :, :2 * B])
    pool.release(got[0])
    again = pool.acquire_prefix(prompt)
    assert again == got  # the free slot holding the prefix, taken as it is
    pool.release(again[0])
    other = pool.acquire_prefix(_tokens(600, seed=99))  # a miss: the LRU free slot, emptied
    assert other is not None and other[1] == 0 and pool.prefix.rows(other[0]) == 0
    pool.release(other[0])
    engine.cancel(gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reused_keys_and_values_are_the_recomputed_bits(dtype: torch.dtype) -> None:
    model = _model(dtype)
    prompt = DOC[:2 * B] + _tokens(100, seed=5)
    stop = StopParams(max_new_tokens=1, ignore_eos=True)  # no row past the prompt is written
    cold = _engine(model, caching=False, slots=1)
    _in_turn(cold, [GenerationRequest(tuple(prompt), SamplingParams(), stop)])
    warm = _engine(model, caching=True, slots=1)
    _in_turn(warm, [GenerationRequest(tuple([*DOC, 7]), SamplingParams(), stop)])  # computes the blocks
    (gen,) = _in_turn(warm, [GenerationRequest(tuple(prompt), SamplingParams(), stop)])
    assert gen.stats.cached_tokens == 2 * B
    n = len(prompt)
    for a, b in zip((*cold.pool.keys, *cold.pool.values), (*warm.pool.keys, *warm.pool.values), strict=True):
        assert torch.equal(a[0, :, :n], b[0, :, :n])


def _first_logits(model: torch.nn.Module, prompt: list[int], pool: KVPool, cached: int) -> torch.Tensor:
    """The logits of ``prompt``'s last token, its first ``cached`` rows taken from slot 0 of
    ``pool`` as they are and the rest prefilled in PREFILL_CHUNK chunks from there."""
    gen = _gen(model, GenerationRequest(tuple(prompt), SamplingParams(), StopParams(max_new_tokens=1)))
    gen.slot = 0
    gen.reuse(cached)
    out = None
    while gen.prefilling:
        tokens, start = gen.next_input(B)
        last = start + len(tokens) == len(prompt)
        out = forward(model, pool, [Segment(0, start, len(tokens))], torch.tensor(list(tokens)),
                      torch.tensor([len(tokens) - 1] if last else [], dtype=torch.int64))
        gen._prefilled += len(tokens)
    assert out is not None
    return out[-1]


def test_negative_controls_other_boundaries_or_parent_give_other_bits() -> None:
    """Keys and values that are not what a cold prefill at PREFILL_CHUNK boundaries writes change
    the logits (so the tests above could fail), and the index never offers them."""
    model = tiny_model("llama", seed=0, vocab=VOCAB, dtype=torch.float32)  # plain linears
    prompt = DOC[:2 * B] + _tokens(40, seed=6)
    pool = KVPool(model, slots=1, max_len=WINDOW)
    want = _first_logits(model, prompt, pool, 0)
    # the same two blocks prefilled in chunks of 100: other bits
    for start in range(0, 2 * B, 100):
        n = min(100, 2 * B - start)
        forward(model, pool, [Segment(0, start, n)], torch.tensor(prompt[start:start + n]),
                torch.empty(0, dtype=torch.int64))
    misaligned = _first_logits(model, prompt, pool, 2 * B)
    # the second block computed after a first block one token different: other bits
    parent = list(prompt)
    parent[3] = (parent[3] + 1) % VOCAB
    _first_logits(model, [*parent[:2 * B], 0], pool, 0)
    wrong_parent = _first_logits(model, prompt, pool, 2 * B)
    right = _first_logits(model, prompt, pool, 0)  # recomputed: the same bits as cold
    assert torch.equal(right, want)
    assert not torch.equal(misaligned, want)
    assert not torch.equal(wrong_parent, want)
    # the index: one token different in block 0 changes block 1's hash, so nothing is offered
    index = PrefixCache(slots=1, block=B, max_rows=WINDOW)
    index.computed(0, 0, parent[:2 * B])
    assert chain(parent, B)[1] != chain(prompt, B)[1]
    assert index.match(prompt) is None
    assert index.match([*parent[:2 * B], 1]) is not None
    # rows that are not a whole block from a block edge are not indexed
    index.truncate(0, 0)
    index.computed(0, 100, prompt[100:100 + B])
    index.computed(0, 0, prompt[:B - 1])
    assert index.entries == 0


def test_an_exact_prefill_does_not_depend_on_its_chunking() -> None:
    """An exact engine's prompt rows are a decoding row's bits whatever chunk they came in: an
    engine chunking otherwise gives the same tokens and reuses the same rows."""
    model = _model(torch.float32)
    requests = _requests(True)
    want = _in_turn(_engine(model, caching=True), requests)
    engine = _engine(model, caching=True, prefill_chunk=100)
    assert engine.prefill_exact and engine.prefix_caching
    got = _in_turn(engine, requests)
    assert [g.result.token_ids for g in got] == [g.result.token_ids for g in want]
    assert [g.stats.cached_tokens for g in got] == REUSED


def test_an_inexact_prefill_reuses_whole_chunks_of_its_own_only() -> None:
    """--exact off (SDPA, whose bits depend on the chunking): whole prefill chunks, at the engine's
    own boundaries, and never the rows a session decoded."""
    model = _model(torch.float32)
    engine = _engine(model, caching=True, exact=False, prefill_chunk=2 * B)
    assert engine.prefix_caching and not engine.prefill_exact
    gens = _in_turn(engine, _requests(False))
    assert [g.stats.cached_tokens for g in gens] == [0, 2 * B, 2 * B, 0]
    assert engine.pool.prefix is not None
    assert all(engine.pool.prefix.rows(s) <= len(DOC) + 26 for s in range(2))  # prompts only
    assert _engine(model, caching=True, exact=False, prefill_chunk=100).prefix_caching is False


CHAT = _tokens(150, seed=20)  # a system prompt and a first question


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sampled", [False, True])
def test_a_chat_turn_reuses_the_rows_its_answer_was_decoded_in(dtype: torch.dtype, sampled: bool) -> None:
    """A conversation's second turn (the first prompt, its answer, a new question) starts after
    the answer's rows too, as vLLM's does: a decoded row's keys and values are the bits a prefill
    of the same tokens gives. Every output equals caching off."""
    model = _model(dtype)
    sampling = SamplingParams(0.9, seed=3) if sampled else SamplingParams()
    stop = StopParams(max_new_tokens=40, ignore_eos=True)
    first = GenerationRequest(tuple(CHAT), sampling, stop)
    engine = _engine(model, caching=True)
    (one,) = _in_turn(engine, [first])
    answer = one.result.token_ids
    second = GenerationRequest(tuple([*CHAT, *answer, *_tokens(9, seed=21)]), sampling, stop)
    (two,) = _in_turn(engine, [second])
    cold = _in_turn(_engine(model, caching=False), [first, second])
    assert [one.result.token_ids, two.result.token_ids] == [g.result.token_ids for g in cold]
    # every row of the first turn but its last token's (no keys yet), in whole blocks
    assert two.stats.cached_tokens == (len(CHAT) + len(answer) - 1) // K * K > len(CHAT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoded_rows_are_the_bits_of_a_prefill_and_sdpa_ones_are_not(dtype: torch.dtype) -> None:
    """The invariant the reuse of decoded rows rests on, bit for bit: keys and values of tokens
    decoded one row at a time (the exact decoding rows) equal the same tokens prefilled in one
    chunk through the prefill's block attention. Negative control: prefilled through SDPA (an
    inexact engine's prefill), they differ."""
    model = _model(dtype)
    tokens = torch.tensor(_tokens(200, seed=7))
    prompt = 130

    def kv(prefill: list[Segment]) -> list[torch.Tensor]:
        pool = KVPool(model, slots=1, max_len=WINDOW)
        assert pool.prefill_invariant
        for seg in prefill:
            forward(model, pool, [seg], tokens[seg.start:seg.end], torch.empty(0, dtype=torch.int64))
        return [t[0, :, :len(tokens)].clone() for t in (*pool.keys, *pool.values)]

    decoded = kv([Segment(0, 0, prompt, exact=True, prefill=True),
                  *(Segment(0, p, 1, exact=True) for p in range(prompt, len(tokens)))])
    blocks = kv([Segment(0, 0, 37, exact=True, prefill=True),
                 Segment(0, 37, len(tokens) - 37, exact=True, prefill=True)])
    sdpa = kv([Segment(0, 0, 37), Segment(0, 37, len(tokens) - 37)])
    assert all(torch.equal(a, b) for a, b in zip(decoded, blocks, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(decoded, sdpa, strict=True))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_rotating_prefixes_keep_the_index_and_memory_bounded() -> None:
    """1,000 prompts over 30 rotating prefixes and a hot one on 3 slots and 9 of finished
    sequences bounded to about four sequences' rows: the index never holds more than the slots'
    blocks, hashes and slots agree, what free slots keep stays within its bound (pages given
    back), the hot prefix stays (LRU), every slot comes back free, and the process's memory after
    1,000 requests is where it was after 100 (the pool is preallocated; nothing grows per
    request)."""
    model = tiny_model("llama", seed=0, vocab=VOCAB, dtype=torch.float32)
    slots, cached = 3, 9
    row = KVPool(model, slots=1, max_len=WINDOW).bytes_per_row
    engine = _pool_engine(model, slots, cached, cache_bytes=4 * 700 * row)
    pool = engine.pool
    index = pool.prefix
    assert index is not None
    bound = (slots + cached) * (WINDOW // K)
    prefixes = [_tokens(300 + 37 * i % 400, seed=100 + i) for i in range(30)]
    warm = 0
    for i in range(1000):
        prompt = prefixes[0 if i % 3 == 0 else (i * 7) % 30] + [i % VOCAB, 1, 2]
        _in_turn(engine, [GenerationRequest(tuple(prompt), SamplingParams(),
                                            StopParams(max_new_tokens=2, ignore_eos=True))])
        assert index.entries <= bound and len(index._index) <= index.entries
        assert pool.cache_bytes is not None and pool.cached_rows * row <= pool.cache_bytes
        if i == 99:
            warm = _rss()
    assert sum(len(v) for v in index._index.values()) == index.entries
    assert engine.pool.free_slots == slots and pool.evictions > 0
    assert index.hits >= 333 * B  # the hot prefix, each time after its first
    assert _rss() - warm < 64 * 2**20, (warm, _rss())


def test_the_in_process_runner_reuses_its_prefix() -> None:
    model = _model(torch.float32)
    target = LoadedModel("tiny", model, LetterTokenizer(), "fp", frozenset(), WINDOW)
    requests = _requests(True)
    off = InProcessRunner(target, None, RunnerConfig(mode=Mode.VANILLA, prefix_caching=False))
    on = InProcessRunner(target, None, RunnerConfig(mode=Mode.VANILLA))
    want = [off.run(r) for r in requests]
    got = [on.run(r) for r in requests]
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.stats.cached_tokens for r in got] == REUSED
    assert all(r.stats.cached_tokens == 0 for r in want)


@pytest.mark.parametrize("drawn", [False, True])
def test_a_draft_session_starts_from_its_cached_prefix(drawn: bool) -> None:
    """The draft worker's pool: a second session over the same document prefills only its own
    tail. A session whose chains only choose what the target verifies reuses every whole block of
    the document, as the target does; a drawn one (rejection: its output depends on the draft's
    distributions) whole prefill chunks only, so that its tree is bitwise a cold drafter's."""
    model = tiny_model("llama", seed=0, vocab=VOCAB, dtype=torch.float64)
    params = TreeParams(width=2, max_depth=3)
    draw = ChainDraw(0.8, seed=7) if drawn else None
    pool = KVPool(model, slots=2, max_len=WINDOW, prefix_caching=True)
    first = Drafter(model, params, pool=pool)
    first.start([*DOC, 1, 2])
    while first.pending:
        first.grow()
    first.release()
    second = Drafter(model, params, pool=pool)
    second.start([*DOC, 3, 4, 5], draw=draw)
    reused = 2 * B if drawn else len(DOC) // PREFIX_BLOCK * PREFIX_BLOCK
    assert reused > 2 * B or drawn  # the blocks reach past the chunks (a control of the parameter)
    assert second.n_committed == reused and len(second.pending) == len(DOC) + 3 - reused
    cold = Drafter(model, params, max_len=WINDOW)
    cold.start([*DOC, 3, 4, 5], draw=draw)
    a, b = second.grow(), cold.grow()
    assert a is not None and b is not None
    assert torch.equal(a[0].tokens, b[0].tokens)
    if drawn:
        assert torch.equal(a[0].local_logp, b[0].local_logp) and torch.equal(a[0].b_logp, b[0].b_logp)
    assert second.forwards < cold.forwards


def test_a_next_turn_draft_reuses_the_rows_its_answer_grew() -> None:
    """A conversation's second turn through card in process: the draft worker's slot still holds
    the first turn's prompt and the answer its tree grew (loose blocks, indexed when the session
    ended), so the second session prefills only its new message on the draft side too; every
    output is plain decoding's."""
    model = _model(torch.float32)
    target = LoadedModel("tiny", model, LetterTokenizer(), "fp", frozenset(), WINDOW)
    plain = InProcessRunner(target, None, RunnerConfig(mode=Mode.VANILLA, prefix_caching=False))
    first = GenerationRequest(tuple(DOC[:40]), SamplingParams(),
                              StopParams(max_new_tokens=60, ignore_eos=True))
    config = RunnerConfig(mode=Mode.CARD, tree=TreeParams(width=2, max_depth=3), backoff=False)
    card = InProcessRunner(target, target, config)  # the target as its own draft: it follows every token
    try:
        one = card.run(first)
        assert card.worker is not None and card.worker.pool is not None
        index = card.worker.pool.prefix
        assert index is not None
        before = index.hits
        second = GenerationRequest((*first.prompt_ids, *one.token_ids, *_tokens(9, seed=5)), SamplingParams(),
                                   StopParams(max_new_tokens=12, ignore_eos=True))
        two = card.run(second)
        reused = index.hits - before
    finally:
        card.close()
    assert one.token_ids == plain.run(first).token_ids and two.token_ids == plain.run(second).token_ids
    # the first turn's text but its last tokens (a chain's worth may still wait to be prefilled),
    # not only the first prompt's 2 blocks, which is all a prefill-only index had
    assert reused >= (40 + 60 - 16) // K * K > 40 // K * K, reused


def test_a_drawn_draft_session_never_reuses_rows_off_a_cold_prefills_chunks() -> None:
    """A drawn session's tree must be a cold drafter's, so it reuses only rows a cold prefill
    computes alike: whole chunks at chunk boundaries, after nothing loose. A session that reused 3
    blocks and prefilled on from row 48 wrote rows whose chunks a cold prefill does not have:
    block sessions may take them, a drawn one takes none of them (its tree equals a cold one's)."""
    model = tiny_model("llama", seed=0, vocab=VOCAB, dtype=torch.float64)
    params = TreeParams(width=2, max_depth=3)
    pool = KVPool(model, slots=1, max_len=WINDOW, prefix_caching=True)
    tail = _tokens(600, seed=3)

    def session(prompt: list[int], draw: ChainDraw | None = None) -> Drafter:
        d = Drafter(model, params, pool=pool)
        d.start(prompt, draw=draw)
        while d.pending:
            d.grow()
        return d

    session([*DOC, 1]).release()  # two whole chunks (exact), then a part (loose)
    shifted = session([*DOC[:48], *tail])
    assert shifted.n_committed == len(DOC[:48] + tail)  # it reused DOC's first 3 blocks, then prefilled
    shifted.release()
    assert pool.prefix is not None and pool.prefix.exact_blocks(0) == 3
    prompt = [*DOC[:48], *tail, 7, 7, 7]
    assert pool.acquire_prefix(prompt, PREFIX_BLOCK, exact_only=False) == (0, (len(prompt) - 1) // K * K)
    pool.release(0)  # control: a block session would take every block of it
    draw = ChainDraw(0.8, seed=7)
    drawn = Drafter(model, params, pool=pool)
    drawn.start(prompt, draw=draw)
    assert drawn.n_committed == 0  # no whole chunk of it is a cold prefill's
    cold = Drafter(model, params, max_len=WINDOW)
    cold.start(prompt, draw=draw)
    a, b = drawn.grow(), cold.grow()
    while not (a or b):
        a, b = drawn.grow(), cold.grow()
    assert a is not None and b is not None
    assert torch.equal(a[0].tokens, b[0].tokens) and torch.equal(a[0].local_logp, b[0].local_logp)


def test_card_in_process_reuses_both_prefixes_and_equals_plain_decoding() -> None:
    """card through the in-process runner: the target's slot and the draft worker's pool both
    reuse the document, and every output is plain decoding's (caching off)."""
    model = _model(torch.float32)
    target = LoadedModel("tiny", model, LetterTokenizer(), "fp", frozenset(), WINDOW)
    requests = _requests(False)
    plain = InProcessRunner(target, None, RunnerConfig(mode=Mode.VANILLA, prefix_caching=False))
    want = [plain.run(r).token_ids for r in requests]
    config = RunnerConfig(mode=Mode.CARD, tree=TreeParams(width=2, max_depth=3), backoff=False)
    card = InProcessRunner(target, target, config)
    try:
        got = [card.run(r) for r in requests]
        assert card.worker is not None and card.worker.pool is not None
        draft_index = card.worker.pool.prefix
    finally:
        card.close()
    assert [r.token_ids for r in got] == want
    assert [r.stats.cached_tokens for r in got] == REUSED
    assert sum(r.stats.draft_forwards for r in got) > 0
    assert draft_index is not None and draft_index.hits >= 5 * B  # the draft's prefills reused too


def test_card_draft_counts_its_prefix_cache() -> None:
    """card-draft's card_draft_prefix_cache_{queries,hits}_total follow its worker's pool: a
    second session over the document reuses its whole blocks, and the counters say so."""
    from prometheus_client import REGISTRY

    from card.draft_service.config import DraftConfig
    from card.draft_service.link import CacheLink
    from card.engine.draft.worker import DraftWorker
    from card.engine.loading.models import ModelConfig
    from card.engine.shared.commands import StartDraft, StopDraft

    model = tiny_model("llama", seed=0, vocab=VOCAB, dtype=torch.float64)

    def build(publish, on_forward, on_drop):  # type: ignore[no-untyped-def]
        return DraftWorker(model, TreeParams(width=2, max_depth=2), publish, slots=2, max_len=WINDOW,
                           on_forward=on_forward, on_drop=on_drop), "fp"

    def sample(name: str) -> float:
        return REGISTRY.get_sample_value(name) or 0.0

    before = [sample("card_draft_prefix_cache_queries_total"), sample("card_draft_prefix_cache_hits_total")]
    link = CacheLink(DraftConfig(cache_addr="127.0.0.1:1", model=ModelConfig("default"), name="d"), build)
    worker = link.worker
    for i, tail in enumerate(([1, 2], [3, 4, 5])):  # applied on this thread: the worker is not started
        worker._apply(StartDraft(f"s{i}", tuple(DOC + tail), 0))
        while worker._round():
            pass
        worker._apply(StopDraft(f"s{i}"))
    after = [sample("card_draft_prefix_cache_queries_total"), sample("card_draft_prefix_cache_hits_total")]
    assert after[0] - before[0] == 2 * len(DOC) + 5
    assert after[1] - before[1] == len(DOC) // PREFIX_BLOCK * PREFIX_BLOCK  # every whole block


@pytest.mark.parametrize("sampled", [False, True])
def test_prompts_admitted_together_compute_their_document_once(sampled: bool) -> None:
    """Four questions about one new document admitted in one iteration on 4 slots: the first
    computes the document, the others copy its rows as they come and prefill only their own
    tails; every output equals caching off. Control: without prefix caching each computes all."""
    model = _model(torch.float32)
    requests = _requests(sampled)
    want = [g.result.token_ids for g in _in_turn(_engine(model, caching=False), requests)]

    def together(caching: bool) -> list[Generation]:
        engine = _engine(model, caching=caching, slots=4)
        gens = [_gen(model, r) for r in requests]
        for g in gens:
            engine.add(g)
        while not engine.idle:
            for event in engine.step():
                assert event.error is None, event.error
        return gens

    gens = together(True)
    assert [g.result.token_ids for g in gens] == want
    own = [len(r.prompt_ids) - g.stats.cached_tokens for r, g in zip(requests, gens, strict=True)]
    assert own[0] == len(requests[0].prompt_ids) and max(own[1:]) < 64, own
    alone = together(False)
    assert [g.result.token_ids for g in alone] == want
    assert all(g.stats.cached_tokens == 0 for g in alone)


def test_common_prefix_length() -> None:
    from card.engine.target.scheduler import _common

    a = list(range(100))
    assert _common(a, a, 1000) == 100 and _common(a, a, 40) == 40
    assert _common(a, [*a[:57], -1, *a[58:]], 1000) == 57
    assert _common(a, [-1], 10) == 0 and _common((), a, 5) == 0
    assert _common(tuple(a), tuple(a[:30]), 1000) == 30


def _pool_engine(model: torch.nn.Module, slots: int, cached: int,
                 cache_bytes: int | None = None) -> TargetEngine:
    pool = KVPool(model, slots=slots, max_len=WINDOW, prefix_caching=True, cached_slots=cached,
                  cache_bytes=cache_bytes)
    return TargetEngine(model, pool)


DOCS = [_tokens(300 + 16 * i, seed=200 + i) for i in range(6)]


def _doc_requests(question: int, sampled: bool = False) -> list[GenerationRequest]:
    return [GenerationRequest(tuple(d + _tokens(9, seed=question * 50 + i)),
                              SamplingParams(0.9, seed=i) if sampled else SamplingParams(),
                              StopParams(max_new_tokens=6, ignore_eos=True)) for i, d in enumerate(DOCS)]


@pytest.mark.parametrize("sampled", [False, True])
def test_cached_slots_keep_more_sequences_than_run_at_once(sampled: bool) -> None:
    """Six documents asked about in turn on 2 live slots, then a second question about each: with
    10 slots of finished sequences all six are still cached (the control, without them: none is
    by the time its question comes), every output equals caching off, and no more than 2 run at
    once."""
    model = _model(torch.float32)
    first, second = _doc_requests(0, sampled), _doc_requests(1, sampled)
    cold = _in_turn(_engine(model, caching=False), second)
    engine = _pool_engine(model, slots=2, cached=10)
    _in_turn(engine, first)
    warm = _in_turn(engine, second)
    assert [g.result.token_ids for g in warm] == [g.result.token_ids for g in cold]
    assert all(g.stats.cached_tokens == len(d) // K * K for g, d in zip(warm, DOCS, strict=True))
    control = _pool_engine(model, slots=2, cached=0)
    _in_turn(control, first)
    # the two most recent documents were cached, and the first two questions took their slots
    assert not any(g.stats.cached_tokens for g in _in_turn(control, second))
    # the cached slots are room for finished sequences, not for more at once
    gens = [_gen(model, r) for r in first[:3]]
    for g in gens:
        engine.add(g)
    engine.step()
    assert len(engine.running) == 2 and len(engine.waiting) == 1 and engine.pool.free_slots == 0
    while not engine.idle:
        engine.step()
    assert engine.pool.free_slots == 2


def test_the_cache_gives_pages_back_past_its_memory_bound() -> None:
    """On the CPU, finished sequences keep at most ``cache_bytes`` of rows: the least recently
    used slots' pages go back to the system (mincore: none resident), the most recent stay
    cached, and a document whose slot was given back is served again with the same tokens (its
    rows recomputed over zero pages). Control: without a bound every page stays resident."""
    from card.engine.shared.pages import resident_pages

    model = _model(torch.float32)
    requests = _doc_requests(0)
    cold = _in_turn(_engine(model, caching=False), requests)
    pool_bytes = KVPool(model, slots=1, max_len=WINDOW).bytes_per_row
    bound = 2 * 340 * pool_bytes  # about two finished sequences
    engine = _pool_engine(model, slots=1, cached=6, cache_bytes=bound)
    pool = engine.pool
    warm, slots = _in_turn_slots(engine, requests)
    assert [g.result.token_ids for g in warm] == [g.result.token_ids for g in cold]
    assert pool.cached_rows * pool.bytes_per_row <= bound
    assert pool.evictions >= 3
    resident = [resident_pages(pool.keys[0][s]) for s in slots]
    assert resident[0] == 0 and resident[-1] > 0, resident
    again = _in_turn(engine, _doc_requests(1))
    cold_again = _in_turn(_engine(model, caching=False), _doc_requests(1))
    assert [g.result.token_ids for g in again] == [g.result.token_ids for g in cold_again]
    assert again[0].stats.cached_tokens == 0  # given back: recomputed
    # control: no bound, every finished sequence's pages stay
    unbounded = _pool_engine(model, slots=1, cached=6)
    _, slots = _in_turn_slots(unbounded, requests)
    assert all(resident_pages(unbounded.pool.keys[0][s]) > 0 for s in slots)
    assert unbounded.pool.evictions == 0


def _in_turn_slots(engine: TargetEngine,
                   requests: list[GenerationRequest]) -> tuple[list[Generation], list[int]]:
    """``_in_turn``, and the KV slot each generation ran in."""
    gens, slots = [], []
    for r in requests:
        gen = _gen(engine.model, r)
        engine.add(gen)
        engine.step()
        assert gen.slot is not None
        slots.append(gen.slot)
        while not engine.idle:
            engine.step()
        gens.append(gen)
    return gens, slots


def test_a_draft_pool_keeps_more_finished_sessions_than_it_runs() -> None:
    """A draft worker's pool with cached slots: four sessions over four documents, one at a time on
    one live slot, then a next session over each starts from its document's blocks (the control,
    without cached slots: only the last one does)."""
    model = tiny_model("llama", seed=0, vocab=VOCAB, dtype=torch.float32)
    params = TreeParams(width=2, max_depth=3)
    docs = DOCS[:4]

    def reused(cached: int) -> list[int]:
        pool = KVPool(model, slots=1, max_len=WINDOW, prefix_caching=True, cached_slots=cached)
        for d in docs:
            first = Drafter(model, params, pool=pool)
            first.start([*d, 1, 2])
            first.grow()
            first.release()
        got = []
        for d in reversed(docs):
            second = Drafter(model, params, pool=pool)
            second.start([*d, 3, 4, 5])
            got.append(second.n_committed)
            second.release()
        return got

    assert all(n == len(d) // K * K for n, d in zip(reused(cached=4), reversed(docs), strict=True))
    assert reused(cached=0)[1:] == [0, 0, 0]


def test_a_shared_system_prompt_does_not_cost_another_conversation_its_turn() -> None:
    """Two conversations behind one system prompt on two slots: the second one's first turn finds
    the system prompt in the first one's free slot and copies those rows rather than taking that
    slot (which would drop the first conversation's blocks), so the first one's next turn still
    reuses its whole first turn; outputs equal caching off. (Before 2026-11-29 it took the slot:
    the next turn reused the system prompt alone.)"""
    model = _model(torch.float32)
    system = _tokens(40, seed=300)
    one, two = system + _tokens(120, seed=301), system + _tokens(90, seed=302)
    requests = [GenerationRequest(tuple(p), SamplingParams(), StopParams(max_new_tokens=8, ignore_eos=True))
                for p in (one, two, one + _tokens(20, seed=303))]
    cold = _in_turn(_engine(model, caching=False), requests)
    warm = _in_turn(_engine(model, caching=True, slots=2), requests)
    assert [g.result.token_ids for g in warm] == [g.result.token_ids for g in cold]
    assert warm[1].stats.cached_tokens == len(system) // K * K
    assert warm[2].stats.cached_tokens == len(one) // K * K
