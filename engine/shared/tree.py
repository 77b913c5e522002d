"""The two-tier candidate tree (DESIGN.md §2) as columns of tensors.

Glossary, as used here:
    root        the node the tree grows from: a real node id after a hit, else the *virtual root*
                of the epoch, ``virtual_root_id(epoch)`` (negative), standing for the last
                committed token. Both sides derive virtual ids from the epoch, so a miss needs no
                extra message to agree on the new root.
    C (primary) rows of the node columns: at most K nodes per layer, each with a node id that is
                never reused within a session. Rows are appended layer by layer, so a parent's row
                always precedes its children's and node ids ascend with rows.
    B (secondary) for every expanded node, its top-k children as (parent id, token, local logp),
                including those promoted into C.
    path score  product of local probabilities from the root; stored as ``path_logp`` (its log),
                re-based on every hit so the new root has score 1.

The tree is shared logic: the cache service (and the in-process runner) apply draft layers and
target corrections to it; the drafter keeps a mirror and re-roots it with the cache's verdict, so
both hold the same node ids after every correction.
"""

from __future__ import annotations

import enum
import math
import random
import threading
from collections import Counter
from dataclasses import dataclass, field

import torch

from card.engine.shared.errors import Aborted, InvalidArgument

# node id of a token that has no node: a chain's tier-B extension, or text the target committed
# while the session was not there to see it (a catch-up); a path that leaves the tree stays out
NO_NODE = -1
# What a cache accepts in one layer (K is 3-8 in practice; the bounds only stop abuse)
MAX_LAYER_NODES = 1024
MAX_LAYER_SECONDARY = 16384
LOGP_SLACK = 1e-4  # a log-softmax can round a hair above 0
# What one session's tree holds at most, whatever its draft publishes (a draft is not trusted with
# a tree's size): every Step walks the whole tree in Python (best_chain, classify, drawn_chain),
# ~2 us an entry, so these keep one session's Step near 10 ms, far below a target's 1 s StepBatch
# deadline. An honest tree is far smaller: width (<= 64) x depth nodes, 32 on a GPU's default, 96
# for the model-free drafter; k (<= 64) tier-B entries per expanded node. The q-row width bounds
# the entries under one parent (the support of a drawn chain's proposal): TreeParams' bound on k.
MAX_TREE_NODES = 4096
MAX_TREE_SECONDARY = 4 * MAX_TREE_NODES
MAX_Q_WIDTH = 64
# Entries (nodes plus tier-B entries) the trees of one draft worker's sessions hold together in the
# cache: a worker that publishes all it may fills its own sessions' trees (a dozen at the
# per-session caps, hundreds of honest ones), never the cache's memory (~100 bytes an entry).
WORKER_TREE_ENTRIES = 1 << 18


def tier_b_probs(logps: list[float], temperature: float) -> list[float]:
    """The distribution a rejection session draws a node's child from: softmax(logp / T) over its
    tier-B entries. One function for the draft that draws and the cache that reports the
    proposal, so both see the same numbers."""
    scaled = [v / temperature for v in logps]
    top = max(scaled)
    weights = [math.exp(v - top) for v in scaled]
    total = sum(weights)
    return [w / total for w in weights]


def draw_index(probs: list[float], u: float) -> int:
    """Inverse CDF of ``probs`` at ``u`` in [0, 1)."""
    acc = 0.0
    for i, q in enumerate(probs):
        acc += q
        if u < acc:
            return i
    return len(probs) - 1


def virtual_root_id(epoch: int) -> int:
    """Id of the root of a tree started (at session start or after a miss) at ``epoch``."""
    return -(epoch + 2)


class Outcome(enum.Enum):
    HIT = "hit"
    SECONDARY_HIT = "secondary_hit"
    MISS = "miss"


def _i64(values: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int64, device=device).reshape(-1)


def _f32(values: list[float] | torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float32, device=device).reshape(-1)


