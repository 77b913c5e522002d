"""The drafter: grows the candidate tree one layer of K nodes per forward, never waiting.

State, for one session:
    KV cache  = committed tokens the drafter has forwarded (``n_committed``), then one slot per
                *expanded* tree node (a node whose own forward has run), in expansion order.
    pending   = committed tokens not yet forwarded (the prompt at start, the unseen tail after a
                miss); they are forwarded before any tree work.
    frontier  = primary nodes not yet expanded; always the newest layer below the root.
    ancestors = ``anc[i, j]``: tree slot j is slot i or one of its ancestors (the tree mask rows).

``step()`` does exactly one thing: forward pending tokens (root children), expand the frontier
(one batched tree-attention forward over its K nodes), or regrow a frontier from tier B without a
forward; it returns the new layer, or None when the tree is at ``max_depth``.
``advance()`` applies the cache's verdict on a correction: on a hit it compacts the KV cache to
committed + surviving subtree, on a miss it keeps what the committed text already covers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine import kv as kvops
from engine.config import TreeParams
from engine.errors import Aborted
from engine.tree import NO_NODE, Advance, Layer, TwoTierTree

_CPU = torch.device("cpu")


class Drafter:
    def __init__(self, model: torch.nn.Module, params: TreeParams) -> None:
        self.model = model
        self.params = params
        self.forwards = 0
        self.tree = TwoTierTree(_CPU)
        self.cache = kvops.new_cache()
        self.n_committed = 0
        self.pending: list[int] = []
        self.kv_slot = torch.empty(0, dtype=torch.int64)  # [N] per tree row, -1 = not expanded
        self.anc = torch.zeros(0, 0, dtype=torch.bool)  # [T, T]
        self.next_id = 0

    # ---- session lifecycle -------------------------------------------------------------------
    def start(self, committed: Sequence[int], epoch: int = 0) -> None:
        """(Re)start from the committed text at ``epoch`` with an empty tree."""
        self.tree.reset(epoch)
        self.cache = kvops.new_cache()
        self.n_committed = 0
        self.pending = list(committed)
        self.kv_slot = torch.empty(0, dtype=torch.int64)
        self.anc = torch.zeros(0, 0, dtype=torch.bool)

    def release(self) -> None:
        """Free the KV cache and the tree (session ended)."""
        self.cache = kvops.new_cache()
        self.tree.reset(self.tree.epoch)
        self.pending = []
        self.n_committed = 0
        self.kv_slot = torch.empty(0, dtype=torch.int64)
        self.anc = torch.zeros(0, 0, dtype=torch.bool)

    @property
    def epoch(self) -> int:
        return self.tree.epoch

    @property
    def n_tree_slots(self) -> int:
        return int(self.anc.shape[0])

    def kv_length(self) -> int:
        return kvops.kv_length(self.cache)

    # ---- growing -----------------------------------------------------------------------------
    def step(self) -> Layer | None:
        if self.pending:
            return self._expand_root()
        frontier = torch.nonzero(self.kv_slot < 0).flatten()
        if frontier.numel():
            if int(self.tree.depth[frontier].max().item()) >= self.params.max_depth:
                return None
            return self._expand(frontier)
        return self._regrow()

    def _new_ids(self, n: int) -> torch.Tensor:
        ids = torch.arange(self.next_id, self.next_id + n, dtype=torch.int64)
        self.next_id += n
        return ids

    def _publish(self, parents: torch.Tensor, tokens: torch.Tensor, local: torch.Tensor,
                 b_parents: torch.Tensor, b_tokens: torch.Tensor, b_logp: torch.Tensor) -> Layer:
        layer = Layer(parents, self._new_ids(parents.numel()), tokens, local,
                      b_parents, b_tokens, b_logp, epoch=self.tree.epoch)
        self.tree.apply_layer(layer)
        self.kv_slot = torch.cat([self.kv_slot, torch.full((layer.size,), -1, dtype=torch.int64)])
        return layer

    def _top_children(self, logits: torch.Tensor, parent_ids: torch.Tensor,
                      parent_path: torch.Tensor) -> Layer:
        """Tier B = top-k children of each expanded node; tier C = global top-K by path score.

        logits: [F, V] for the F expanded nodes; parent_ids, parent_path: [F].
        """
        k, width = self.params.k, self.params.width
        logp = torch.log_softmax(logits.float(), dim=-1).cpu()  # [F, V]
        local, toks = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)  # [F, k]
        path = parent_path[:, None] + local  # [F, k]
        b_parents = parent_ids[:, None].expand_as(toks).reshape(-1)
        _, best = torch.topk(path.reshape(-1), min(width, path.numel()))  # [K]
        best, _ = torch.sort(best)  # stable order: by parent, then by child rank
        return self._publish(b_parents[best], toks.reshape(-1)[best], local.reshape(-1)[best],
                             b_parents, toks.reshape(-1), local.reshape(-1))

    def _expand_root(self) -> Layer:
        tokens = torch.tensor(self.pending, dtype=torch.int64)
        positions = torch.arange(self.n_committed, self.n_committed + tokens.numel())
        logits = kvops.forward(self.model, self.cache, tokens, positions)  # causal, no tree slots
        self.forwards += 1
        self.n_committed += tokens.numel()
        self.pending = []
        root = torch.tensor([self.tree.root_id], dtype=torch.int64)
        return self._top_children(logits[-1:], root, torch.zeros(1))

    def _expand(self, frontier: torch.Tensor) -> Layer:
        tree = self.tree
        f, t = frontier.numel(), self.n_tree_slots
        prow, _ = tree.rows_of(tree.parents[frontier])  # 0 = root
        parent_slot = torch.where(prow > 0, self.kv_slot[(prow - 1).clamp(min=0)], -1)
        visible = torch.zeros(f, t + f, dtype=torch.bool)  # [F, T+F]
        has_parent = parent_slot >= 0
        if t and bool(has_parent.any()):
            visible[has_parent, :t] = self.anc[parent_slot[has_parent]]
        visible[:, t:] = torch.eye(f, dtype=torch.bool)
        dtype = next(self.model.parameters()).dtype
        mask = kvops.tree_mask(self.n_committed, visible, dtype, self.model.device)
        positions = self.n_committed - 1 + tree.depth[frontier]
        logits = kvops.forward(self.model, self.cache, tree.tokens[frontier], positions, mask)
        self.forwards += 1
        anc = torch.zeros(t + f, t + f, dtype=torch.bool)
        anc[:t, :t] = self.anc
        anc[t:] = visible
        self.anc = anc
        self.kv_slot[frontier] = torch.arange(t, t + f)
        return self._top_children(logits, tree.ids[frontier], tree.path_logp[frontier])

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
        rows = tree.reroot(adv)
        kept_slots = self.kv_slot[rows] if rows.numel() else torch.empty(0, dtype=torch.int64)
        desc_slots = kept_slots[kept_slots >= 0]
        keep = torch.cat([
            torch.arange(self.n_committed),
            self.n_committed + torch.tensor(path_slots, dtype=torch.int64),
            self.n_committed + desc_slots,
        ])
        kvops.kv_select(self.cache, keep)
        self.n_committed += len(path_slots)
        self.pending = self.pending + new_tokens[len(path_slots):]
        self.anc = self.anc[desc_slots][:, desc_slots]
        kept_slots = kept_slots.clone()
        kept_slots[kept_slots >= 0] = torch.arange(desc_slots.numel())
        self.kv_slot = kept_slots
