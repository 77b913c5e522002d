"""Core lending (card.engine.inprocess.core_lending): the target borrows the draft's threads exactly while the
draft worker idles, and in-process card with lending stays exact."""

from __future__ import annotations

import torch

from card.engine.draft.worker import DraftWorker
from card.engine.inprocess.core_lending import CoreLender
from card.engine.inprocess.runner import InProcessRunner, RunnerConfig
from card.engine.loading.cpu_linear import pack_linears
from card.engine.loading.models import LoadedModel
from card.engine.shared.config import GenerationRequest, Mode, StopParams, TreeParams
from card.engine.shared.tree import Advance, Outcome
from card.engine.target.scheduler import finish_alone
from tests.engine.support import LetterTokenizer, LockstepRunner, prompt_cases, wait_until
from tests.tiny_models import sharpened, tiny_model


def packed(seed: int, perturb: float = 0.0) -> torch.nn.Module:
    model = sharpened(tiny_model("llama", seed=seed, vocab=97, perturb=perturb, dtype=torch.float32))
    pack_linears(model)
    return model


@torch.inference_mode()
def test_the_target_borrows_only_while_the_worker_idles() -> None:
    target, draft = packed(0), packed(0, perturb=0.02)
    worker = DraftWorker(draft, TreeParams(width=1, branch=2, max_depth=3), lambda *_: None, slots=2,
                         max_len=512, threads=1)
    worker.start()
    lender = CoreLender(target, own_threads=1, lent_threads=1, idle=worker.idle)
    seen: list[int] = []
    probe = target.lm_head.register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    try:
        worker.start_session("s", [3, 1, 4, 1, 5])
        assert not worker.idle.is_set()  # cleared by the command itself, before the worker runs
        assert wait_until(worker.idle.is_set)  # tree at max depth: nothing to grow
        lender.attach()
        target(input_ids=ids)
        assert lender.layers_borrowed == lender.layers > 0 and seen[-1] == 2
        # a correction wakes the worker: the target gives the core back before its next layer
        worker.advance("s", Advance(1, (), (), 9, Outcome.MISS, None))
        assert not worker.idle.is_set()
        borrowed = lender.layers_borrowed
        target(input_ids=ids)
        assert seen[-1] == 1 and lender.layers_borrowed == borrowed
        lender.detach()
        assert torch.get_num_threads() == 1
        worker.stop_session("s")
    finally:
        probe.remove()
        lender.detach()
        worker.close()



def test_card_with_core_lending_equals_vanilla() -> None:
    def loaded(model: torch.nn.Module) -> LoadedModel:
        return LoadedModel("tiny", model, LetterTokenizer(), "fp", frozenset(), 512)

    target = loaded(packed(0))
    draft = loaded(packed(0, perturb=0.02))
    # lockstep at max depth: the worker fills the tree, then idles while the target verifies
    tree = TreeParams(width=1, branch=3, max_depth=2, max_chain=2)
    vanilla = InProcessRunner(target, None, RunnerConfig(mode=Mode.VANILLA, target_threads=1))
    card = LockstepRunner(target, draft, RunnerConfig(mode=Mode.CARD, tree=tree, target_threads=1,
                                                      draft_threads=1), lockstep_depth=2)
    try:
        borrowed = 0
        for prompt, budget in prompt_cases(6, seed=11, max_new=48):
            stop = StopParams(max_new_tokens=budget, ignore_eos=True)
            request = GenerationRequest(tuple(prompt), stop=stop)
            gen = card.generation(request)
            result = finish_alone(target.model, gen)
            assert result.token_ids == vanilla.run(request).token_ids
            borrowed += gen.source.lender.layers_borrowed
        assert borrowed > 0  # lending really happened during the runs
        assert torch.get_num_threads() == 1
    finally:
        card.close()
