"""The drafting policy's regime and pauses through the trio, started as a user starts it (the default
``--speculation auto``, and ``never``): tiny float64 checkpoints sharing the SmolLM2 tokenizer.

A draft whose chains the target rejects ("junk": another seed):
- auto: the request's drafting is paused (the worker is told to stop: the cache counts the
  pause), the output is plain decoding's token for token, the stats say how many steps ran paused;
- always (the negative control): nothing is paused, the draft drafts throughout;
- never: the session opens paused and is never stepped; no draft forward is spent on it.
"""

from __future__ import annotations

import uuid

import pytest

from card.client.remote import generate_remote
from card.client.trio import LocalTrio
from card.engine.shared.config import SamplingParams, StopParams
from card.engine.target.drafting_policy import DraftingConfig
from tests.services.e2e_support import float64_reference, labelled, metric, scrape
from tests.tiny_models import save_tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = "Tell me a long story about a fox who learns to sail across the sea."
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("spec-models")
    return {"target": save_tiny_checkpoint(root / "target", seed=0),
            "junk": save_tiny_checkpoint(root / "junk", seed=1)}


@pytest.fixture(scope="module")
def reference(checkpoints):
    return float64_reference(checkpoints["target"])


def _trio(checkpoints, redis_server, tmp_path_factory, speculation: str, draft: str) -> LocalTrio:
    return LocalTrio(target_model=str(checkpoints["target"]), draft_model=str(checkpoints[draft]),
                     draft_name=draft, target_threads=1, draft_threads=1, dtype="float64",
                     log_dir=tmp_path_factory.mktemp(f"spec-{speculation}"), redis_url=redis_server.url,
                     metrics=True, start_timeout_s=240,
                     extra_args={"cache": ["--redis-prefix", f"spec-{uuid.uuid4().hex[:8]}:"],
                                 "target": ["--speculation", speculation, "--max-model-len", "480"]})



@pytest.mark.parametrize("speculation", ["auto", "always", "never"])
def test_the_controller_pauses_a_draft_that_does_not_pay(checkpoints, redis_server, tmp_path_factory,
                                                          reference, speculation):
    """A draft whose chains the target rejects: auto pauses it (the worker is told to stop),
    always never does (the negative control), never opens it paused and never steps it."""
    stop = StopParams(160, ignore_eos=True)
    with _trio(checkpoints, redis_server, tmp_path_factory, speculation, "junk") as trio:
        out = generate_remote(trio.target_addr, PROMPT, sampling=GREEDY, stop=stop, draft="junk",
                              timeout_s=120)
        cache = scrape(trio.metrics_ports["card-cache"])
        target = scrape(trio.metrics_ports["card-target"])
    assert out.token_ids == reference(PROMPT, GREEDY, stop).token_ids
    stats = out.stats
    assert stats.speculation == speculation
    assert metric(target, "card_target_drafting_paused_generations") == 0  # none in flight now
    pauses = labelled(cache, "card_cache_draft_pauses_total", action="pause")
    if speculation == "auto":
        # at least one whole first pause: how many more follow depends on how often the junk draft
        # offers a chain at all (a miss restarts it; an empty chain is no verdict), i.e. on timing
        assert stats.drafting_pauses >= 1
        assert stats.drafting_paused_steps >= DraftingConfig().session_pause[0]
        assert pauses >= 1  # the worker was told to stop, not only ignored
    elif speculation == "always":
        assert stats.drafting_pauses == 0 and stats.drafting_paused_steps == 0 and pauses == 0
        # the draft spent compute throughout (the cost cut still verifies none of its chains): a
        # forward for every few target steps at least. Not more forwards than the target's: the
        # niced draft's tree forwards (many rows) are slower than the target's one-row steps, and
        # a busy box skews the two (102 against 142 in one full-suite run)
        assert stats.draft_forwards > stats.target_forwards // 4 and out.draft == "junk"
    else:
        assert stats.draft_forwards == 0 and stats.draft_tokens == 0 and out.draft == ""
        assert stats.drafting_paused_steps == stats.target_forwards - 1
        assert metric(cache, "card_cache_steps_total") == 0  # opened paused, never stepped
        assert labelled(target, "card_target_speculation_decisions_total", regime="spec", why="probe") == 0
