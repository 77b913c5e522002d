"""The draft's tree rows at static shapes (card.engine.draft.static_tree) and the block tree they
are attended with (card.engine.shared.exact_attention.tree_attention): a tree row's result does not
depend on its segment, the sessions beside it, the span or ghost rows, so the static step grows
the eager forward's trees bit for bit at every bucket; ghosts never touch a live session."""

from __future__ import annotations

import pytest
import torch

from card.engine.draft.drafter import Drafter, DraftWork, grow_round
from card.engine.draft.static_tree import TreeStep, tree_step_for
from card.engine.loading.invariant import make_exact
from card.engine.shared.config import TreeParams
from card.engine.shared.exact_attention import KV_BLOCK, pow2_blocks, tree_attention
from card.engine.shared.kv_pool import KVPool, forward
from card.engine.shared.static_step import ROW_BUCKETS
from tests.tiny_models import tiny_model

DTYPES = [torch.float32, torch.bfloat16]
PARAMS = TreeParams(width=3, max_depth=6)


def _model(dtype: torch.dtype) -> torch.nn.Module:
    model = tiny_model("qwen2", dtype=dtype, hidden=64, layers=2, vocab=97)
    make_exact(model, exact=True, prepack=True)
    return model


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _sessions(model: torch.nn.Module, count: int, slots: int = 8) -> tuple[KVPool, list[Drafter]]:
    """``count`` drafters on one pool, prompts of different lengths (spans of 1-3 key blocks)."""
    pool = KVPool(model, slots=slots, max_len=200 + 64)
    pool.tree_blocks = True  # the eager forward on the block tree (a static step sets it on its pool)
    drafters = []
    for i in range(count):
        d = Drafter(model, PARAMS, pool=pool)
        d.start(_prompt(5 + 37 * i % 150, seed=i))
        drafters.append(d)
    return pool, drafters


def _trees(drafters: list[Drafter]) -> list[tuple[torch.Tensor, ...]]:
    return [(d.tree.ids.clone(), d.tree.tokens.clone(), d.tree.path_logp.clone(), d.tree.b_tokens.clone(),
             d.tree.b_logp.clone()) for d in drafters]


# ---- the masked block attention --------------------------------------------------------------

def _tree_masks(gen: torch.Generator, committed: int, n: int) -> torch.Tensor:
    """[n, committed + n]: the committed prefix, a random ancestor set among earlier rows, itself."""
    visible = torch.zeros(n, committed + n, dtype=torch.bool)
    visible[:, :committed] = True
    for i in range(n):
        visible[i, committed:committed + i] = torch.rand(i, generator=gen) < 0.5
        visible[i, committed + i] = True
    return visible


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_attention_matches_sdpa_and_is_invariant_to_the_batch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    kv_heads, group, dim, rows = 2, 3, 16, 4 * KV_BLOCK
    keys = torch.randn(6, kv_heads, rows, dim, generator=gen).to(dtype)
    values = torch.randn(6, kv_heads, rows, dim, generator=gen).to(dtype)
    sessions = [(0, 3, 4), (1, 60, 7), (2, 130, 2), (3, 190, 8), (4, 0, 1), (5, 120, 5)]  # slot, committed, n
    queries, masks = [], []
    for _, c, n in sessions:
        queries.append(torch.randn(kv_heads * group, n, dim, generator=gen).to(dtype))
        masks.append(_tree_masks(gen, c, n))
    alone = [tree_attention(q, keys, values, torch.full((n,), slot), m, pow2_blocks(c + n), dim ** -0.5)
             for (slot, c, n), q, m in zip(sessions, queries, masks, strict=True)]
    # every session at once, at the widest span, with padding rows: each row's bits unchanged
    width = rows
    q_all = torch.cat([*queries, torch.zeros(kv_heads * group, 3, dim, dtype=dtype)], dim=1)
    ghosts = torch.zeros(3, dtype=torch.int64)
    slots = torch.cat([torch.full((n,), slot) for slot, _, n in sessions] + [ghosts])
    vis = torch.zeros(q_all.shape[1], width, dtype=torch.bool)
    r = 0
    for (_, c, n), m in zip(sessions, masks, strict=True):
        vis[r:r + n, :c + n] = m
        r += n
    vis[r:, 0] = True
    batched = tree_attention(q_all, keys, values, slots, vis, pow2_blocks(width) * 2, dim ** -0.5)
    r = 0
    sdpa_moved = False
    for (slot, c, n), q, m, ref in zip(sessions, queries, masks, alone, strict=True):
        assert torch.equal(batched[r:r + n], ref)
        r += n
        # SDPA within tolerance (mixed in float32 here: the reference's own rounding)
        k, v = keys[slot, :, :c + n][None].float(), values[slot, :, :c + n][None].float()
        sdpa = torch.nn.functional.scaled_dot_product_attention(q[None].float(), k, v, attn_mask=m,
                                                               enable_gqa=True)[0].transpose(0, 1)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(ref.float(), sdpa, rtol=tol, atol=tol)
        # negative control: SDPA's own result for a row moves with the segment's shape
        k, v = keys[slot, :, :c + n][None], values[slot, :, :c + n][None]
        own = torch.nn.functional.scaled_dot_product_attention(q[None], k, v, attn_mask=m, enable_gqa=True)
        wide = torch.zeros(n, rows, dtype=torch.bool)
        wide[:, :c + n] = m
        padded = torch.nn.functional.scaled_dot_product_attention(
            q[None], keys[slot][None], values[slot][None], attn_mask=wide, enable_gqa=True)
        sdpa_moved |= not torch.equal(own, padded)
    assert sdpa_moved, "SDPA gave every row the same bits over its segment and a padded one"


