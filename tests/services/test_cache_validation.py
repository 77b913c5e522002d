"""The cache trusts no draft with a tree: a layer no drafter grows is dropped whole (one log line,
a counter), the stream and the session go on; prompts are bounded by the target's window and
vocabulary. A real card-cache server on a loopback port, real gRPC clients."""

from __future__ import annotations

import math

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from card.common.convert import layer_to_msg
from card.engine.shared.tree import MAX_LAYER_NODES, Layer, virtual_root_id
from tests.services.cache_helpers import expect_start, layer, rpc_error

VOCAB = 100
ROOT = virtual_root_id(0)


def malformed() -> float:
    return REGISTRY.get_sample_value("card_cache_layers_malformed_total") or 0.0


def tree_nodes(cache, session_id: str) -> int:
    (info,) = [s for s in cache.target.status().sessions if s.session_id == session_id]
    return info.tree_nodes


def nan_layer() -> Layer:
    good = layer([ROOT], [0], [5], [0.5])
    return Layer(good.parent_ids, good.node_ids, good.tokens, torch.tensor([math.nan]), good.b_parent_ids,
                 good.b_tokens, good.b_logp)


BAD = {
    "token past the vocabulary": layer([ROOT], [0], [VOCAB], [0.5]),
    "negative token": layer([ROOT], [0], [-1], [0.5]),
    "secondary token past the vocabulary": layer([ROOT], [0], [5], [0.5], b=[(ROOT, 10**9, 0.1)]),
    "repeated node id": layer([ROOT, ROOT], [0, 0], [5, 6], [0.5, 0.4]),
    "probability above 1": layer([ROOT], [0], [5], [2.0]),
    "NaN log-probability": nan_layer(),
    "too many nodes": layer([ROOT] * (MAX_LAYER_NODES + 1), range(MAX_LAYER_NODES + 1),
                            [7] * (MAX_LAYER_NODES + 1), [0.001] * (MAX_LAYER_NODES + 1)),
}


def test_layers_no_drafter_grows_are_dropped_and_the_session_goes_on(cache) -> None:
    draft = cache.draft("w1")
    sid = cache.target.open([1, 2, 3], vocab_size=VOCAB, context_window=64).session_id
    expect_start(draft)
    before = malformed()
    # all in one stream, a good layer last: each bad one is dropped, the stream goes on
    msgs = [layer_to_msg(sid, lay, draft.worker_id) for lay in BAD.values()]
    msgs.append(layer_to_msg(sid, layer([ROOT, ROOT], [0, 1], [5, 6], [0.6, 0.3]), draft.worker_id))
    assert draft.publish_msgs(msgs) == len(BAD) + 1
    assert malformed() - before == len(BAD)
    assert tree_nodes(cache, sid) == 2
    step = cache.target.step(sid, 0, next_token=5)  # a hit on node 0: speculation carries on
    assert step.outcome.value == "hit"


def test_prompts_are_bounded_by_the_targets_window_and_vocabulary(cache) -> None:
    err = rpc_error(cache.target.open, list(range(1, 65)), vocab_size=VOCAB, context_window=64)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "context window" in err.details()
    err = rpc_error(cache.target.open, [1, 2, VOCAB], vocab_size=VOCAB, context_window=64)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in err.details()
    assert cache.target.open(list(range(1, 64)), vocab_size=VOCAB, context_window=64).session_id


@pytest.mark.parametrize("name", list(BAD))
def test_layer_check_names_the_fault(name: str) -> None:
    from card.engine.shared.errors import InvalidArgument

    with pytest.raises(InvalidArgument):
        BAD[name].check(VOCAB)
    layer([ROOT], [0], [5], [0.5]).check(VOCAB)  # a well-formed layer passes


@pytest.mark.parametrize(("name", "capacity", "fault"), [
    ("x" * (1 << 20), 4, "name"), ("bad name/", 4, "name"), ("", 4, "name"),
    ("w", 0, "capacity"), ("w", -1, "capacity"), ("w", 10**6, "capacity"),
])
def test_registrations_are_bounded(cache, name: str, capacity: int, fault: str) -> None:
    from card.v1 import cache_pb2

    err = rpc_error(cache.target.stub.RegisterDraft, cache_pb2.RegisterDraftRequest(
        name=name, model="m", tokenizer_fingerprint="fp", capacity=capacity), timeout=10)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and fault in err.details()
    assert len(err.details()) < 300  # the message does not echo a megabyte back


def test_a_name_passes_to_a_new_worker_only_once_its_holder_is_gone() -> None:
    from card.cache_service.assignment import Assignments
    from card.cache_service.registry import DraftRegistration
    from card.engine.shared.errors import AlreadyExists

    assignments = Assignments()
    reg = DraftRegistration(name="w", model="m", fingerprint="fp", capacity=2)
    first, replaced = assignments.register(reg, live_s=0.2)
    assert replaced is None
    with pytest.raises(AlreadyExists):  # it heartbeats (registration counts as one)
        assignments.register(reg, live_s=0.2)
    first.streaming = True  # its Commands stream is open: live whatever the heartbeat says
    first.last_heartbeat -= 10
    with pytest.raises(AlreadyExists):
        assignments.register(reg, live_s=0.2)
    first.streaming = False  # no stream and three heartbeats missed: gone
    second, replaced = assignments.register(reg, live_s=0.2)
    assert replaced is first and first.closed and assignments.get(second.worker_id) is second
