"""card-auto through the trio, started as a user starts it: per request, the cache's model-free
lookup alone (the worker paused) or the draft pool's worker, whichever commits faster
(card.engine.target.drafting_policy). Tiny float64 checkpoints sharing the SmolLM2 tokenizer.

- the output is plain decoding's token for token, through every switch;
- both drafters served the request (the target counts its switches; the cache paused and resumed
  the worker and answered chains from the session's own text);
- mode card (the negative control, first in the same trio) never switches and never pauses the
  worker.
"""

from __future__ import annotations

import uuid

import pytest

from card.client.remote import generate_remote
from card.client.trio import LocalTrio
from card.engine.shared.config import SamplingParams, StopParams
from tests.services.e2e_support import float64_reference, labelled, metric, scrape
from tests.tiny_models import save_tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = "Repeat after me: the fox sails the sea, the fox sails the sea, the fox sails the sea."
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("auto-models")
    return {"target": save_tiny_checkpoint(root / "target", seed=0),
            "draft": save_tiny_checkpoint(root / "draft", seed=0)}


def _switches(target: str) -> tuple[float, float]:
    return (labelled(target, "card_target_drafter_switches_total", drafter="neural"),
            labelled(target, "card_target_drafter_switches_total", drafter="model-free"))


def test_card_auto_switches_drafters_and_stays_exact(checkpoints, redis_server, tmp_path_factory):
    """One trio: a mode card request first (the negative control: no switch, no pause), then
    card-auto (both drafters tried, the worker paused and resumed, lookup chains verified)."""
    stop = StopParams(120, ignore_eos=True)
    want = float64_reference(checkpoints["target"])(PROMPT, GREEDY, stop).token_ids
    with LocalTrio(target_model=str(checkpoints["target"]), draft_model=str(checkpoints["draft"]),
                   draft_name="tiny", target_threads=1, draft_threads=1, dtype="float64",
                   log_dir=tmp_path_factory.mktemp("auto"), redis_url=redis_server.url, metrics=True,
                   start_timeout_s=240,
                   extra_args={"cache": ["--redis-prefix", f"auto-{uuid.uuid4().hex[:8]}:"],
                               "target": ["--speculation", "always", "--max-model-len", "480"]}) as trio:
        plain = generate_remote(trio.target_addr, PROMPT, sampling=GREEDY, stop=stop, mode="card",
                                timeout_s=120)
        cache = scrape(trio.metrics_ports["card-cache"])
        target = scrape(trio.metrics_ports["card-target"])
        assert plain.token_ids == want
        assert _switches(target) == (0, 0)
        assert labelled(cache, "card_cache_draft_pauses_total", action="pause") == 0

        out = generate_remote(trio.target_addr, PROMPT, sampling=GREEDY, stop=stop, mode="card-auto",
                              timeout_s=120)
        cache = scrape(trio.metrics_ports["card-cache"])
        target = scrape(trio.metrics_ports["card-target"])
    assert out.token_ids == want
    to_neural, to_model_free = _switches(target)
    # opened model-free (the worker paused), tried the worker, and judged it
    assert to_neural >= 1 and to_neural + to_model_free >= 2
    assert labelled(cache, "card_cache_draft_pauses_total", action="resume") >= 1
    assert metric(cache, "card_cache_lookup_chains_total") >= 1
    assert out.stats.draft_tokens > 0