# ---- the static tree step ----------------------------------------------------------------------

def _plan(drafters: list[Drafter]) -> list[tuple[Drafter, DraftWork]]:
    works = []
    for d in drafters:
        w = d.plan()
        if isinstance(w, DraftWork):
            works.append((d, w))
    return works


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("count", [1, 3])
def test_static_tree_step_equals_the_eager_forward_at_every_bucket(dtype: torch.dtype, count: int) -> None:
    """Each round: the eager forward's logits, then the static step's at every bucket that holds
    the round's rows (re-writing the same keys), bitwise; the trees grow from the eager logits."""
    model = _model(dtype)
    pool, drafters = _sessions(model, count)
    step = TreeStep(model, pool, max_rows=64)
    checked = set()
    for _ in range(6):
        works = _plan(drafters)
        if not works:
            break
        tokens = torch.cat([w.tokens for _, w in works])
        rows = torch.arange(tokens.numel())
        eager = forward(model, pool, [w.segment for _, w in works], tokens, rows)
        trees = [w for _, w in works if w.frontier is not None]
        if len(trees) == len(works):
            for bucket in step.buckets:
                if bucket >= tokens.numel():
                    got = step.run([w.segment for w in trees], tokens, bucket)
                    assert torch.equal(got, eager), f"bucket {bucket}"
                    checked.add(bucket)
        r = 0
        for d, w in works:
            d.finish(w, eager[r + w.logit_rows])
            r += w.tokens.numel()
    assert ({4, 8, 16, 32, 64} if count == 1 else {16, 32, 64}) <= checked


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("count", [1, 5])
def test_worker_rounds_on_the_static_step_grow_the_eager_trees(dtype: torch.dtype, count: int) -> None:
    model = _model(dtype)
    _, eager = _sessions(model, count)
    pool, static = _sessions(model, count)
    step = TreeStep(model, pool, max_rows=count * PARAMS.width)
    ran = []
    for _ in range(PARAMS.max_depth + 2):
        grow_round(model, eager[0].pool, eager)
        grown = grow_round(model, pool, static, step=step)
        ran.append(sum(g.forwarded for g in grown))
        assert [str(t) for t in _trees(eager)] == [str(t) for t in _trees(static)]
        for a, b in zip(_trees(eager), _trees(static), strict=True):
            for x, y in zip(a, b, strict=True):
                assert torch.equal(x, y)
    assert sum(ran) > count  # trees grew
    assert step.batch.rows >= count  # on the static step


