"""Shared helpers for the engine tests: tiny models by name, plain reference forwards, runs.

Reference computations here deliberately avoid the engine's own KV code (``engine.kv``): a plain
forward is ``model(input_ids)`` over a fresh ``DynamicCache``, causal, so a bug in the engine's
tree masks, positions or KV surgery cannot hide in the reference.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from card.engine.draft.drafter import Drafter
from card.engine.draft.worker import DraftWorker
from card.engine.inprocess.runner import InProcessRunner
from card.engine.inprocess.sources import LocalCard, SyncDraft
from card.engine.shared.config import (
    ChainDraw,
    GenerationRequest,
    NgramConfig,
    SamplingParams,
    StopParams,
    TreeParams,
    VerifyPolicy,
)
from card.engine.shared.hf import CACHE_KEYWORD
from card.engine.shared.kv_pool import KVPool, Segment, forward
from card.engine.shared.ngram_stats import NgramTable
from card.engine.shared.session import CardSession, StepResult
from card.engine.shared.tree import Advance, Correction, Layer, TwoTierTree
from card.engine.target.chain_source import ChainSource, NoDraft
from card.engine.target.drafting_policy import DraftingPolicy
from card.engine.target.generation import Chunk, Generation, GenerationResult
from card.engine.target.scheduler import TargetEngine, run_alone
from tests.tiny_models import sharpened, tiny_model

VOCAB = 97
KINDS = ("llama", "qwen2")
DRAFTS = ("self", "unrelated", "perturbed")


def letters(ids: Sequence[int]) -> str:
    """One letter per token: a decode function that makes stop-string positions obvious."""
    return "".join(chr(97 + i % 26) for i in ids)


@functools.cache
def target_model(kind: str, sharp: bool = False) -> torch.nn.Module:
    model = tiny_model(kind, seed=0, vocab=VOCAB)
    return sharpened(model) if sharp else model


@functools.cache
def draft_model(kind: str, draft: str, sharp: bool = False) -> torch.nn.Module:
    """``self``: the target object itself; ``unrelated``: another seed; ``perturbed``: noise 0.02."""
    if draft == "self":
        return target_model(kind, sharp)
    if draft == "unrelated":
        model = tiny_model(kind, seed=1, vocab=VOCAB)
    elif draft == "perturbed":
        model = tiny_model(kind, seed=0, vocab=VOCAB, perturb=0.02)
    else:
        raise ValueError(draft)
    return sharpened(model) if sharp else model


def prompt_cases(n: int, seed: int, max_prompt: int = 30, max_new: int = 60) -> list[tuple[list[int], int]]:
    """``n`` (prompt, max_new_tokens) pairs: prompt lengths 1..max_prompt, budgets 1..max_new."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for _ in range(n):
        length = int(torch.randint(1, max_prompt + 1, (1,), generator=gen))
        budget = int(torch.randint(1, max_new + 1, (1,), generator=gen))
        cases.append((torch.randint(0, VOCAB, (length,), generator=gen).tolist(), budget))
    return cases


# ---- reference forwards --------------------------------------------------------------------------
@torch.inference_mode()
def plain_forward(model: torch.nn.Module, tokens: Sequence[int]) -> tuple[torch.Tensor, DynamicCache]:
    """Causal forward over ``tokens`` from scratch: (logits [T, V], the filled cache)."""
    cache = DynamicCache()
    out = model(input_ids=torch.tensor([list(tokens)]), use_cache=True, **{CACHE_KEYWORD: cache})
    return out.logits[0], cache


def path_tokens(tree: TwoTierTree, node_id: int) -> list[int]:
    """Tokens from the root (exclusive) down to ``node_id`` (inclusive)."""
    tokens: list[int] = []
    cur = node_id
    while cur != tree.root_id:
        (row,) = torch.nonzero(tree.ids == cur).flatten().tolist()
        tokens.append(int(tree.tokens[row]))
        cur = int(tree.parents[row])
    return tokens[::-1]