@dataclass(frozen=True)
class Layer:
    """One layer published by the drafter.

    parent_ids, node_ids, tokens, local_logp: [N] primary nodes (N <= K).
    b_parent_ids, b_tokens, b_logp:           [M] secondary entries (M <= K*k), empty on a regrow.
    epoch: the drafter's epoch when it built the layer (informational; node ids decide).
    drawn: [N] bool, the node is its parent's drawn child (a rejection session's draft,
           config.ChainDraw); None: none is.
    """

    parent_ids: torch.Tensor
    node_ids: torch.Tensor
    tokens: torch.Tensor
    local_logp: torch.Tensor
    b_parent_ids: torch.Tensor
    b_tokens: torch.Tensor
    b_logp: torch.Tensor
    epoch: int = 0
    drawn: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.node_ids.numel())

    def check(self, vocab_size: int = 0) -> None:
        """InvalidArgument unless the layer is one a drafter can have grown: columns of equal
        length, at most MAX_LAYER_NODES primary and MAX_LAYER_SECONDARY secondary entries, unique
        node ids, tokens in [0, vocab_size) (0: no upper bound), log-probs finite and <= 0.
        The cache applies it to every layer it receives (a draft is not trusted with a tree)."""
        n, m = self.size, int(self.b_tokens.numel())
        if not (self.parent_ids.numel() == self.tokens.numel() == self.local_logp.numel() == n):
            raise InvalidArgument("the layer's primary columns differ in length")
        if not (self.b_parent_ids.numel() == self.b_logp.numel() == m):
            raise InvalidArgument("the layer's secondary columns differ in length")
        if self.drawn is not None and (self.drawn.numel() != n or self.drawn.dtype != torch.bool):
            raise InvalidArgument("the layer's drawn column is not one bool per primary node")
        if n > MAX_LAYER_NODES or m > MAX_LAYER_SECONDARY:
            raise InvalidArgument(f"the layer has {n} nodes and {m} secondary entries (at most "
                                  f"{MAX_LAYER_NODES} and {MAX_LAYER_SECONDARY})")
        if torch.unique(self.node_ids).numel() != n:
            raise InvalidArgument("the layer repeats a node id")
        for tokens in (self.tokens, self.b_tokens):
            if tokens.numel() and (int(tokens.min()) < 0 or (vocab_size and int(tokens.max()) >= vocab_size)):
                raise InvalidArgument(
                    f"the layer holds a token outside the vocabulary [0, {vocab_size or '...'})")
        for logp in (self.local_logp, self.b_logp):
            if logp.numel() and not bool((torch.isfinite(logp) & (logp <= LOGP_SLACK)).all()):
                raise InvalidArgument("the layer holds a log-probability that is not finite or is above 0")


@dataclass(frozen=True)
class TreeLimits:
    """What one tree holds at most: tier-C ``nodes``, tier-B ``secondary`` entries, and entries
    under one parent (``q_width``). The excess of a layer is dropped and counted (TwoTierTree.dropped)."""

    nodes: int = MAX_TREE_NODES
    secondary: int = MAX_TREE_SECONDARY
    q_width: int = MAX_Q_WIDTH


class TreeBudget:
    """Entries (tier-C nodes plus tier-B entries) that several trees hold together at most: in the
    cache, one draft worker's sessions. A tree takes from it before it grows and gives back what it
    frees (re-root, reset). Thread-safe: its lock is a leaf (nothing waits under it)."""

    def __init__(self, limit: int = WORKER_TREE_ENTRIES) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> int:
        """Up to ``n`` entries, as many as are left; how many were granted."""
        with self._lock:
            granted = max(0, min(n, self.limit - self.used))
            self.used += granted
            return granted

    def charge(self, n: int) -> None:
        """``n`` entries a tree already holds (it moved here), over the limit if need be."""
        with self._lock:
            self.used += n

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n


@dataclass(frozen=True)
class Proposal:
    """The draft distributions a drawn chain's tokens came from (engine.shared.config.ChainDraw):
    row i is the distribution token i was drawn from, sparse, padded with token -1 / prob 0.

    tokens: [c, w] int64; probs: [c, w] float64, each row summing to 1.
    """

    tokens: torch.Tensor
    probs: torch.Tensor

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def head(self, n: int) -> Proposal:
        return Proposal(self.tokens[:n], self.probs[:n])

    @classmethod
    def of_rows(cls, rows: list[tuple[list[int], list[float]]]) -> Proposal:
        width = max((len(t) for t, _ in rows), default=0)
        tokens = torch.full((len(rows), width), -1, dtype=torch.int64)
        probs = torch.zeros(len(rows), width, dtype=torch.float64)
        for i, (t, q) in enumerate(rows):
            tokens[i, :len(t)] = torch.tensor(t, dtype=torch.int64)
            probs[i, :len(q)] = torch.tensor(q, dtype=torch.float64)
        return cls(tokens, probs)


