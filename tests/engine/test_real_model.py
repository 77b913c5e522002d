"""A real model: SmolLM2-135M-Instruct (the embedded default, Q4_1 GGUF
fetched into the model cache, dequantized to float32).

card and sd equal vanilla token for token on chat prompts, with the same model as draft, both
dynamically quantized to int8 (a different, cheaper draft) and unquantized.
"""

from __future__ import annotations

import pytest
import torch

from card.engine.inprocess.runner import InProcessRunner, RunnerConfig
from card.engine.loading.models import LoadedModel, ModelConfig, load_model
from card.engine.shared.config import GenerationRequest, Mode, StopParams, TreeParams
from tests.engine.support import LockstepRunner, wait_until

pytestmark = pytest.mark.slow

PROMPTS = ["Write a haiku about the sea.", "Explain in simple words how a bicycle works."]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def target(smollm2_gguf) -> LoadedModel:
    return load_model(ModelConfig(spec=str(smollm2_gguf), device="cpu", exact=True))


@pytest.fixture(scope="module")
def int8_draft(smollm2_gguf) -> LoadedModel:
    return load_model(ModelConfig(spec=str(smollm2_gguf), device="cpu", quantize="int8"))


@pytest.fixture(scope="module")
def vanilla(target: LoadedModel) -> dict[str, list[int]]:
    runner = InProcessRunner(target, None, RunnerConfig(mode=Mode.VANILLA))
    out = {}
    for prompt in PROMPTS:
        result = runner.run(request(target, prompt))
        assert result.finish_reason == "length" and len(result.token_ids) == NEW_TOKENS
        out[prompt] = result.token_ids
    return out


def request(target: LoadedModel, prompt: str) -> GenerationRequest:
    return GenerationRequest(tuple(target.encode_prompt(prompt)), stop=StopParams(max_new_tokens=NEW_TOKENS))


def test_model_loads_with_its_tokenizer_and_chat_template(target: LoadedModel,
                                                          int8_draft: LoadedModel) -> None:
    assert target.has_chat_template and target.eos_ids and target.context_window == 8192
    assert int8_draft.fingerprint == target.fingerprint
    ids = target.encode_prompt(PROMPTS[0])
    assert target.decode(ids).count("user") >= 1 and ids[-1] != ids[0]
    assert any(isinstance(m, torch.ao.nn.quantized.dynamic.Linear) for m in int8_draft.model.modules())


def test_greedy_margins_are_not_ties(target: LoadedModel, vanilla: dict[str, list[int]]) -> None:
    """float32 logits of a token differ slightly between a one-token and a multi-token forward;
    exactness below is only meaningful if no step is a near tie. Guard the prompts."""
    for prompt, tokens in vanilla.items():
        ids = target.encode_prompt(prompt) + tokens
        with torch.inference_mode():
            logits = target.model(input_ids=torch.tensor([ids])).logits[0, -NEW_TOKENS - 1 : -1]
        top2 = torch.topk(logits.float(), 2, dim=-1).values
        assert torch.equal(torch.argmax(logits, -1), torch.tensor(tokens))
        assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-3, prompt


@pytest.mark.parametrize("draft_kind", ["int8", "same"])
@pytest.mark.parametrize("mode", ["card", "sd"])
def test_card_and_sd_equal_vanilla(target: LoadedModel, int8_draft: LoadedModel,
                                   vanilla: dict[str, list[int]], mode: str, draft_kind: str) -> None:
    draft = int8_draft if draft_kind == "int8" else target
    # a same-size draft cannot outrun the target asynchronously; lockstep makes its tree count
    lockstep = 3 if (mode, draft_kind) == ("card", "same") else 0
    # lockstep: chains of at most 2 tokens from a tree at least 3 deep, so the token after a fully
    # accepted chain is already in the tree (a hit) whatever the timing; with chains as deep as the
    # tree, hits depended on the draft outgrowing the wait (0 once under a loaded full suite)
    tree = TreeParams(width=4, max_chain=2) if lockstep else TreeParams(width=4)
    config = RunnerConfig(mode=Mode(mode), tree=tree, gamma=4)
    runner = LockstepRunner(target, draft, config, lockstep_depth=lockstep)
    try:
        forwards = hits = 0
        for prompt in PROMPTS:
            result = runner.run(request(target, prompt))
            assert result.token_ids == vanilla[prompt], f"{mode} with {draft.name}: {prompt!r}"
            assert result.text == target.decode(vanilla[prompt])
            forwards += result.stats.target_forwards
            hits += result.stats.hits
        print(f"{mode} draft={draft.name}: {len(PROMPTS) * NEW_TOKENS} tokens in {forwards} target "
              f"forwards, {hits} hits")
        if mode == "sd" or lockstep:  # (async card's acceptance depends on timing)
            assert forwards < len(PROMPTS) * NEW_TOKENS, "no drafted token was ever accepted"
        if lockstep:
            assert hits > 0
        if mode == "card":
            assert runner.worker is not None
            assert wait_until(lambda: runner.worker.active_sessions == 0)
            assert runner.worker.kv_slots_held() == 0
    finally:
        runner.close()
