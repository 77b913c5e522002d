"""The drafter: grows one session's candidate tree one layer of K nodes per forward, never waiting.

State, for one session, in one slot of a KV pool (card.engine.shared.kv_pool.KVPool) shared with every other
session of its worker:
    KV rows   = committed tokens the drafter has forwarded (``n_committed``), then one row per
                *expanded* tree node (a node whose own forward has run), in expansion order.
    pending   = committed tokens not yet forwarded (the prompt at start, the unseen tail after a
                miss); they are forwarded, in chunks of PREFILL_CHUNK, before any tree work.
    frontier  = primary nodes not yet expanded; always the newest layer below the root.
    ancestors = ``anc[i, j]``: tree row j is row i or one of its ancestors (the tree mask rows).

A round is split in two so that a worker can run every session's round in one forward:
``plan()`` says what this session needs next: a ``DraftWork`` (a prefill chunk, or the frontier's
K nodes with their tree mask), a ``Layer`` grown without a forward (a regrow from tier B), or None
(the tree is at ``max_depth``, or the slot is full); ``finish(work, logits)`` turns the forward's
logits into the next layer. ``grow_round`` is that round for any number of sessions in one
forward (the worker's round; ``Drafter.grow`` runs it for one session alone).
``advance()`` applies the cache's verdict on a correction: on a hit it moves the surviving rows
(committed + accepted path + surviving subtree) to the front of the slot, on a miss it keeps what
the committed text already covers.

Cascade (CS Drafting's vertical cascade, ``ngram_config`` given): the n-gram statistics
(card.engine.draft.ngram.Proposer) draft for the draft. Each expansion forward also carries, below every
frontier node, the n-gram's likeliest continuation of it (``lookahead`` tokens, tree-masked like
any node). Where the draft's own top children of a node include the continuation's next token,
that child is expanded already (its row was in the forward): its children are published at once,
and so on down the continuation. One forward then grows the tree several layers deep where the
n-gram is right; where it has nothing, the forward is the plain one. Rows of a continuation the
draft did not take are dropped (``KVPool.keep`` closes the gap). The frontier is then every
unexpanded node of depth < max_depth, the K best by path score expanded first.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from card.engine.draft.ngram import NgramDrafter
from card.engine.draft.static_tree import TreeStep
from card.engine.shared.config import DRAW_BRANCH, ChainDraw, NgramConfig, TreeParams
from card.engine.shared.errors import Aborted, InvalidArgument, ResourceExhausted
from card.engine.shared.hf import CausalLM
from card.engine.shared.kv_pool import PREFILL_CHUNK, KVPool, Segment, forward
from card.engine.shared.ngram_stats import NgramTable, Proposer
from card.engine.shared.prefix_cache import PREFIX_BLOCK
from card.engine.shared.tree import NO_NODE, Advance, Layer, TwoTierTree, draw_index, tier_b_probs

log = logging.getLogger(__name__)
_CPU = torch.device("cpu")
NOT_EXPANDED = -1  # kv_slot of a node whose own forward has not run
ADOPTED = -2  # kv_slot of a cascade node expanded by an n-gram row, until the rows are compacted


@dataclass(eq=False)
class DraftWork:
    """One session's part of a draft forward.

    segment:    where its tokens go in the pool (tree nodes carry positions and a tree mask).
    tokens:     [n] the tokens to forward.
    logit_rows: [r] rows of ``tokens`` whose logits ``finish`` needs.
    frontier:   [F] tree rows being expanded; None for a prefill chunk.
    lookahead:  cascade: per frontier node, the n-gram continuation whose rows follow the
                frontier's in ``tokens`` (in frontier order).
    """

    segment: Segment
    tokens: torch.Tensor
    logit_rows: torch.Tensor
    frontier: torch.Tensor | None = None
    lookahead: list[list[int]] | None = None


def tree_rows(params: TreeParams) -> int:
    """KV rows a session's tree can hold beyond its committed text: K expanded nodes per layer."""
    return params.width * params.max_depth