@dataclass(frozen=True)
class Chain:
    """The candidate continuation the target verifies next.

    ``node_ids[i]`` is the node of ``tokens[i]``, or ``NO_NODE`` for a tier-B extension (or a
    drawn token that is no tier-C node). ``proposal``: set when the chain was drawn (a
    ``rejection`` session), one row per token.
    """

    tokens: tuple[int, ...] = ()
    node_ids: tuple[int, ...] = ()
    epoch: int = 0
    proposal: Proposal | None = None

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class Correction:
    """What the target made of a chain: the accepted prefix and its own next token."""

    epoch: int
    accepted_tokens: tuple[int, ...]
    accepted_node_ids: tuple[int, ...]
    next_token: int


@dataclass(frozen=True)
class Advance:
    """A correction as the drafter needs it: the new epoch and the cache's hit verdict."""

    epoch: int
    accepted_tokens: tuple[int, ...]
    accepted_node_ids: tuple[int, ...]
    next_token: int
    outcome: Outcome
    hit_node_id: int | None = None


@dataclass(frozen=True)
class _HostView:
    ids: list[int]
    parents: list[int]
    tokens: list[int]
    drawn: list[bool]
    path: list[float]
    b_parents: list[int]
    b_tokens: list[int]
    b_logp: list[float]


@dataclass
class TreeSizes:
    nodes: int
    secondary: int
    depth: int