def path_nodes(tree: TwoTierTree, node_id: int) -> list[int]:
    """Node ids from the root (exclusive) down to ``node_id`` (inclusive)."""
    nodes: list[int] = []
    cur = node_id
    while cur != tree.root_id:
        nodes.append(cur)
        (row,) = torch.nonzero(tree.ids == cur).flatten().tolist()
        cur = int(tree.parents[row])
    return nodes[::-1]


def same_tree(a: TwoTierTree, b: TwoTierTree) -> None:
    """Assert two trees hold the same nodes (ids, parents, tokens, depths, scores), B and root."""
    assert a.epoch == b.epoch and a.root_id == b.root_id
    assert a.ids.tolist() == b.ids.tolist()
    assert a.parents.tolist() == b.parents.tolist()
    assert a.tokens.tolist() == b.tokens.tolist()
    assert a.depth.tolist() == b.depth.tolist()
    torch.testing.assert_close(a.path_logp, b.path_logp)
    a_b = sorted(zip(a.b_parents.tolist(), a.b_tokens.tolist(), a.b_logp.tolist(), strict=True))
    b_b = sorted(zip(b.b_parents.tolist(), b.b_tokens.tolist(), b.b_logp.tolist(), strict=True))
    assert a_b == b_b


# ---- runs ----------------------------------------------------------------------------------------
@dataclass
class Run:
    result: GenerationResult
    chunks: list[Chunk]

    @property
    def tokens(self) -> list[int]:
        return self.result.token_ids


