"""Step latency of the cache service, in process and over loopback gRPC (DESIGN.md §8).

    python -m card.client.bench.step_latency [--width 4] [--depth 8] [--steps 300] [--device cpu]

Each round publishes a full tree (``depth`` layers of ``width`` nodes, the best child first),
then steps a hit on the root's best child (re-root + a ``depth - 1`` token chain) and a miss.
Prints p50/p95 of: apply_layer (the tree's, no decoding), Step (hit), Step (miss) in process; Step
round trips over gRPC.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import click
import grpc
import torch

from card.cache_service.config import CacheConfig
from card.cache_service.server import create_server
from card.common.channels import channel, wait_serving
from card.common.convert import correction_to_msg, layer_to_msg, step_result_from_msg
from card.common.tensors import ids_to_msg
from card.engine.shared.config import TreeParams
from card.engine.shared.tree import Correction, Layer, virtual_root_id
from card.v1 import cache_pb2, cache_pb2_grpc


def _layer(parents: list[int], ids: list[int], width: int) -> Layer:
    probs = [0.5 / (j + 1) for j in range(width)]
    return Layer(torch.tensor(parents), torch.tensor(ids), torch.arange(100, 100 + width),
                 torch.tensor([math.log(p) for p in probs], dtype=torch.float32),
                 torch.tensor(parents), torch.full((width,), 7), torch.full((width,), -5.0))


def _q(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"p50 {statistics.median(xs) * 1e3:.3f} ms, p95 {xs[int(0.95 * (len(xs) - 1))] * 1e3:.3f} ms"


def _rounds(steps: int, width: int, depth: int, publish: Callable[[Layer], None],
            step: Callable[[Correction], tuple[int, ...]]) -> tuple[list[float], list[float], list[float]]:
    layer_t, hit_t, miss_t = [], [], []
    epoch, nid = 0, 0
    for _ in range(steps):
        parents = [virtual_root_id(epoch)] * width
        for _ in range(depth):
            ids = list(range(nid, nid + width))
            nid += width
            t0 = time.perf_counter()
            publish(_layer(parents, ids, width))
            layer_t.append(time.perf_counter() - t0)
            parents = [ids[0]] * width
        t0 = time.perf_counter()
        chain_ids = step(Correction(epoch, (), (), 100))
        hit_t.append(time.perf_counter() - t0)
        assert len(chain_ids) == depth - 1, chain_ids
        epoch += 1
        t0 = time.perf_counter()
        step(Correction(epoch, tuple([100] * len(chain_ids)), chain_ids, 999))
        miss_t.append(time.perf_counter() - t0)
        epoch += 1
    return layer_t, hit_t, miss_t


@click.command()
@click.option("--width", default=4, show_default=True)
@click.option("--depth", default=8, show_default=True)
@click.option("--steps", default=300, show_default=True)
@click.option("--device", default="cpu", show_default=True)
def main(width: int, depth: int, steps: int, device: str) -> None:
    # no heartbeats here: the registration must outlive the run
    config = CacheConfig(port=0, redis_url="memory://", metrics_port=0, device=device,
                         heartbeat_interval_s=3600.0, tree=TreeParams(max_chain=depth, b_extension=False))
    server, port = create_server("127.0.0.1:0", config)
    server.start()
    addr = f"127.0.0.1:{port}"
    wait_serving(addr, 30)
    with channel(addr) as ch:
        stub = cache_pb2_grpc.CacheServiceStub(ch)
        worker_id = stub.RegisterDraft(cache_pb2.RegisterDraftRequest(
            name="bench", model="bench", tokenizer_fingerprint="fp", capacity=0)).worker_id
        commands = stub.Commands(cache_pb2.CommandsRequest(worker_id=worker_id))
        sid = stub.OpenSession(cache_pb2.OpenSessionRequest(
            prompt_ids=ids_to_msg([1, 2, 3]), tokenizer_fingerprint="fp", target_model="bench")).session_id
        table = server.sessions

        def publish_local(layer: Layer) -> None:
            table.apply_layer(sid, worker_id, layer)

        def step_local(c: Correction) -> tuple[int, ...]:
            return table.step(sid, c)[0].node_ids

        local = _rounds(steps, width, depth, publish_local, step_local)
        stub.CloseSession(cache_pb2.CloseSessionRequest(session_id=sid))
        sid = stub.OpenSession(cache_pb2.OpenSessionRequest(
            prompt_ids=ids_to_msg([1, 2, 3]), tokenizer_fingerprint="fp", target_model="bench")).session_id

        def publish_rpc(layer: Layer) -> None:
            stub.PublishLayers(iter([layer_to_msg(sid, layer, worker_id)]))

        def step_rpc(c: Correction) -> tuple[int, ...]:
            return step_result_from_msg(stub.Step(correction_to_msg(sid, c), timeout=10)).chain.node_ids

        remote = _rounds(steps, width, depth, publish_rpc, step_rpc)
        commands.cancel()
    server.stop(0).wait()
    print(f"tree {width}x{depth}, device {device}, {steps} rounds, torch threads {torch.get_num_threads()}")
    print(f"in process  apply_layer {_q(local[0])}")
    print(f"in process  Step hit + re-root + chain {_q(local[1])}; Step miss {_q(local[2])}")
    print(f"gRPC        Step hit round trip {_q(remote[1])}; Step miss round trip {_q(remote[2])}")


if __name__ == "__main__":
    try:
        main()
    except grpc.RpcError as err:
        raise SystemExit(f"bench failed: {err}") from None