class Drafter:
    """One session of a draft model. ``pool`` is the worker's (one slot is taken at ``start``
    and given back at ``release``); without one the drafter owns a pool of one slot of
    ``max_len`` committed tokens plus its tree (classic sd, tests)."""

    def __init__(self, model: CausalLM, params: TreeParams, pool: KVPool | None = None,
                 max_len: int | None = None, ngram_config: NgramConfig | None = None,
                 ngram: NgramTable | None = None) -> None:
        self.model = model
        self.params = params
        if pool is None:
            rows = (max_len or model.config.max_position_embeddings) + tree_rows(params)
            pool = KVPool(model, slots=1, max_len=rows)
        self.pool = pool
        self.vocab = model.get_input_embeddings().num_embeddings
        self.slot: int | None = None
        self.forwards = 0
        self.tree = TwoTierTree(_CPU)
        self.n_committed = 0
        self.pending: list[int] = []
        self.text: list[int] = []  # the committed text: rows [0, n_committed) hold its keys and values
        # [N] per tree row: its KV row after the committed ones, NOT_EXPANDED, or (inside finish) ADOPTED
        self.kv_slot = torch.empty(0, dtype=torch.int64)
        self.anc = torch.zeros(0, 0, dtype=torch.bool)  # [T, T]
        self.next_id = 0
        self.ngram_config = ngram_config  # cascade when set
        self.ngram = ngram
        self.proposer: Proposer | None = None
        self.adopted = 0  # cascade: nodes expanded by an n-gram continuation's row (no forward of their own)
        self.draw: ChainDraw | None = None  # a rejection session's (start)
        self._rng: random.Random | None = None

    # ---- session lifecycle -------------------------------------------------------------------
    def start(self, committed: Sequence[int], epoch: int = 0, draw: ChainDraw | None = None) -> None:
        """(Re)start from the committed text at ``epoch`` with an empty tree, in a slot of the pool.
        ``draw`` (a rejection session): tier B holds at least DRAW_BRANCH children per node, and
        every node expanded gets one child drawn from its tier B at the draw's temperature
        (tree.tier_b_probs), kept in tier C whatever its score and marked drawn, so the cache's
        drawn chain goes on below it. The generator is the
        drafter's own, never the target's (the rule needs the draws independent of its coins)."""
        self._check_tokens(committed)
        self._check_room(len(committed))
        cached = 0  # committed tokens whose keys and values the slot holds already (prefix caching)
        if self.slot is None:
            # The draft's prompt rows (SDPA) are the bits a cold prefill gives only at its chunk
            # boundaries. A drawn session's chains are drawn from the draft's distributions, so
            # its output depends on those bits: it reuses whole prefill chunks only, and its tree
            # never depends on what was cached. Any other session's draft numbers only choose
            # what the target verifies (never what it emits): it reuses every whole block, as the
            # target does, so a chat's system prompt and a conversation's earlier turns are not
            # prefilled again (whole 256-token chunks left a 200-token conversation nothing), nor
            # the rows an earlier session grew for its answer (loose blocks, ``release``)
            got = (self.pool.acquire_prefix(committed, PREFILL_CHUNK) if draw is not None
                   else self.pool.acquire_prefix(committed, PREFIX_BLOCK, exact_only=False))
            if got is None:
                raise ResourceExhausted(f"the draft's KV cache has no free slot (all {self.pool.slots} held)")
            self.slot, cached = got
        self.tree.reset(epoch)
        self.draw = draw
        self._rng = random.Random(f"card-draft-draw:{draw.seed}:{epoch}") if draw is not None else None
        self.n_committed = cached
        self.pending = list(committed[cached:])
        self.text = list(committed)
        self.kv_slot = torch.empty(0, dtype=torch.int64)
        self.anc = torch.zeros(0, 0, dtype=torch.bool)
        if self.ngram_config is not None:
            self.proposer = Proposer(self.vocab, self.ngram_config, self.ngram)
            self.proposer.extend(committed)

    def release(self) -> None:
        """Give the slot back and drop the tree (session ended). The rows of the text it followed
        stay indexed, the ones it grew as tree nodes included (a conversation's answer: the next
        turn's draft then prefills only the new message), as loose blocks: a tree row's numbers
        are not a prefill's, and only sessions whose draft numbers never reach an output take
        them. A drawn session's rows past its prefill are not indexed (its tree must be a cold
        drafter's, whatever ran before)."""
        if self.slot is not None:
            if self.draw is None:
                self.pool.settled(self.slot, self.text[:self.n_committed], exact=False)
            self.pool.release(self.slot)
            self.slot = None
        self.tree.reset(self.tree.epoch)
        self.pending = []
        self.text = []
        self.n_committed = 0
        self.kv_slot = torch.empty(0, dtype=torch.int64)
        self.anc = torch.zeros(0, 0, dtype=torch.bool)

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        # one bad id would fail the whole worker's forward (an embedding IndexError): refuse it here
        if tokens and not (min(tokens) >= 0 and max(tokens) < self.vocab):
            raise InvalidArgument(f"a token id is outside the draft's vocabulary [0, {self.vocab})")

    def _check_room(self, committed: int) -> None:
        if committed + tree_rows(self.params) > self.pool.max_len:
            raise ResourceExhausted(
                f"the session needs {committed} committed rows, the draft's KV slots hold "
                f"{self.pool.max_len - tree_rows(self.params)} (card-draft --max-model-len)")

    @property
    def epoch(self) -> int:
        return self.tree.epoch

    @property
    def n_tree_slots(self) -> int:
        return int(self.anc.shape[0])

    def kv_length(self) -> int:
        """KV rows this session holds now (committed + expanded tree nodes)."""
        return self.n_committed + self.n_tree_slots if self.slot is not None else 0

    # ---- growing -----------------------------------------------------------------------------
    def plan(self) -> DraftWork | Layer | None:
        """What this session needs next (see the module docstring); None: nothing until the
        next correction."""
        if self.slot is None:
            return None
        if self.pending:
            return self._plan_chunk()
        unexpanded = torch.nonzero(self.kv_slot < 0).flatten()
        if unexpanded.numel():
            frontier = unexpanded[self.tree.depth[unexpanded] < self.params.max_depth]
            if not frontier.numel():
                return None
            if frontier.numel() > self.params.width:  # cascade: best first (else <= K are open)
                best = torch.topk(self.tree.path_logp[frontier], self.params.width).indices
                frontier, _ = torch.sort(frontier[best])
            if self.n_committed + self.n_tree_slots + frontier.numel() > self.pool.max_len:
                return None  # the slot is full: the tree stays as deep as it is
            return self._plan_expand(frontier)
        return self._regrow()

    def finish(self, work: DraftWork, logits: torch.Tensor) -> list[Layer]:
        """Apply the forward's ``logits`` [r, V] (rows ``work.logit_rows``); the new layers, in
        the order they are to be published: none after a prefill chunk that is not the prompt's
        last, one, or (cascade) several."""
        self.forwards += 1
        if work.frontier is None:
            assert self.slot is not None
            # reusable rows; a cold prefill's bits (exact, what a drawn session may reuse) only
            # where the chunk is one a cold prefill of any longer text computes too: a whole
            # PREFILL_CHUNK at a chunk boundary (the vendor attention's bits follow the chunking)
            start, n = work.segment.start, work.tokens.numel()
            self.pool.computed(self.slot, start, work.tokens.tolist(),
                               exact=start % PREFILL_CHUNK == 0 and n == PREFILL_CHUNK)
            self.n_committed += work.tokens.numel()
            del self.pending[: work.tokens.numel()]
            if self.pending:
                return []
            root = torch.tensor([self.tree.root_id], dtype=torch.int64)
            return [self._top_children(logits[-1:], root, torch.zeros(1))]
        frontier, t, f = work.frontier, self.n_tree_slots, work.frontier.numel()
        assert work.segment.visible is not None  # an expansion's segment always carries its tree mask
        visible = work.segment.visible[:f, self.n_committed:self.n_committed + t + f].cpu()  # [F, T+F]
        self._add_rows(visible)
        self.kv_slot[frontier] = torch.arange(t, t + f)
        tree = self.tree
        layer = self._top_children(logits[:f], tree.ids[frontier], tree.path_logp[frontier])
        if work.lookahead is not None:
            return [layer, *self._adopt(work, logits, layer)]
        return [layer]

    def _add_rows(self, visible: torch.Tensor) -> None:
        """Append expanded rows whose tree-part visibility is ``visible`` [n, T+n]."""
        t, n = self.n_tree_slots, visible.shape[0]
        anc = torch.zeros(t + n, t + n, dtype=torch.bool)
        anc[:t, :t] = self.anc
        anc[t:] = visible
        self.anc = anc

    def _adopt(self, work: DraftWork, logits: torch.Tensor, layer: Layer) -> list[Layer]:
        """Cascade: walk each n-gram continuation down the layers the draft grows from it; a
        continuation token the draft put in tier C is an expanded node (its row was forwarded),
        whose children are published now. The rows not taken are dropped from the slot."""
        # only an expansion with continuations gets here: it has a frontier, lookahead, a tree mask
        assert work.frontier is not None and work.lookahead is not None and work.segment.visible is not None
        assert self.slot is not None
        f, c = work.frontier.numel(), self.n_committed
        t0 = self.n_tree_slots - f  # tree rows before this forward
        tree = self.tree
        taken: list[int] = []  # rows of the forward (beyond the frontier's) adopted, in order
        taken_nodes: list[int] = []
        layers: list[Layer] = []
        row = f
        for i, cont in enumerate(work.lookahead):
            parent = int(tree.ids[work.frontier[i]])
            grown = layer
            for j, token in enumerate(cont):
                hit = torch.nonzero((grown.parent_ids == parent) & (grown.tokens == token)).flatten()
                if not hit.numel():
                    break
                node = int(grown.node_ids[hit[0]])
                r = int(tree.rows_of(torch.tensor([node]))[0]) - 1
                taken.append(row + j)
                taken_nodes.append(r)
                self.kv_slot[r] = ADOPTED  # expanded; its KV row is set once the rows are compacted
                grown = self._top_children(logits[row + j:row + j + 1], tree.ids[r:r + 1],
                                           tree.path_logp[r:r + 1])
                self.adopted += 1
                layers.append(grown)
                parent = node
            row += len(cont)
        if not taken:
            return layers
        # the adopted rows' KV moves right after the frontier's; their tree-part visibility too
        rows = torch.tensor(taken, dtype=torch.int64)
        self.pool.keep(self.slot, c + t0 + f, c + t0 + rows)
        seg_visible = work.segment.visible[rows].cpu()  # [a, c + T0 + F + S]
        tree_cols = torch.cat([torch.arange(c, c + t0 + f), c + t0 + rows])
        self._add_rows(seg_visible[:, tree_cols])
        nodes = torch.tensor(taken_nodes, dtype=torch.int64)
        self.kv_slot[nodes] = torch.arange(t0 + f, t0 + f + rows.numel())
        return layers

    def grow(self) -> list[Layer] | None:
        """Grow with forwards of this session's own (classic sd, tests) until one publishes: the
        new layers (a cascade's forward can grow several), or None when nothing can grow until
        the next correction."""
        while True:
            (grown,) = grow_round(self.model, self.pool, [self])
            if grown.error is not None:
                raise grown.error
            if grown.layers or grown.idle:
                return grown.layers or None

    def _new_ids(self, n: int) -> torch.Tensor:
        ids = torch.arange(self.next_id, self.next_id + n, dtype=torch.int64)
        self.next_id += n
        return ids

    def _publish(self, parents: torch.Tensor, tokens: torch.Tensor, local: torch.Tensor,
                 b_parents: torch.Tensor, b_tokens: torch.Tensor, b_logp: torch.Tensor,
                 drawn: torch.Tensor | None = None) -> Layer:
        layer = Layer(parents, self._new_ids(parents.numel()), tokens, local,
                      b_parents, b_tokens, b_logp, epoch=self.tree.epoch, drawn=drawn)
        self.tree.apply_layer(layer)
        self.kv_slot = torch.cat([self.kv_slot, torch.full((layer.size,), NOT_EXPANDED, dtype=torch.int64)])
        return layer

    def _top_children(self, logits: torch.Tensor, parent_ids: torch.Tensor,
                      parent_path: torch.Tensor) -> Layer:
        """Tier B = top-k children of each expanded node; tier C = global top-K by path score
        (with ``draw``: each expanded node's drawn child first, then the best others).

        logits: [F, V] for the F expanded nodes; parent_ids, parent_path: [F].
        """
        k, width = self.params.k, self.params.width
        if self.draw is not None:  # tier B is the support of the draws' q: wide enough to hold p
            k = max(k, DRAW_BRANCH)
        logp = torch.log_softmax(logits.float(), dim=-1).cpu()  # [F, V]
        local, toks = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)  # [F, k]
        path = parent_path[:, None] + local  # [F, k]
        b_parents = parent_ids[:, None].expand_as(toks).reshape(-1)
        score = path.reshape(-1)
        forced = self._draws(local)
        if forced is not None:  # F <= K (the frontier is at most K nodes): every draw fits
            score = score.clone().index_fill_(0, forced, float("inf"))
        _, best = torch.topk(score, min(width, path.numel()))  # [K]
        best, _ = torch.sort(best)  # stable order: by parent, then by child rank
        drawn = torch.isin(best, forced) if forced is not None else None
        return self._publish(b_parents[best], toks.reshape(-1)[best], local.reshape(-1)[best],
                             b_parents, toks.reshape(-1), local.reshape(-1), drawn)

    def _draws(self, local: torch.Tensor) -> torch.Tensor | None:
        """With ``draw``: per expanded node, the flat index into its [F, k] children of the child
        drawn from tier_b_probs of its row of ``local`` [F, k]; else None."""
        if self.draw is None or self._rng is None:
            return None
        k, rng = local.shape[1], self._rng
        picks = [i * k + draw_index(tier_b_probs(row, self.draw.temperature), rng.random())
                 for i, row in enumerate(local.tolist())]
        return torch.tensor(picks, dtype=torch.int64)

    def _plan_chunk(self) -> DraftWork:
        if self.n_tree_slots:  # pending tokens come only with an empty tree (advance keeps that)
            raise Aborted("drafter has pending tokens and tree rows at once")
        n = min(len(self.pending), PREFILL_CHUNK)
        self._check_room(self.n_committed + len(self.pending))
        tokens = torch.tensor(self.pending[:n], dtype=torch.int64)
        rows = torch.tensor([n - 1] if n == len(self.pending) else [], dtype=torch.int64)
        assert self.slot is not None  # planned only for a session that holds its slot (``plan``)
        return DraftWork(Segment(self.slot, self.n_committed, n), tokens, rows)  # causal

    def _plan_expand(self, frontier: torch.Tensor) -> DraftWork:
        tree = self.tree
        f, t, c = frontier.numel(), self.n_tree_slots, self.n_committed
        prow, _ = tree.rows_of(tree.parents[frontier])  # 0 = root
        parent_slot = torch.where(prow > 0, self.kv_slot[(prow - 1).clamp(min=0)], -1)
        ahead = self._lookahead(frontier, self.pool.max_len - (c + t + f))
        s = sum(len(a) for a in ahead)
        n = f + s
        visible = torch.zeros(n, c + t + n, dtype=torch.bool)  # [F + S, committed + T + F + S]
        visible[:, :c] = True
        has_parent = parent_slot >= 0
        if t and bool(has_parent.any()):
            visible[:f][has_parent, c:c + t] = self.anc[parent_slot[has_parent]]
        visible[:f, c + t:c + t + f] = torch.eye(f, dtype=torch.bool)
        depth = tree.depth[frontier]
        positions = [c - 1 + depth]
        tokens = [tree.tokens[frontier]]
        row = f
        for i, cont in enumerate(ahead):  # continuation rows see their node's view, then their own chain
            if not cont:
                continue
            g = len(cont)
            visible[row:row + g, :c + t + f] = visible[i, :c + t + f]
            visible[row:row + g, c + t + f + row - f:c + t + f + row - f + g] = torch.ones(
                g, g, dtype=torch.bool).tril()
            positions.append(c - 1 + depth[i] + torch.arange(1, g + 1))
            tokens.append(torch.tensor(cont, dtype=torch.int64))
            row += g
        assert self.slot is not None  # planned only for a session that holds its slot (``plan``)
        segment = Segment(self.slot, c + t, n, positions=torch.cat(positions), visible=visible)
        return DraftWork(segment, torch.cat(tokens), torch.arange(n), frontier,
                         ahead if s else None)

    def _lookahead(self, frontier: torch.Tensor, room: int) -> list[list[int]]:
        """Cascade: the n-gram's continuation below each frontier node, within ``room`` KV rows."""
        if self.proposer is None or self.ngram_config is None or room <= 0:
            return []
        max_order, lookahead = self.ngram_config.max_order, self.ngram_config.lookahead
        tree = self.tree
        view = tree._host()
        index = {nid: i for i, nid in enumerate(view.ids)}
        depth_left = self.params.max_depth - tree.depth[frontier]
        ahead: list[list[int]] = []
        for r, left in zip(frontier.tolist(), depth_left.tolist(), strict=True):
            path: list[int] = []
            i: int | None = r
            while i is not None and len(path) < max_order:  # the node's tail
                path.append(view.tokens[i])
                i = index.get(view.parents[i])
            path.reverse()
            g = min(lookahead, left - 1, room)
            cont = self.proposer.chain(self.proposer.tail(path), g) if g > 0 else []
            room -= len(cont)
            ahead.append(cont)
        return ahead

    def _regrow(self) -> Layer | None:
        """Every node is expanded but the newest C layer was pruned: promote B children."""
        tree = self.tree
        deepest = int(tree.depth.max().item()) if len(tree) else 0
        if deepest >= self.params.max_depth or not tree.b_parents.numel():
            return None
        _, known_depth, known_path = tree._known()
        brow, present = tree.rows_of(tree.b_parents)
        cand = torch.nonzero(present & (known_depth[brow] == deepest)).flatten()
        if not cand.numel():
            return None
        path = known_path[brow[cand]] + tree.b_logp[cand]
        _, best = torch.topk(path, min(self.params.width, cand.numel()))
        pick, _ = torch.sort(cand[best])
        empty_i, empty_f = torch.empty(0, dtype=torch.int64), torch.empty(0)
        return self._publish(tree.b_parents[pick], tree.b_tokens[pick], tree.b_logp[pick],
                             empty_i, empty_i, empty_f)

    # ---- correcting --------------------------------------------------------------------------
    def advance(self, adv: Advance) -> None:
        if adv.epoch <= self.tree.epoch:
            return  # already applied (a command delivered twice)
        if adv.epoch != self.tree.epoch + 1:
            raise Aborted(f"drafter at epoch {self.tree.epoch} got advance to epoch {adv.epoch}")
        tree = self.tree
        path_slots: list[int] = []  # expanded prefix of the accepted path, then the hit node
        walk = list(adv.accepted_node_ids)
        if adv.hit_node_id is not None:
            walk.append(adv.hit_node_id)
        for nid in walk:
            if nid == NO_NODE:
                break
            row, present = tree.rows_of(torch.tensor([nid]))
            r = int(row.item()) - 1
            if not bool(present.item()) or r < 0 or int(self.kv_slot[r].item()) < 0:
                break
            path_slots.append(int(self.kv_slot[r].item()))
        new_tokens = [*adv.accepted_tokens, adv.next_token]
        self._check_tokens(new_tokens)
        if self.proposer is not None:
            self.proposer.extend(new_tokens)
        rows = tree.reroot(adv)
        self.text += new_tokens
        kept_slots = self.kv_slot[rows] if rows.numel() else torch.empty(0, dtype=torch.int64)
        desc_slots = kept_slots[kept_slots >= 0]
        moved = self.n_committed + torch.cat([torch.tensor(path_slots, dtype=torch.int64), desc_slots])
        if self.slot is not None:
            self.pool.keep(self.slot, self.n_committed, moved)  # committed rows stay where they are
        self.n_committed += len(path_slots)
        self.pending = self.pending + new_tokens[len(path_slots):]
        self.anc = self.anc[desc_slots][:, desc_slots]
        kept_slots = kept_slots.clone()
        kept_slots[kept_slots >= 0] = torch.arange(desc_slots.numel())
        self.kv_slot = kept_slots