def generate(model: torch.nn.Module, source: ChainSource, prompt: Sequence[int], *,
             max_new_tokens: int, sampling: SamplingParams | None = None,
             stop: Sequence[str] = (), eos_ids: frozenset[int] = frozenset(), ignore_eos: bool = True,
             decode: Callable[[list[int]], str] = letters, context_window: int = 512,
             adaptive: bool = False, verify: VerifyPolicy | None = None, logprobs: int | None = None,
             policy: DraftingPolicy | None = None) -> Run:
    """Run one generation alone. Chains are verified whole unless ``adaptive`` (the engine's
    measured-cost cut reads the clock, so forward counts would follow the machine's load);
    ``policy``: the engine's drafting policy (default: its own)."""
    request = GenerationRequest(
        tuple(prompt),
        sampling or SamplingParams(),
        StopParams(max_new_tokens=max_new_tokens, stop=tuple(stop), ignore_eos=ignore_eos),
        verify=verify or VerifyPolicy(),
        logprobs=logprobs,
    )
    gen = Generation(request, source, eos_ids=eos_ids, decode=decode, context_window=context_window,
                     mode="test", vocab_size=model.config.vocab_size)
    chunks = list(run_alone(model, gen, adaptive, policy=policy))
    assert gen.result is not None
    # what was streamed is exactly the result, whatever the mode
    assert [t for c in chunks for t in c.token_ids] == gen.result.token_ids
    assert "".join(c.text for c in chunks) == gen.result.text
    assert [lp for c in chunks for lp in c.logprobs] == gen.result.logprobs
    return Run(gen.result, chunks)


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class LockstepCard(LocalCard):
    """LocalCard whose every step waits until the tree is ``depth`` deep below the root (at most
    ``timeout_s``): the paper's draft-R-layers-then-exchange rhythm. Tests use it to drive hits
    and re-roots deterministically; serving never waits for the draft."""

    def __init__(self, *args: object, depth: int, timeout_s: float = 60.0, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.depth = min(depth, self.params.max_depth)
        self.timeout_s = timeout_s

    def step(self, correction: Correction) -> StepResult:
        result = super().step(correction)
        session = self.session
        if session.link is None:  # paused: the chain is empty on purpose
            return result
        with session.lock:
            session.lock.wait_for(lambda: session.tree.sizes().depth >= self.depth, self.timeout_s)
            return StepResult(session.next_chain(), result.outcome)


class LockstepRunner(InProcessRunner):
    """InProcessRunner whose card mode runs LockstepCard (``depth`` 0: the plain LocalCard)."""

    def __init__(self, *args: object, lockstep_depth: int, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.lockstep_depth = lockstep_depth

    def _new_card(self, worker: DraftWorker, draw: ChainDraw | None) -> LocalCard:
        if not self.lockstep_depth:
            return super()._new_card(worker, draw)
        cfg = self.config
        return LockstepCard(worker, cfg.tree, cfg.cache_device, lender=self._lender(worker),
                            depth=self.lockstep_depth, draw=draw)


class RecordingDrafter(Drafter):
    """A Drafter that keeps (node ids [F], logits [F, V]) of its latest forward: the expanded
    nodes' ids (the root's after a root forward) and their logits, a reference, no copy
    (``recorded``: every such pair since the last ``clear_recorded``, a cascade's several)."""

    last_logits: tuple[torch.Tensor, torch.Tensor] | None = None

    def clear_recorded(self) -> None:
        self.recorded: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _top_children(self, logits: torch.Tensor, parent_ids: torch.Tensor,
                      parent_path: torch.Tensor) -> Layer:
        self.last_logits = (parent_ids, logits)
        if not hasattr(self, "recorded"):
            self.clear_recorded()
        self.recorded.append(self.last_logits)
        return super()._top_children(logits, parent_ids, parent_path)


@contextlib.contextmanager
def card_source(draft: torch.nn.Module | None, params: TreeParams, lockstep_depth: int = 0,
                ngram: NgramConfig | None = None, table: NgramTable | None = None,
                draw: ChainDraw | None = None) -> Iterator[LocalCard]:
    """A LocalCard (a LockstepCard when ``lockstep_depth``) wired to its own running DraftWorker
    (model-free with ``draft=None``, a cascade with a draft and ``ngram``); on exit the worker must
    hold nothing."""
    card = (LockstepCard(None, params, depth=lockstep_depth, draw=draw) if lockstep_depth
            else LocalCard(None, params, draw=draw))
    worker = DraftWorker(draft, params, card.publish, slots=8, max_len=512, name="test",
                         ngram_config=ngram, ngram=table, vocab_size=VOCAB)
    card.worker = worker
    worker.start()
    try:
        yield card
        assert wait_until(lambda: worker.active_sessions == 0), "draft sessions leaked"
        assert worker.kv_slots_held() == 0
    finally:
        worker.close()


def source_for(mode: str, draft: torch.nn.Module | None = None, *, gamma: int = 4) -> ChainSource:
    if mode == "vanilla":
        return NoDraft()
    if mode == "sd":
        assert draft is not None
        return SyncDraft(draft, gamma)
    raise ValueError(mode)


# ---- a drafter driven by hand, with the cache's view beside it ------------------------------------
class _DrafterLink:
    """A DraftSession's draft: what the CardSession sends goes straight to the drafter; the
    latest Advance is kept for the test to look at."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.last: Advance | None = None

    def start(self, committed: Sequence[int], epoch: int, draw: ChainDraw | None = None) -> None:
        self.drafter.start(committed, epoch, draw)

    def advance(self, advance: Advance) -> None:
        self.last = advance
        self.drafter.advance(advance)

    def stop(self) -> None:
        self.drafter.release()


class DraftSession:
    """A Drafter and the CardSession the cache would hold for it (``mirror`` is its tree).

    Layers go to the session as the drafter makes them (or later: ``grow(deliver=False)`` keeps a
    layer in flight until ``deliver()``); corrections go through the session, as in the cache
    service, and its Advance reaches the drafter.
    """

    def __init__(self, model: torch.nn.Module, params: TreeParams, prompt: Sequence[int],
                 seed: int = 0, ngram: NgramConfig | None = None) -> None:
        self.model = model
        self.drafter = RecordingDrafter(model, params, ngram_config=ngram)
        self.session = CardSession(params)
        self.link = _DrafterLink(self.drafter)
        self.in_flight: list = []
        self.rng = torch.Generator().manual_seed(seed)
        self.session.open(prompt)
        self.session.attach(self.link)

    @property
    def mirror(self) -> TwoTierTree:
        return self.session.tree

    @property
    def committed(self) -> list[int]:
        return self.session.committed

    # growing
    def grow(self, deliver: bool = True):
        """One forward's layers (a cascade: a list, possibly several; else the layer), or None."""
        self.drafter.clear_recorded()
        layers = self.drafter.grow()
        if layers:
            self.in_flight.extend(layers)  # a stream: layers reach the cache in order
            if deliver:
                self.deliver()
        if self.drafter.ngram_config is not None:
            return layers
        return layers[0] if layers else None

    def deliver(self) -> None:
        for layer in self.in_flight:
            self.session.apply_layer(layer)
        self.in_flight = []

    # correcting
    def correct(self, accepted_nodes: Sequence[int], next_token: int) -> Advance:
        tree = self.mirror
        rows = [int(torch.nonzero(tree.ids == n).flatten()[0]) for n in accepted_nodes]
        tokens = tuple(int(tree.tokens[r]) for r in rows)
        self.session.step(Correction(tree.epoch, tokens, tuple(accepted_nodes), next_token))
        assert self.link.last is not None
        return self.link.last

    def random_node(self, min_depth: int = 1) -> int | None:
        ids = self.mirror.ids[self.mirror.depth >= min_depth]
        if not ids.numel():
            return None
        return int(ids[int(torch.randint(ids.numel(), (1,), generator=self.rng))])

    def hit(self, node_id: int):
        """Correction whose next token is ``node_id``'s token, below its accepted ancestors."""
        path = path_nodes(self.mirror, node_id)
        (row,) = torch.nonzero(self.mirror.ids == node_id).flatten().tolist()
        return self.correct(path[:-1], int(self.mirror.tokens[row]))

    def children_tokens(self, anchor: int) -> tuple[set[int], set[int]]:
        tree = self.mirror
        c = set(tree.tokens[tree.parents == anchor].tolist())
        b = set(tree.b_tokens[tree.b_parents == anchor].tolist())
        return c, b

    def miss(self, anchor: int | None = None):
        """Accept the path to ``anchor`` (root when None), then a token that is no child of it."""
        anchor = self.mirror.root_id if anchor is None else anchor
        path = [] if anchor == self.mirror.root_id else path_nodes(self.mirror, anchor)
        c, b = self.children_tokens(anchor)
        token = next(t for t in range(VOCAB) if t not in c | b)
        return self.correct(path, token)

    def secondary(self) -> object | None:
        """Accept a path to a node with B-only children and take one of them; None if none."""
        tree = self.mirror
        for anchor in [tree.root_id, *tree.ids.tolist()]:
            c, b = self.children_tokens(anchor)
            if b - c:
                path = [] if anchor == tree.root_id else path_nodes(tree, anchor)
                return self.correct(path, min(b - c))
        return None

    # checking
    def expanded_ids(self) -> set[int]:
        return set(self.drafter.tree.ids[self.drafter.kv_slot >= 0].tolist())

    def check_last_logits(self) -> int:
        """Each node of the latest forward got the logits of a plain forward over committed + its
        path; returns how many nodes were checked."""
        assert self.drafter.last_logits is not None
        tree = self.drafter.tree
        checked = 0
        for node_ids, logits in self.drafter.recorded:
            for nid, row in zip(node_ids.tolist(), logits, strict=True):
                path = [] if nid == tree.root_id else path_tokens(tree, nid)
                ref, _ = plain_forward(self.model, self.committed + path)
                torch.testing.assert_close(row, ref[-1], rtol=0, atol=1e-9,
                                           msg=lambda m, nid=nid: f"node {nid}: {m}")
                checked += 1
        return checked

    def check_kv(self) -> None:
        """The drafter's KV cache holds exactly committed (forwarded part) + its expanded nodes,
        each slot equal to a fresh causal forward over committed + that node's path."""
        d = self.drafter
        n = d.n_committed
        assert self.committed[:n] + d.pending == self.committed
        slots = d.kv_slot[d.kv_slot >= 0]
        assert sorted(slots.tolist()) == list(range(slots.numel()))
        assert d.kv_length() == n + slots.numel()
        if n == 0:
            return
        # the session's rows of the pool: [kv_heads, rows, head_dim] per layer
        keys = [k[d.slot] for k in d.pool.keys]
        values = [v[d.slot] for v in d.pool.values]
        _, ref = plain_forward(self.model, self.committed[:n])
        for k, v, want in zip(keys, values, ref.layers, strict=True):
            torch.testing.assert_close(k[:, :n], want.keys[0], rtol=0, atol=1e-9)
            torch.testing.assert_close(v[:, :n], want.values[0], rtol=0, atol=1e-9)
        tree = d.tree
        for row in torch.nonzero(d.kv_slot >= 0).flatten().tolist():
            slot = n + int(d.kv_slot[row])
            _, ref = plain_forward(self.model, self.committed[:n] + path_tokens(tree, int(tree.ids[row])))
            for k, v, want in zip(keys, values, ref.layers, strict=True):
                torch.testing.assert_close(k[:, slot], want.keys[0, :, -1], rtol=0, atol=1e-9)
                torch.testing.assert_close(v[:, slot], want.values[0, :, -1], rtol=0, atol=1e-9)


# ---- helpers several test files share --------------------------------------------------------
class LetterTokenizer:
    """A tokenizer whose decode is ``letters``: what LoadedModel needs around a tiny model."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return letters(ids)


def run_batched(engine: TargetEngine, gens: list[Generation], join_every: int) -> dict[int, list[int]]:
    """Add a generation every ``join_every`` iterations; run until every one has ended."""
    tokens: dict[int, list[int]] = {i: [] for i in range(len(gens))}
    index = {id(g): i for i, g in enumerate(gens)}
    pending, steps, sizes = list(gens), 0, []
    while pending or not engine.idle:
        if pending and steps % join_every == 0:
            engine.add(pending.pop(0))
        for event in engine.step():
            assert event.error is None, event.error
            if event.chunk is not None:
                tokens[index[id(event.generation)]] += list(event.chunk.token_ids)
        sizes.append(len(engine.running))
        steps += 1
    assert max(sizes) > 1, "nothing ran beside anything"
    return tokens


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    n = float(counts.sum())
    support = probs > 0
    expected = probs[support] * n
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1


def assert_fits(counts: torch.Tensor, probs: torch.Tensor) -> None:
    assert int(counts[probs == 0].sum()) == 0, "a token outside top-k / top-p was drawn"
    stat, df = chi_square(counts, probs)
    # mean df, sd sqrt(2 df): 6 sd above the mean is far out for a right sampler (p < 1e-6)
    # and far below what a wrong temperature, truncation or off-by-one gives (stat in the 100s+)
    assert stat < df + 6 * math.sqrt(2 * df) + 6, f"chi-square {stat:.1f} with {df} degrees of freedom"


def chain_logits_equal_steps(model: torch.nn.Module, exact: bool, sessions: int = 2) -> bool:
    """Prefill a prompt, then forward a chain of 6 tokens in one segment beside ``sessions - 1``
    other sessions' chains; compare each row's logits with plain one-token steps in a pool of its
    own."""
    prompt = list(range(3, 3 + 90))
    chain = [7, 11, 13, 17, 19, 23]
    rows = torch.arange(len(chain))

    def prefill(pool: KVPool, slot: int) -> None:
        forward(model, pool, [Segment(slot, 0, len(prompt) - 1)], torch.tensor(prompt[:-1]),
                torch.empty(0, dtype=torch.int64))

    start = len(prompt) - 1
    batch_pool = KVPool(model, slots=sessions, max_len=256)
    for slot in range(sessions):
        prefill(batch_pool, slot)
    tokens = torch.tensor([prompt[-1], *chain[:-1]] * sessions)
    segments = [Segment(slot, start, 6, exact=exact) for slot in range(sessions)]
    together = forward(model, batch_pool, segments, tokens, torch.arange(6 * sessions))
    step_pool = KVPool(model, slots=1, max_len=256)
    prefill(step_pool, 0)
    ok = True
    for i, token in enumerate([prompt[-1], *chain[:-1]]):
        alone = forward(model, step_pool, [Segment(0, start + i, 1, exact=exact)], torch.tensor([token]),
                        torch.tensor([0]))
        ok &= all(torch.equal(together[6 * slot + rows[i]], alone[0]) for slot in range(sessions))
    return ok
