"""End to end with the real SmolLM2-135M-Instruct (Q4_1 GGUF): the default pair, the target in
float32 and the same model as an int8 draft, through the entry points, against in-process vanilla.
The target speculates throughout (--speculation always): under its default (auto) a loaded machine
may decide plain decoding pays and serve the second request without the draft this test checks.
Slow: three processes dequantize the GGUF (~40 s each on a busy 2-core machine)."""

from __future__ import annotations

import pytest

from card.client.remote import generate_remote
from card.client.trio import LocalTrio
from card.engine.loading.models import ModelConfig, load_model
from card.engine.shared.config import SamplingParams, StopParams
from tests.services.e2e_support import torch_threads, vanilla_reference

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
]

PROMPT = "Explain in two sentences why the sky is blue."
STOP = StopParams(32)


@pytest.fixture(scope="module")
def trio(redis_server, tmp_path_factory, smollm2_gguf):
    with LocalTrio(speculation="always", target_model=str(smollm2_gguf), draft_model=str(smollm2_gguf),
                   draft_quantize="int8", draft_name="smollm2-int8", target_threads=1, draft_threads=1,
                   log_dir=tmp_path_factory.mktemp("e2e-smollm2-logs"), redis_url=redis_server.url,
                   start_timeout_s=400) as trio:
        yield trio


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    run = vanilla_reference(load_model(ModelConfig(str(smollm2_gguf), exact=True)))

    def one_thread(*args):
        with torch_threads(1):  # the target process runs one thread: same reduction order
            return run(*args)

    return one_thread


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=11)],
                         ids=["greedy", "seeded"])
def test_smollm2_trio_equals_in_process_vanilla(trio, reference, sampling):
    remote = generate_remote(trio.target_addr, PROMPT, sampling=sampling, stop=STOP, timeout_s=300)
    ref = reference(PROMPT, sampling, STOP)
    assert remote.token_ids == ref.token_ids
    assert remote.text == ref.text and remote.finish_reason == ref.finish_reason
    assert remote.draft == "smollm2-int8"
    assert remote.stats.step_rtt_ms  # it went through the cache