@dataclass
class Grown:
    """One session's part of a round: the layers it published (in order), whether it had nothing
    to grow (``idle``), whether its work was in the forward, or the error that ends it."""

    layers: list[Layer] = field(default_factory=list)
    idle: bool = False
    forwarded: bool = False
    error: BaseException | None = None


def grow_round(model: CausalLM | None, pool: KVPool | None,
               drafters: Sequence[Drafter | NgramDrafter],
               on_forward: Callable[[int], None] = lambda sessions: None,
               step: TreeStep | None = None) -> list[Grown]:
    """plan -> one forward -> finish, for every session that can grow: the one place a draft
    round is run. A session whose plan, forward or finish fails gets its error and the others go
    on: should the shared forward fail, each work is retried alone so that only the sessions
    that fail alone drop. ``on_forward(sessions)`` after each forward that ran. ``step``: the
    tree rows go through the static tree step (card.engine.draft.static_tree; prefill chunks stay
    eager), which gives them the eager forward's bits."""
    out = [Grown() for _ in drafters]
    works: list[tuple[int, DraftWork]] = []
    for i, drafter in enumerate(drafters):
        try:
            plan = drafter.plan()
        except Exception as exc:
            out[i].error = exc
            continue
        if isinstance(plan, DraftWork):
            works.append((i, plan))
        elif isinstance(plan, Layer):  # regrown from tier B, or model-free: no forward
            out[i].layers.append(plan)
        else:
            out[i].idle = True
    if not works:
        return out
    assert model is not None and pool is not None
    logits_of = _forward(model, pool, [w for _, w in works], on_forward, step)
    for (i, work), logits in zip(works, logits_of, strict=True):
        if isinstance(logits, BaseException):
            out[i].error = logits
            continue
        out[i].forwarded = True
        try:
            out[i].layers.extend(drafters[i].finish(work, logits))  # type: ignore[union-attr]
        except Exception as exc:
            out[i].error = exc
    return out