@dataclass
class TwoTierTree:
    """Tiers C and B of one session, on ``device``. ``limits``: what it holds at most (None: no
    bound, a drafter's own mirror, bounded by its TreeParams); ``dropped`` counts what layers
    brought beyond them, by (kind, why): kind "node" or "secondary", why "session" (these
    limits), "worker" (the TreeBudget a layer was applied with) or "width" (q_width)."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    epoch: int = 0
    limits: TreeLimits | None = None

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        self.dropped: Counter[tuple[str, str]] = Counter()
        self._budget: TreeBudget | None = None
        self._charged = 0  # entries taken from _budget and not given back
        self.reset(self.epoch)

    # ---- state -------------------------------------------------------------------------------
    def reset(self, epoch: int) -> None:
        """Empty tree under the virtual root of ``epoch``."""
        self.epoch = epoch
        self.root_id = virtual_root_id(epoch)
        empty_i = torch.empty(0, dtype=torch.int64, device=self.device)
        empty_f = torch.empty(0, dtype=torch.float32, device=self.device)
        self.ids = empty_i  # [N] node ids, ascending
        self.parents = empty_i  # [N] parent node ids (root_id for depth 1)
        self.tokens = empty_i  # [N]
        self.depth = empty_i  # [N] 1 = child of root
        self.local_logp = empty_f  # [N] log p_draft(token | path)
        self.drawn = torch.empty(0, dtype=torch.bool, device=self.device)  # [N] its parent's drawn child
        self.path_logp = empty_f  # [N] sum of local_logp from the root
        self.b_parents = empty_i  # [M]
        self.b_tokens = empty_i  # [M]
        self.b_logp = empty_f  # [M] local logp of the secondary child
        self._view: _HostView | None = None
        self._settle()

    @property
    def entries(self) -> int:
        """Nodes plus tier-B entries: what a TreeBudget counts."""
        return int(self.ids.numel()) + int(self.b_tokens.numel())

    def _settle(self) -> None:
        """Give back to the budget what the tree no longer holds (after a re-root or a reset)."""
        if self._budget is not None and self._charged > self.entries:
            self._budget.give(self._charged - self.entries)
            self._charged = self.entries

    def _rebudget(self, budget: TreeBudget | None) -> None:
        """Layers come with another budget now (another worker serves the session): what the tree
        holds moves to it."""
        if self._budget is not None:
            self._budget.give(self._charged)
        self._budget, self._charged = budget, 0
        if budget is not None:
            budget.charge(self.entries)
            self._charged = self.entries

    def sizes(self) -> TreeSizes:
        depth = int(self.depth.max().item()) if self.ids.numel() else 0
        return TreeSizes(int(self.ids.numel()), int(self.b_tokens.numel()), depth)

    def __len__(self) -> int:
        return int(self.ids.numel())

    def _known(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Ids, depths and path logps of the root followed by every node (root first, ascending)."""
        root = torch.tensor([self.root_id], dtype=torch.int64, device=self.device)
        zero_i = torch.zeros(1, dtype=torch.int64, device=self.device)
        zero_f = torch.zeros(1, dtype=torch.float32, device=self.device)
        return (
            torch.cat([root, self.ids]),
            torch.cat([zero_i, self.depth]),
            torch.cat([zero_f, self.path_logp]),
        )

    def rows_of(self, node_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row index into ``_known()`` (0 = root) of each id, and whether the id is present."""
        known, _, _ = self._known()
        pos = torch.searchsorted(known, node_ids.contiguous()).clamp(max=known.numel() - 1)
        return pos, known[pos] == node_ids

    # ---- draft side --------------------------------------------------------------------------
    def apply_layer(self, layer: Layer, budget: TreeBudget | None = None) -> torch.Tensor:
        """Add a layer's nodes whose parent is still in the tree; returns the kept mask [N].

        Nodes under a pruned parent (a layer built before a correction arrived) are dropped, as
        are ids already present (a layer delivered twice). Past the tree's ``limits`` and what
        ``budget`` (shared with other trees) has left, the layer's excess is dropped and counted
        in ``dropped``: its last nodes, and tier-B entries a whole parent at a time (a parent's
        entries are the support of a drawn chain's proposal: a part of them would misstate q).
        """
        if budget is not self._budget:
            self._rebudget(budget)
        parent_ids = layer.parent_ids.to(self.device)
        node_ids = layer.node_ids.to(self.device)
        _, known_depth, known_path = self._known()
        prow, present = self.rows_of(parent_ids)
        keep = present & ~torch.isin(node_ids, self.ids) & (node_ids > self.root_id)
        if self.limits is not None:
            keep = self._cap_nodes(keep)
        if bool(keep.any()):
            local = layer.local_logp.to(self.device, torch.float32)[keep]
            self.ids = torch.cat([self.ids, node_ids[keep]])
            self.parents = torch.cat([self.parents, parent_ids[keep]])
            self.tokens = torch.cat([self.tokens, layer.tokens.to(self.device)[keep]])
            self.depth = torch.cat([self.depth, known_depth[prow[keep]] + 1])
            self.local_logp = torch.cat([self.local_logp, local])
            drawn = (layer.drawn.to(self.device)[keep] if layer.drawn is not None
                     else torch.zeros(int(keep.sum()), dtype=torch.bool, device=self.device))
            self.drawn = torch.cat([self.drawn, drawn])
            self.path_logp = torch.cat([self.path_logp, known_path[prow[keep]] + local])
            order = torch.argsort(self.ids)  # late layers may interleave ids; keep them ascending
            if not bool((order == torch.arange(order.numel(), device=self.device)).all()):
                self._take(order)
        self._view = None
        b_parents = layer.b_parent_ids.to(self.device)
        if b_parents.numel():
            _, b_present = self.rows_of(b_parents)
            if self.limits is not None:
                b_present = self._cap_secondary(b_parents, b_present)
            self.b_parents = torch.cat([self.b_parents, b_parents[b_present]])
            self.b_tokens = torch.cat([self.b_tokens, layer.b_tokens.to(self.device)[b_present]])
            self.b_logp = torch.cat(
                [self.b_logp, layer.b_logp.to(self.device, torch.float32)[b_present]]
            )
        return keep

    def _cap_nodes(self, keep: torch.Tensor) -> torch.Tensor:
        """``keep`` cut to the nodes the limits and the budget leave room for (the layer's first)."""
        assert self.limits is not None
        rows = keep.nonzero().flatten()
        allowed = min(rows.numel(), max(0, self.limits.nodes - len(self)))
        self._drop("node", "session", rows.numel() - allowed)
        if self._budget is not None and allowed:
            granted = self._budget.take(allowed)
            self._charged += granted
            self._drop("node", "worker", allowed - granted)
            allowed = granted
        if allowed == rows.numel():
            return keep
        keep = keep.clone()
        keep[rows[allowed:]] = False
        return keep

    def _cap_secondary(self, b_parents: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        """``present`` cut to the tier-B entries the limits and the budget leave room for, whole
        parents at a time: a parent whose entries would pass ``q_width`` gets none of this layer's,
        and parents are taken in id order while the room lasts."""
        assert self.limits is not None
        candidates = b_parents[present]
        if not candidates.numel():
            return present
        parents, inverse, counts = torch.unique(candidates, return_inverse=True, return_counts=True)
        held = torch.sort(self.b_parents).values  # entries each parent already has
        counts_held = (torch.searchsorted(held, parents, right=True) - torch.searchsorted(held, parents))
        ok = counts + counts_held <= self.limits.q_width
        self._drop("secondary", "width", int(counts[~ok].sum()))
        sizes = torch.where(ok, counts, torch.zeros_like(counts))
        room = max(0, self.limits.secondary - int(self.b_tokens.numel()))
        fits = ok & (torch.cumsum(sizes, 0) <= room)
        self._drop("secondary", "session", int(counts[ok & ~fits].sum()))
        if self._budget is not None:
            want = int(counts[fits].sum())
            granted = self._budget.take(want)
            sizes = torch.where(fits, counts, torch.zeros_like(counts))
            within = fits & (torch.cumsum(sizes, 0) <= granted)
            used = int(counts[within].sum())
            self._budget.give(granted - used)
            self._charged += used
            self._drop("secondary", "worker", want - used)
            fits = within
        kept = present.clone()
        kept[present] = fits[inverse]
        return kept

    def _drop(self, kind: str, why: str, n: int) -> None:
        if n > 0:
            self.dropped[kind, why] += n

    def _take(self, rows: torch.Tensor) -> None:
        self._view = None
        self.ids = self.ids[rows]
        self.parents = self.parents[rows]
        self.tokens = self.tokens[rows]
        self.depth = self.depth[rows]
        self.local_logp = self.local_logp[rows]
        self.drawn = self.drawn[rows]
        self.path_logp = self.path_logp[rows]

    # ---- target side -------------------------------------------------------------------------
    def _host(self) -> _HostView:
        """Host lists of the columns, rebuilt only after the tree changed.

        Queries walk a few dozen nodes; on such sizes a Python pass over host lists costs ~6 us
        where the equivalent chain of torch ops costs ~110 us (launch overhead per op, a device
        sync per ``.item()``). The tensors stay the storage and take the bulk updates.
        """
        if self._view is None:
            self._view = _HostView(
                ids=self.ids.tolist(), parents=self.parents.tolist(), tokens=self.tokens.tolist(),
                drawn=self.drawn.tolist(),
                path=self.path_logp.tolist(), b_parents=self.b_parents.tolist(),
                b_tokens=self.b_tokens.tolist(), b_logp=self.b_logp.tolist(),
            )
        return self._view

    def best_chain(self, max_len: int, b_extension: bool = True, min_path_prob: float = 0.0) -> Chain:
        """Greedy descent by path score through C from the root, then one tier-B token.

        The chain stops before the first token whose path score (the draft's probability of the
        whole prefix up to it) is below ``min_path_prob``: that score estimates how likely the
        target is to reach the token, and where a verified row has a price (CPU) an unlikely
        row costs more than it is expected to save.
        """
        view = self._host()
        floor = math.log(min_path_prob) if min_path_prob > 0 else -math.inf
        best: dict[int, int] = {}  # parent id -> row of its best child (ties: earliest row)
        for i, parent in enumerate(view.parents):
            b = best.get(parent)
            if b is None or view.path[i] > view.path[b]:
                best[parent] = i
        tokens: list[int] = []
        node_ids: list[int] = []
        cur, cur_path = self.root_id, 0.0
        while len(tokens) < max_len and cur in best and view.path[best[cur]] >= floor:
            r = best[cur]
            tokens.append(view.tokens[r])
            node_ids.append(view.ids[r])
            cur, cur_path = view.ids[r], view.path[r]
        if b_extension and len(tokens) < max_len and cur not in best:
            # cur has no C children here, so none of its B children was promoted into C
            j = max((i for i, p in enumerate(view.b_parents) if p == cur),
                    key=view.b_logp.__getitem__, default=None)
            if j is not None and cur_path + view.b_logp[j] >= floor:
                tokens.append(view.b_tokens[j])
                node_ids.append(NO_NODE)
        return Chain(tuple(tokens), tuple(node_ids), self.epoch)

    def drawn_chain(self, max_len: int, temperature: float, rng: random.Random,
                    min_path_prob: float = 0.0) -> Chain:
        """A chain drawn from the draft's distributions (config.ChainDraw), with its Proposal.

        Below each node the token is the node's drawn child where the draft drew one (a
        rejection session's draft draws for every node it expands, Drafter.start), else drawn
        here; either way from tier_b_probs of the node's tier B at ``temperature``. Whether
        position j gets a token is decided before its token is drawn, from the tokens
        above it only (the length, the path so far, whether the parent is an expanded node):
        a rule that kept or cut a token by its own value would skew what the target's
        rejection rule sees away from q, and its output away from p. So a drawn token outside
        tier C is kept (as ``NO_NODE``, the last of the chain) whatever ``b_extension`` says,
        and ``min_path_prob`` stops the draw *after* the first token whose path probability
        (under the proposals) falls below it.
        """
        view = self._host()
        below: dict[tuple[int, int], int] = {}  # (parent id, token) -> tier-C node id
        drawn: dict[int, int] = {}  # parent id -> its drawn child's token (the draft drew it)
        for i, (nid, parent, token) in enumerate(zip(view.ids, view.parents, view.tokens, strict=True)):
            below.setdefault((parent, token), nid)
            if view.drawn[i]:
                drawn.setdefault(parent, token)
        entries: dict[int, dict[int, float]] = {}  # parent id -> token -> local logp (tier B)
        for parent, token, logp in zip(view.b_parents, view.b_tokens, view.b_logp, strict=True):
            entries.setdefault(parent, {}).setdefault(token, logp)  # a layer sent twice repeats them
        floor = math.log(min_path_prob) if min_path_prob > 0 else -math.inf
        tokens: list[int] = []
        node_ids: list[int] = []
        rows: list[tuple[list[int], list[float]]] = []
        cur, path = self.root_id, 0.0
        while len(tokens) < max_len and path >= floor and (children := entries.get(cur)):
            toks = list(children)
            probs = tier_b_probs([children[t] for t in toks], temperature)
            if cur in drawn:  # the draft's draw (made before anything here could see it)
                if drawn[cur] not in children:
                    break  # not a draw from this tier B: no proposal to divide by
                pick = toks.index(drawn[cur])
            else:
                pick = draw_index(probs, rng.random())
            if probs[pick] <= 0.0:  # a draft's logp so far below its siblings' that q underflows
                break  # to 0: no proposal divides by it (and log(0) would fail the whole step)
            token = toks[pick]
            tokens.append(token)
            rows.append((toks, probs))
            path += math.log(probs[pick])
            child = below.get((cur, token))
            node_ids.append(NO_NODE if child is None else child)
            if child is None:
                break
            cur = child
        return Chain(tuple(tokens), tuple(node_ids), self.epoch, Proposal.of_rows(rows))

    def classify(self, correction: Correction) -> tuple[Outcome, int | None, tuple[int, ...]]:
        """Hit / secondary hit / miss of the correction's next token below the accepted path, and
        the accepted path's node ids as this tree holds them.

        An accepted token of ``NO_NODE`` (a tier-B extension, a model-free chain the tree never
        held, the text a paused or late session catches up on) is looked up by token among the
        children of the node before it: the same token after the same path is the same context,
        so a draft that grew it meanwhile keeps its work. The path leaves the tree at the first
        token no child holds; past that point every id must be ``NO_NODE``."""
        if correction.epoch != self.epoch:
            raise Aborted(f"stale epoch {correction.epoch}: the session is at epoch {self.epoch}")
        if len(correction.accepted_tokens) != len(correction.accepted_node_ids):
            raise InvalidArgument("accepted_tokens and accepted_node_ids differ in length")
        accepted = list(correction.accepted_node_ids)
        if NO_NODE in accepted and any(nid != NO_NODE for nid in accepted[accepted.index(NO_NODE):]):
            raise InvalidArgument("an accepted path that leaves the tree cannot come back to it")
        view = self._host()
        row = {nid: i for i, nid in enumerate(view.ids)}
        anchor = self.root_id
        resolved: list[int] = []
        child: dict[tuple[int, int], int] | None = None  # (parent, token) -> its first node, on demand
        for nid, token in zip(accepted, correction.accepted_tokens, strict=True):
            if nid == NO_NODE:
                if child is None:  # one pass over the tree, not one per token
                    child = {}
                    for i, p, t in zip(view.ids, view.parents, view.tokens, strict=True):
                        child.setdefault((p, t), i)
                nid = child.get((anchor, token), NO_NODE)
                if nid == NO_NODE:  # left the tree: the rest of the path is no node's either
                    return Outcome.MISS, None, tuple(resolved) + (NO_NODE,) * (len(accepted) - len(resolved))
            else:
                r = row.get(nid)
                if r is None or view.parents[r] != anchor:
                    raise InvalidArgument(f"accepted node {nid} is not on a path from the root")
                if view.tokens[r] != token:
                    raise InvalidArgument(f"accepted node {nid} does not hold the accepted token {token}")
            resolved.append(nid)
            anchor = nid
        nxt = correction.next_token
        for i, parent in enumerate(view.parents):
            if parent == anchor and view.tokens[i] == nxt:
                return Outcome.HIT, view.ids[i], tuple(resolved)
        if any(p == anchor and t == nxt for p, t in zip(view.b_parents, view.b_tokens, strict=True)):
            return Outcome.SECONDARY_HIT, None, tuple(resolved)
        return Outcome.MISS, None, tuple(resolved)

    def apply_correction(self, correction: Correction) -> Advance:
        """Classify, re-root and bump the epoch; the returned Advance goes to the drafter, with
        the accepted path's node ids as this tree holds them (``classify``)."""
        outcome, hit_id, node_ids = self.classify(correction)
        advance = Advance(
            epoch=self.epoch + 1,
            accepted_tokens=correction.accepted_tokens,
            accepted_node_ids=node_ids,
            next_token=correction.next_token,
            outcome=outcome,
            hit_node_id=hit_id,
        )
        self.reroot(advance)
        return advance

    def reroot(self, advance: Advance) -> torch.Tensor:
        """Keep only the subtree below the hit node (or nothing); returns the kept rows."""
        if advance.hit_node_id is None:
            self.reset(advance.epoch)
            return torch.empty(0, dtype=torch.int64, device=self.device)
        hit = advance.hit_node_id
        view = self._host()
        if hit not in view.ids:
            raise InvalidArgument(f"hit node {hit} is not in the tree")
        r = view.ids.index(hit)
        hit_depth, hit_path = self.depth[r].clone(), self.path_logp[r].clone()
        # rows are in creation order, so one pass sees every parent before its children
        kept_ids, kept_rows = {hit}, []
        for i, (nid, parent) in enumerate(zip(view.ids, view.parents, strict=True)):
            if parent in kept_ids:
                kept_ids.add(nid)
                kept_rows.append(i)
        rows = _i64(kept_rows, self.device)
        self._take(rows)
        self.depth = self.depth - hit_depth
        self.path_logp = self.path_logp - hit_path
        survivors = torch.cat([_i64([hit], self.device), self.ids])
        b_keep = torch.isin(self.b_parents, survivors)
        self.b_parents = self.b_parents[b_keep]
        self.b_tokens = self.b_tokens[b_keep]
        self.b_logp = self.b_logp[b_keep]
        self._view = None
        self.root_id = hit
        self.epoch = advance.epoch
        self._settle()
        return rows
