"""Exactness on a GPU, in bfloat16, at real model sizes (``make gpu-check``; skipped without CUDA).

Random weights at the shapes of Qwen2.5-1.5B (target) and Qwen2.5-0.5B (draft): exactness across
loads does not need trained weights (a random bf16 model is full of near-ties, which makes the
test stricter), and forward cost does not depend on the weights. 1, 4, 8 and 32 requests in
flight, joining at different times, greedy and seeded sampling, plain decoding and card with the
draft on the same GPU: every output equals the same request served alone by plain decoding. The
negative control runs the vendor kernels (``exact=False``) on the same chain-against-steps check.

``CARD_GPU_CHECK_DEVICE=cpu CARD_GPU_CHECK_SCALE=small`` runs the same code on the CPU at small
sizes (how it is kept working on machines without a GPU).
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from card.engine.inprocess.runner import InProcessRunner, RunnerConfig
from card.engine.loading.invariant import make_exact
from card.engine.loading.models import LoadedModel
from card.engine.shared.config import GenerationRequest, Mode, SamplingParams, StopParams, TreeParams
from card.engine.shared.kv_pool import KVPool, Segment, forward
from card.engine.shared.static_step import DecodeRows, StaticStep
from card.engine.target.chain_source import NoDraft
from card.engine.target.generation import Generation
from card.engine.target.scheduler import TargetEngine, finish_alone
from tests.engine.support import LetterTokenizer, chain_logits_equal_steps, letters, run_batched

DEVICE = os.environ.get("CARD_GPU_CHECK_DEVICE", "cuda")
SMALL = os.environ.get("CARD_GPU_CHECK_SCALE", "real") == "small"

pytestmark = pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(),
                                reason="no CUDA device (make gpu-check runs this where there is one)")

# the shapes of Qwen2.5-1.5B-Instruct and Qwen2.5-0.5B-Instruct (config.json of each)
QWEN_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936)
QWEN_0_5B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936)
SMALL_TARGET = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=1024)
SMALL_DRAFT = dict(SMALL_TARGET, num_hidden_layers=1)
# the target's static decoding step here: CUDA graphs on a GPU, the same step eagerly on the CPU
STATIC = "graphs" if DEVICE.startswith("cuda") else "static"


def qwen(shape: dict, seed: int, exact: bool = True, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A Qwen2 of ``shape`` with seeded random weights, on DEVICE, prepared like load_model does."""
    torch.manual_seed(seed)
    config = Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True,
                         rope_theta=1_000_000.0)
    with torch.device(DEVICE):
        model = Qwen2ForCausalLM(config).to(dtype).eval()
    make_exact(model, exact=exact)
    return model


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return qwen(SMALL_TARGET if SMALL else QWEN_1_5B, seed=0)


@pytest.fixture(scope="module")
def draft() -> torch.nn.Module:
    return qwen(SMALL_DRAFT if SMALL else QWEN_0_5B, seed=1, exact=False)


def _vocab(model: torch.nn.Module) -> int:
    return model.config.vocab_size


def _requests(n: int, vocab: int, sampled: bool, seed: int = 5) -> list[GenerationRequest]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(4, 200, (1,), generator=gen))
        prompt = torch.randint(0, vocab, (length,), generator=gen).tolist()
        budget = int(torch.randint(16, 48, (1,), generator=gen))
        sampling = SamplingParams(0.8, top_p=0.95, seed=100 + i) if sampled else SamplingParams()
        stop = StopParams(max_new_tokens=budget, ignore_eos=True)
        out.append(GenerationRequest(tuple(prompt), sampling, stop))
    return out


def _plain(model: torch.nn.Module, request: GenerationRequest) -> Generation:
    return Generation(request, NoDraft(), eos_ids=frozenset(), decode=letters, context_window=4096,
                      mode="vanilla", vocab_size=_vocab(model))


def _loaded(model: torch.nn.Module) -> LoadedModel:
    return LoadedModel("random", model, LetterTokenizer(), "fp", frozenset(), 4096)


def test_chain_logits_equal_plain_steps_on_the_device(target) -> None:
    assert chain_logits_equal_steps(target, exact=True)


@pytest.mark.skipif(SMALL, reason="at small widths the vendor kernels can agree row for row")
def test_vendor_kernels_change_the_chain_logits_on_the_device() -> None:
    """Negative control: without the exact forward a chain's logits differ from plain steps."""
    model = qwen(QWEN_1_5B, seed=0, exact=False)
    assert not chain_logits_equal_steps(model, exact=False)


def test_static_step_probe_passes_on_the_device(target) -> None:
    """Every bucket's rows, beside a session further on and ghost rows, equal plain decoding's
    bits on the device (card.engine.shared.static_step.StaticStep.probe), captured or compiled."""
    step = StaticStep(target, KVPool(target, slots=4, max_len=512), 64, mode=STATIC)
    assert step.probe() is None
    # and it computes what the eager forward does (a replay of stale buffers would be far off)
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, _vocab(target), (90,), generator=gen)
    chain = torch.randint(0, _vocab(target), (5,), generator=gen)
    for slot in (0, 1):
        forward(target, step.pool, [Segment(slot, 0, 90)], prompt, torch.empty(0, dtype=torch.long))
    eager = forward(target, step.pool, [Segment(0, 90, 5, exact=True)], chain, torch.arange(5))
    static = step.run([DecodeRows(1, 90, chain.tolist())]).logits
    assert (static.float() - eager.float()).abs().max() < 0.1 * eager.float().abs().max()


@pytest.mark.parametrize("decode_step", ["eager", STATIC])
@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("in_flight", [1, 4, 8, 32])
def test_in_flight_equal_alone(target, draft, in_flight: int, sampled: bool, decode_step: str) -> None:
    n = max(in_flight, 4)
    requests = _requests(n, _vocab(target), sampled)
    alone = [finish_alone(target, _plain(target, r), decode_step=decode_step).token_ids for r in requests]

    engine = TargetEngine(target, KVPool(target, slots=in_flight, max_len=512), decode_step=decode_step)
    assert (engine.static is not None) is (decode_step != "eager"), "the static step's probe failed here"
    batched = run_batched(engine, [_plain(target, r) for r in requests], join_every=2) if in_flight > 1 \
        else {i: finish_alone(target, _plain(target, r), decode_step=decode_step).token_ids
              for i, r in enumerate(requests)}
    assert [batched[i] for i in range(n)] == alone, "plain decoding in flight"

    runner = InProcessRunner(_loaded(target), _loaded(draft),
                             RunnerConfig(mode=Mode.CARD, tree=TreeParams(width=4, max_depth=6, max_chain=6),
                                          cache_device=DEVICE, backoff=False, decode_step=decode_step))
    try:
        if in_flight == 1:
            got = {i: runner.run(r).token_ids for i, r in enumerate(requests)}
        else:
            pool = KVPool(target, slots=in_flight, max_len=512)
            engine = TargetEngine(target, pool, decode_step=decode_step)
            got = run_batched(engine, [runner.generation(r) for r in requests], join_every=2)
        assert [got[i] for i in range(n)] == alone, "card in flight"
    finally:
        runner.close()