def _forward(model: CausalLM, pool: KVPool, works: list[DraftWork], on_forward: Callable[[int], None],
             step: TreeStep | None = None) -> list[torch.Tensor | BaseException]:
    """One flattened forward over every work; each work's logits rows [r_i, V]. With ``step``,
    the expansions' tree rows run on it and the prefill chunks on the eager forward."""
    if step is not None:
        trees = [i for i, w in enumerate(works) if w.frontier is not None]
        if trees and step.fits([works[i].segment for i in trees]):
            return _forward_static(model, pool, works, trees, on_forward, step)
    tokens = torch.cat([w.tokens for w in works])  # [sum n_i]
    offsets = [0]
    for w in works:
        offsets.append(offsets[-1] + w.tokens.numel())
    rows = torch.cat([o + w.logit_rows for o, w in zip(offsets, works, strict=False)])
    try:
        logits = forward(model, pool, [w.segment for w in works], tokens, rows)
    except Exception as exc:
        if len(works) == 1:
            log.exception("draft forward failed")
            return [exc]
        return [_forward(model, pool, [w], on_forward)[0] for w in works]
    on_forward(len(works))
    out: list[torch.Tensor | BaseException] = []
    r = 0
    for w in works:
        n = w.logit_rows.numel()
        out.append(logits[r:r + n])
        r += n
    return out


