"""Across hosts for real: Redis + card-cache, card-target and card-draft in three network
namespaces this test creates (veth pairs on a bridge, addresses of their own), tokens and mutual
TLS on every link, ``tc netem`` delays on the target's and the draft's links. Outputs are exact at
every delay. Skips where namespaces (or, for the delays, sch_netem) cannot be had.
Speed per delay is card-bench's to measure: ``python -m tests.services.netns --help``."""

from __future__ import annotations

import grpc
import pytest

from card.client.remote import generate_remote
from card.common.channels import channel
from card.engine.shared.config import SamplingParams, StopParams
from card.v1 import cache_pb2, cache_pb2_grpc
from tests.services.netns import NetnsTrio, Unsupported

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.mark.parametrize("delay_ms", [0, 1, 10])
def test_a_trio_across_three_hosts_is_exact_at_every_link_delay(delay_ms: float, tmp_path) -> None:
    from tests.tiny_models import save_tiny_checkpoint

    model = str(save_tiny_checkpoint(tmp_path / "model", seed=0))
    try:
        trio = NetnsTrio(model, model, dtype="float64", delay_ms=delay_ms, log_dir=tmp_path / "logs",
                         start_timeout_s=240, extra_args={"target": ["--speculation", "always"]})
    except Unsupported as exc:
        pytest.skip(str(exc))
    with trio:
        stop = StopParams(24, ignore_eos=True)
        for sampling in (SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95, seed=5)):
            card = generate_remote(trio.target_addr, "Name three colours.", sampling=sampling, stop=stop,
                                   tls=trio.tls)
            plain = generate_remote(trio.target_addr, "Name three colours.", sampling=sampling, stop=stop,
                                    mode="vanilla", tls=trio.tls)
            assert card.draft == "remote" and card.token_ids == plain.token_ids
            assert card.stats.step_rtt_ms and min(card.stats.step_rtt_ms) >= 2 * delay_ms
        # the cache host answers no one without a certificate, and no certificate without a token
        with channel(trio.cache_addr) as ch, pytest.raises(grpc.RpcError) as err:
            cache_pb2_grpc.CacheServiceStub(ch).Status(cache_pb2.StatusRequest(), timeout=10)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        with channel(trio.cache_addr, tls=trio.tls) as ch, pytest.raises(grpc.RpcError) as err:
            cache_pb2_grpc.CacheServiceStub(ch).Status(cache_pb2.StatusRequest(), timeout=10)
        assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