@pytest.mark.parametrize("redirect", [True, False])
def test_ghost_rows_never_touch_a_session(redirect: bool) -> None:
    """One session alone in a bucket of 16 (ghost rows): its next tree equals the eager one; with
    the ghosts' writes sent to the session's own slot instead of the scratch slot, it does not."""
    model = _model(torch.float32)
    _, (ref,) = _sessions(model, 1)
    pool, (live,) = _sessions(model, 1)
    step = TreeStep(model, pool, max_rows=16)
    if not redirect:
        fill = step.batch.fill_tree

        def leaky(segments, tokens, bucket, blocks):  # type: ignore[no-untyped-def]
            n = fill(segments, tokens, bucket, blocks)
            step.batch.slots[n:bucket] = segments[0].slot  # ghosts write row 0 of the session's slot
            return n
        step.batch.fill_tree = leaky  # type: ignore[method-assign]
    for _ in range(3):
        grow_round(model, ref.pool, [ref])
        works = _plan([live])
        (d, w), = works
        if w.frontier is None:
            logits = forward(model, pool, [w.segment], w.tokens, w.logit_rows)
        else:
            logits = step.run([w.segment], w.tokens, bucket=16)[w.logit_rows]
        d.finish(w, logits)
    same = all(torch.equal(x, y) for x, y in zip(_trees([ref])[0], _trees([live])[0], strict=True))
    assert same is redirect


def test_tree_step_modes() -> None:
    model = _model(torch.float32)
    pool = KVPool(model, slots=2, max_len=64)
    assert tree_step_for(model, pool, "auto", 4) is None  # the CPU: eager
    assert tree_step_for(model, pool, "eager", 4) is None
    step = tree_step_for(model, pool, "static", 4)
    assert step is not None and step.buckets == (1, 2, 4, 8)
    assert tree_step_for(None, None, "static", 4) is None  # model-free
    with pytest.raises(ValueError):
        tree_step_for(model, pool, "graphs", 4)  # no CUDA here: refused, not silently eager
    with pytest.raises(ValueError):
        tree_step_for(model, pool, "fast", 4)
    assert ROW_BUCKETS[-1] >= 256


def test_the_worker_and_card_draft_take_the_decode_step() -> None:
    from click.testing import CliRunner

    from card.draft_service.config import DraftConfig
    from card.draft_service.server import main
    from card.engine.draft.worker import DraftWorker
    from card.engine.loading.models import ModelConfig
    from card.engine.shared.errors import InvalidArgument

    model = _model(torch.float32)
    worker = DraftWorker(model, PARAMS, lambda *_: None, slots=2, max_len=64, decode_step="static")
    assert worker.step is not None and worker.step.max_rows == 8  # 2 sessions x width 3, a bucket
    assert DraftWorker(model, PARAMS, lambda *_: None, slots=2, max_len=64).step is None  # auto on the CPU
    with pytest.raises(InvalidArgument):
        DraftConfig(cache_addr="127.0.0.1:1", model=ModelConfig("ngram"), name="x", tokenizer="t",
                    decode_step="fast")
    runner = CliRunner()
    assert "--decode-step" in runner.invoke(main, ["--help"]).output
    bad = runner.invoke(main, ["--cache", "127.0.0.1:1"], env={"CARD_DRAFT_DECODE_STEP": "fast"})
    assert bad.exit_code != 0 and "decode-step" in bad.output


def test_the_block_tree_forward_is_sdpa_s_within_tolerance() -> None:
    """The same first tree round with the pool's tree rows on SDPA (the default) and on the block
    tree: logits within float32 rounding, not the same bits (the arithmetic differs)."""
    model = _model(torch.float32)
    got = []
    for blocks in (False, True):
        pool, drafters = _sessions(model, 3)
        pool.tree_blocks = blocks
        grow_round(model, pool, drafters)  # the prompts' prefill, the root's children
        works = _plan(drafters)
        tokens = torch.cat([w.tokens for _, w in works])
        got.append(forward(model, pool, [w.segment for _, w in works], tokens, torch.arange(tokens.numel())))
    torch.testing.assert_close(got[1], got[0], rtol=1e-5, atol=1e-5)
    assert not torch.equal(got[1], got[0])