def _forward_static(model: CausalLM, pool: KVPool, works: list[DraftWork], trees: list[int],
                    on_forward: Callable[[int], None], step: TreeStep) -> list[torch.Tensor | BaseException]:
    """``_forward`` with the expansions ``trees`` (indices into ``works``) on the static tree
    step: every row's logits (an expansion needs them all), then each work's ``logit_rows``."""
    out: list[torch.Tensor | BaseException] = [torch.empty(0)] * len(works)
    chunks = [i for i in range(len(works)) if i not in set(trees)]
    if chunks:
        for i, got in zip(chunks, _forward(model, pool, [works[i] for i in chunks], on_forward), strict=True):
            out[i] = got
    tree_works = [works[i] for i in trees]
    try:
        logits = step.run([w.segment for w in tree_works], torch.cat([w.tokens for w in tree_works]))
    except Exception as exc:  # e.g. a capture that fails: the eager forward serves from now on
        log.exception("draft step: eager from now on; the %s static tree step failed", step.mode)
        step.failed = f"{type(exc).__name__}: {exc}"
        for i, got in zip(trees, _forward(model, pool, tree_works, on_forward), strict=True):
            out[i] = got
        return out
    on_forward(len(tree_works))
    r = 0
    for i, w in zip(trees, tree_works, strict=True):
        out[i] = logits[r + w.logit_rows.to(logits.device)]
        r += w.tokens.numel()
    return out
