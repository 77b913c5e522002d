"""Model-free drafting: candidate trees from n-gram statistics, for the price of a few dict probes.

Glossary, as used here:
    context       the tokens before a tree node: the session's committed text (prompt and what the
                  target committed), then the path from the root to the node. Only its last
                  ``max_order`` tokens (the node's *tail*) matter.
    order n       a match of the context's last n tokens, ``min_order <= n <= max_order``.
    followers     the tokens seen after an n-gram, with their counts (at most ``max_followers``
                  per n-gram; the rarest gives way).
    session table followers of every n-gram of one session's own committed text: prompt lookup
                  and suffix matching, the most local source (code being edited, a document being
                  summarised, the first turn's answer).
    shared table  one per worker, fed with the committed text of every session it serves and an
                  optional warm-start corpus; least recently used n-grams are evicted to keep it
                  within a byte budget (``NgramConfig.table_mb``).

Hierarchy (Hierarchy Drafting's order of locality): a node's children come from the longest order
the session table knows, else the longest the shared table knows, else the node has none.
Branch scores are empirical frequencies with Witten-Bell's escape mass,
``p(t) = c(t) / (N + T)`` (N the followers' total count, T how many distinct followers there are):
one sighting scores 1/2, ten agreeing ones 10/11. Path scores therefore stay probabilities, so
tier C (global top-K by path score), tier B (top-k per node) and the target's chain rules
(``min_path_prob``) keep their meaning.

``NgramDrafter`` grows a session's two-tier tree from these tables layer by layer, exactly the
``Layer`` messages a neural drafter publishes, so the cache and the target do not know which kind
of draft they serve. ``Proposer.chain`` is what a neural drafter's cascade asks (card.engine.draft.drafter):
the likeliest continuation of a node, which the neural draft then checks in its own forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from card.engine.shared.config import ChainDraw, NgramConfig, TreeParams
from card.engine.shared.errors import Aborted, ResourceExhausted
from card.engine.shared.ngram_stats import NgramTable, Proposer, top_followers
from card.engine.shared.tree import Advance, Layer, TwoTierTree

_CPU = torch.device("cpu")
class NgramDrafter:
    """One session of the model-free drafter: the same life cycle as card.engine.draft.drafter.Drafter
    (start, plan, advance, release), with no model and no KV cache. ``plan`` always returns a
    ready ``Layer`` (or None: the tree is at max depth, or its deepest nodes have no known
    followers), so a worker never runs a forward for it."""

    forwards = 0  # it never runs one

    def __init__(self, params: TreeParams, vocab_size: int, config: NgramConfig,
                 shared: NgramTable | None, max_len: int) -> None:
        self.params = params
        self.vocab_size = vocab_size
        self.config = config
        self.shared = shared
        self.max_len = max_len
        self.tree = TwoTierTree(_CPU)
        self.proposer: Proposer | None = None
        self.next_id = 0
        self._tails: dict[int, tuple[int, ...]] = {}  # node id (the root's too) -> its tail
        self._open: set[int] = set()  # nodes to expand next: the newest layer, or the root

    @property
    def epoch(self) -> int:
        return self.tree.epoch

    def kv_length(self) -> int:
        return 0

    def start(self, committed: Sequence[int], epoch: int = 0, draw: ChainDraw | None = None) -> None:
        """``draw`` is taken and left: the statistics' counts are no distribution to draw from,
        so a rejection session's chains are drawn by the cache (TwoTierTree.drawn_chain)."""
        if len(committed) > self.max_len:
            raise ResourceExhausted(f"the session has {len(committed)} committed tokens, the draft takes "
                                    f"{self.max_len} (card-draft --max-model-len)")
        self.proposer = Proposer(self.vocab_size, self.config, self.shared)
        self.proposer.extend(committed)
        self.tree.reset(epoch)
        self._reopen_root()

    def _reopen_root(self) -> None:
        assert self.proposer is not None
        self._tails = {self.tree.root_id: self.proposer.tail()}
        self._open = {self.tree.root_id}

    def release(self) -> None:
        self.proposer = None
        self._tails, self._open = {}, set()
        self.tree.reset(self.tree.epoch)

    def plan(self) -> Layer | None:
        """The next layer: every open node's top-k followers (tier B), the K best by path score
        (tier C). The loop runs over the <= K open nodes, each a few dict probes; tensors would
        cost more than the lookups they wrap."""
        if self.proposer is None or not self._open:
            return None
        tree = self.tree
        known = dict(zip(tree.ids.tolist(), zip(tree.depth.tolist(), tree.path_logp.tolist(),
                                                strict=True), strict=True))
        known[tree.root_id] = (0, 0.0)
        parents: list[int] = []
        tokens: list[int] = []
        local: list[float] = []
        path: list[float] = []
        tails: list[tuple[int, ...]] = []
        for node in sorted(self._open):
            depth, node_path = known[node]
            if depth >= self.params.max_depth:
                continue
            tail = self._tails[node]
            found = self.proposer.followers(tail)
            if not found:
                continue
            toks, logps = top_followers(found, self.params.k)
            for t, lp in zip(toks, logps, strict=True):
                parents.append(node)
                tokens.append(t)
                local.append(lp)
                path.append(node_path + lp)
                keep = tail[1 - self.config.max_order:] if self.config.max_order > 1 else ()
                tails.append((*keep, t))
        self._open = set()
        if not tokens:
            return None
        order = sorted(range(len(path)), key=lambda i: -path[i])[: self.params.width]
        order.sort()  # by parent, then by rank: the order a neural drafter publishes in
        ids = list(range(self.next_id, self.next_id + len(order)))
        self.next_id += len(order)
        layer = Layer(
            torch.tensor([parents[i] for i in order], dtype=torch.int64),
            torch.tensor(ids, dtype=torch.int64),
            torch.tensor([tokens[i] for i in order], dtype=torch.int64),
            torch.tensor([local[i] for i in order], dtype=torch.float32),
            torch.tensor(parents, dtype=torch.int64), torch.tensor(tokens, dtype=torch.int64),
            torch.tensor(local, dtype=torch.float32), epoch=tree.epoch)
        tree.apply_layer(layer)
        for nid, i in zip(ids, order, strict=True):
            self._tails[nid] = tails[i]
        self._open = set(ids)
        return layer

    def advance(self, adv: Advance) -> None:
        """The cache's verdict: re-root the mirror, learn the committed tokens, reopen."""
        if adv.epoch <= self.tree.epoch:
            return
        if adv.epoch != self.tree.epoch + 1:
            raise Aborted(f"drafter at epoch {self.tree.epoch} got advance to epoch {adv.epoch}")
        assert self.proposer is not None
        new_tokens = [*adv.accepted_tokens, adv.next_token]
        if len(self.proposer.committed) + len(new_tokens) > self.max_len:
            raise ResourceExhausted(f"the session outgrew the draft's {self.max_len} tokens")
        self.tree.reroot(adv)
        self.proposer.extend(new_tokens)
        if adv.hit_node_id is None:
            self._reopen_root()
            return
        # below the hit: grow on from every leaf (the newest layer's survivors, and nodes whose
        # children were all pruned out of tier C, which regrow among themselves)
        alive = set(self.tree.ids.tolist())
        alive.add(self.tree.root_id)
        self._tails = {nid: tail for nid, tail in self._tails.items() if nid in alive}
        self._open = alive - set(self.tree.parents.tolist())
