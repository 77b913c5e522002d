"""Model-free and cascade drafts through the services, started as a user starts them:
``card-draft --model ngram --tokenizer TARGET`` and ``card-draft --model DRAFT --cascade ngram``
beside a tiny float64 target (the real SmolLM2 tokenizer), redis-server and card-cache, all as
subprocesses on loopback ports. Every output equals in-process vanilla, greedy and seeded
sampling, also with the model-free worker SIGKILLed mid-generation."""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from card.client.remote import generate_remote
from card.client.trio import LocalTrio
from card.engine.shared.config import NgramConfig, SamplingParams, StopParams
from card.engine.shared.errors import FailedPrecondition
from tests.services.e2e_support import float64_reference
from tests.tiny_models import save_foreign_tokenizer_checkpoint, save_tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# text that repeats itself, so the n-gram tables have matches in the prompt and the tiny
# target's own loops give them more
PROMPTS = ("one two three four one two three four one two three",
           "def f(x): return x + 1\ndef g(x): return x + 1\ndef h(x): return",
           "red green blue red green blue red green",
           "the cat sat on the mat. the cat sat on the")
GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.8, top_k=40, seed=5)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("ngram-models")
    return {"target": save_tiny_checkpoint(root / "target", seed=0),
            "pert": save_tiny_checkpoint(root / "pert", seed=0, perturb=0.02),
            "foreign": save_foreign_tokenizer_checkpoint(root / "foreign", seed=0)}


@pytest.fixture(scope="module")
def trio(checkpoints, redis_server, tmp_path_factory):
    trio = LocalTrio(speculation="always",
                     target_model=str(checkpoints["target"]), draft_model="ngram", draft_name="ngram",
                     ngram=NgramConfig(max_order=3, min_order=1, table_mb=4.0), target_threads=1,
                     draft_threads=1, dtype="float64", log_dir=tmp_path_factory.mktemp("ngram-logs"),
                     redis_url=redis_server.url, start_timeout_s=240,
                     extra_args={"cache": ["--redis-prefix", "e2e-ngram:"]})
    with trio:
        trio.start_draft(str(checkpoints["pert"]), name="cascade", args=["--cascade", "ngram"])
        trio.start_draft("ngram", name="ngram-foreign", args=["--tokenizer", str(checkpoints["foreign"])])
        yield trio


@pytest.fixture(scope="module")
def reference(checkpoints):
    return float64_reference(checkpoints["target"])


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("draft", ["ngram", "cascade"])
def test_outputs_equal_in_process_vanilla(trio, reference, draft, sampling):
    stop = StopParams(96, ignore_eos=True)
    accepted = 0
    for prompt in PROMPTS:
        remote = generate_remote(trio.target_addr, prompt, sampling=sampling, stop=stop, draft=draft,
                                 timeout_s=120)
        assert remote.draft == draft
        assert remote.token_ids == reference(prompt, sampling, stop).token_ids, prompt
        accepted += sum(remote.stats.accepted_lengths)
    # the test could not see a wrong drafted token if none were ever accepted
    assert accepted > 0


def test_model_free_draft_for_another_tokenizer_is_refused(trio):
    with pytest.raises(FailedPrecondition, match="tokenizer"):
        generate_remote(trio.target_addr, PROMPTS[0], stop=StopParams(4), draft="ngram-foreign", timeout_s=60)


def test_killing_the_model_free_draft_mid_generation_changes_nothing(trio, reference):
    """Four requests in flight on the model-free worker; it is SIGKILLed mid-generation: all
    finish, each exact; a new worker under the same name serves and speculates again."""
    victim = next(p for p in trio.drafts if p.name == "card-draft-ngram")
    stops = [StopParams(160 - 24 * i, ignore_eos=True) for i in range(4)]
    chunks: list[str] = []
    lock = threading.Lock()

    def on_text(text: str) -> None:
        with lock:
            chunks.append(text)
            if len(chunks) == 20:
                victim.proc.send_signal(signal.SIGKILL)
                victim.proc.wait(10)

    samplings = [GREEDY, SEEDED, GREEDY, SEEDED]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(generate_remote, trio.target_addr, PROMPTS[i], sampling=samplings[i],
                               stop=stop, draft="ngram", on_text=on_text, timeout_s=240)
                   for i, stop in enumerate(stops)]
        results = [f.result() for f in futures]
    assert victim.proc.returncode == -signal.SIGKILL and len(chunks) > 20
    for i, (stop, remote) in enumerate(zip(stops, results, strict=True)):
        assert remote.token_ids == reference(PROMPTS[i], samplings[i], stop).token_ids
        assert remote.stats.new_tokens == stop.max_new_tokens
    trio.start_draft("ngram", name="ngram")
    stop = StopParams(96, ignore_eos=True)
    remote = generate_remote(trio.target_addr, PROMPTS[0], sampling=GREEDY, stop=stop, draft="ngram",
                             timeout_s=60)
    assert remote.token_ids == reference(PROMPTS[0], GREEDY, stop).token_ids
    assert sum(remote.stats.accepted_lengths) > 0
