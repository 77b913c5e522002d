"""card_common: the tensor codec, engine<->proto conversion, the error table on real calls."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import ClassVar

import grpc
import pytest
import torch

from card.common.channels import channel, wait_serving
from card.common.convert import (
    advance_from_msg,
    advance_to_msg,
    chain_policy_from_msg,
    chain_policy_to_msg,
    chain_to_msg,
    command_from_msg,
    command_to_msg,
    correction_from_msg,
    correction_to_msg,
    layer_from_msg,
    layer_to_msg,
    sampling_from_msg,
    sampling_to_msg,
    stats_from_msg,
    stats_to_json,
    stats_to_msg,
    step_result_from_msg,
)
from card.common.serving import add_health, make_server, set_serving
from card.common.status import STATUS_CODES, error_from_rpc, grpc_errors, http_status, status_code
from card.common.tensors import from_tensor_msg, ids_from_msg, ids_to_msg, to_tensor_msg
from card.engine.shared import errors
from card.engine.shared.commands import AdvanceDraft, StartDraft, StopDraft
from card.engine.shared.config import ChainPolicy, SamplingParams, TreeParams
from card.engine.shared.stats import GenerationStats
from card.engine.shared.tree import Advance, Chain, Correction, Layer, Outcome
from card.engine.target.chain_source import StepResult
from card.v1 import cache_pb2, cache_pb2_grpc, common_pb2


@pytest.mark.parametrize("dtype", ["int64", "int32", "float32", "float16", "bfloat16"])
def test_tensor_round_trip(dtype: str) -> None:
    x = (torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) - 7.5).to(getattr(torch, dtype))
    msg = to_tensor_msg(x, dtype)
    assert list(msg.shape) == [2, 3, 4] and len(msg.data) == x.numel() * x.element_size()
    assert torch.equal(from_tensor_msg(msg), x)
    empty = from_tensor_msg(to_tensor_msg([], dtype))
    assert empty.shape == (0,) and empty.dtype == getattr(torch, dtype)


def test_tensor_wire_format_is_little_endian() -> None:
    assert to_tensor_msg([1, 256], "int32").data == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert ids_to_msg([1, -1]).data == (1).to_bytes(8, "little") + (-1).to_bytes(8, "little", signed=True)


def test_tensor_validation() -> None:
    with pytest.raises(errors.InvalidArgument, match="needs 24 bytes, got 16"):
        from_tensor_msg(common_pb2.Tensor(dtype="int64", shape=[3], data=b"\0" * 16))
    with pytest.raises(errors.InvalidArgument, match="unsupported tensor dtype"):
        from_tensor_msg(common_pb2.Tensor(dtype="complex64", shape=[0]))
    with pytest.raises(errors.InvalidArgument, match="1-D"):
        ids_from_msg(to_tensor_msg(torch.zeros(2, 2, dtype=torch.int64), "int64"))
    with pytest.raises(errors.InvalidArgument, match="int64 or int32"):
        ids_from_msg(to_tensor_msg([1.0], "float32"))
    with pytest.raises(errors.InvalidArgument, match="needs 16 bytes"):
        ids_from_msg(common_pb2.Tensor(dtype="int64", shape=[2], data=b"\0" * 8))
    assert ids_from_msg(common_pb2.Tensor()) == []
    assert ids_from_msg(to_tensor_msg([5, -7], "int32")) == [5, -7]


def test_engine_values_round_trip() -> None:
    lay = Layer(torch.tensor([-2, -2]), torch.tensor([0, 1]), torch.tensor([5, 6]),
                torch.tensor([-0.25, -1.5]), torch.tensor([-2]), torch.tensor([7]), torch.tensor([-3.0]), 4)
    back = layer_from_msg(layer_to_msg("s", lay, "w", 3, 0.5))
    for name in ("parent_ids", "node_ids", "tokens", "local_logp", "b_parent_ids", "b_tokens", "b_logp"):
        assert torch.equal(getattr(back, name), getattr(lay, name)), name
    assert back.epoch == 4

    bad = layer_to_msg("s", lay)
    bad.tokens.CopyFrom(ids_to_msg([5]))
    with pytest.raises(errors.InvalidArgument, match="must agree"):
        layer_from_msg(bad)

    corr = Correction(3, (4, 5), (0, -1), 9)
    msg = correction_to_msg("s", corr)
    assert msg.session_id == "s" and correction_from_msg(msg) == corr

    for hit in (7, None):
        adv = Advance(2, (4,), (1,), 8, Outcome.HIT if hit is not None else Outcome.MISS, hit)
        assert advance_from_msg(advance_to_msg("s", adv)) == adv
    assert advance_to_msg("s", Advance(2, (), (), 8, Outcome.MISS)).hit_node_id == -1

    chain = Chain((1, 2), (5, -1), 6)
    result = step_result_from_msg(chain_to_msg(chain, Outcome.SECONDARY_HIT))
    assert type(result) is StepResult  # card.engine.target.chain_source's, the contract every source returns
    assert result.chain == chain and result.outcome is Outcome.SECONDARY_HIT
    assert step_result_from_msg(chain_to_msg(Chain(epoch=1))).outcome is None

    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=2**40)
    assert sampling_from_msg(sampling_to_msg(params)) == params  # float32 on the wire, exact back
    assert sampling_from_msg(common_pb2.SamplingParams()) == SamplingParams()
    with pytest.raises(errors.InvalidArgument, match="temperature"):
        sampling_from_msg(common_pb2.SamplingParams(temperature=-1.0))

    stats = GenerationStats(mode="card", prompt_tokens=3, new_tokens=9, wall_s=1.5, target_forwards=4,
                            hits=2, misses=1, step_rtt_ms=[0.5, 0.25], accepted_lengths=[1, 3, 5])
    assert stats_from_msg(stats_to_msg(stats)) == stats


def _every_stat_set() -> GenerationStats:
    """Every field away from its default and from every other field's value."""
    values: dict[str, object] = {}
    for i, f in enumerate(dataclasses.fields(GenerationStats), start=1):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        values[f.name] = {bool: not default, int: i, float: i + 0.5, str: f"s{i}", list: [i, i + 2]}[
            type(default)]
    return GenerationStats(**values)  # type: ignore[arg-type]


def test_every_generation_stat_crosses_each_wire() -> None:
    """A statistic is one dataclass field and one proto field: the conversions follow the fields,
    so a field the proto message lacks (or has beyond the dataclass), or one a conversion drops,
    fails here."""
    names = [f.name for f in dataclasses.fields(GenerationStats)]
    assert sorted(names) == sorted(common_pb2.GenerationStats.DESCRIPTOR.fields_by_name)
    stats = _every_stat_set()
    assert stats_from_msg(stats_to_msg(stats)) == stats
    http = stats_to_json(stats)  # the HTTP usage's card object
    assert not any(isinstance(v, list) for v in http.values())
    for name in names:
        if not isinstance(getattr(stats, name), list):
            assert http[{"loose_kept": "loose_kept_tokens"}.get(name, name)] == getattr(stats, name), name
    assert http["mean_accepted_length"] == stats.mean_accepted_length and http["lossy"] is False
    assert stats_from_msg(common_pb2.GenerationStats()).verify == "exact"  # an older peer's: unset
    # the control: a statistic the proto lacks fails the conversion loudly, it is not dropped
    wider = dataclasses.make_dataclass("Wider", [("novel_count", int, 1)], bases=(GenerationStats,))
    with pytest.raises(ValueError, match="novel_count"):
        stats_to_msg(wider())


@pytest.mark.parametrize("cmd", [
    StartDraft("s", (5, 17, 42), 3),
    StartDraft("s", (), 0),
    AdvanceDraft("s", Advance(4, (7, 8), (2, -1), 9, Outcome.MISS)),
    AdvanceDraft("s", Advance(2, (), (), 8, Outcome.HIT, 6)),
    StopDraft("s"),
], ids=["start", "start-empty", "advance-miss", "advance-hit", "stop"])
def test_draft_command_round_trip(cmd) -> None:
    msg = command_to_msg(cmd)
    assert msg.WhichOneof("command") == {StartDraft: "start", AdvanceDraft: "advance", StopDraft: "stop"}[
        type(cmd)]
    assert command_from_msg(msg) == cmd


def test_draft_command_validation() -> None:
    with pytest.raises(errors.InvalidArgument, match="none of start / advance / stop"):
        command_from_msg(cache_pb2.DraftCommand())
    with pytest.raises(TypeError):
        command_to_msg("start")  # type: ignore[arg-type]


def test_chain_policy_round_trip() -> None:
    assert chain_policy_from_msg(common_pb2.ChainPolicy()) == ChainPolicy()
    assert not chain_policy_to_msg(ChainPolicy()).ListFields()  # unset stays unset, not 0 / false
    for policy in (ChainPolicy(max_chain=0), ChainPolicy(b_extension=False), ChainPolicy(min_path_prob=0.0),
                   ChainPolicy(max_chain=3, min_path_prob=0.35, b_extension=True)):
        msg = chain_policy_to_msg(policy)
        assert {f.name for f, _ in msg.ListFields()} == {k for k, v in vars(policy).items() if v is not None}
        assert chain_policy_from_msg(msg) == policy  # 0.35 in float32, exact back
    # an unset field keeps the serving side's value; bad values are refused where it goes over
    tree = TreeParams(max_chain=6, min_path_prob=0.1, b_extension=True)
    assert chain_policy_from_msg(chain_policy_to_msg(ChainPolicy(max_chain=2))).over(tree) == TreeParams(
        max_chain=2, min_path_prob=0.1, b_extension=True)
    with pytest.raises(errors.InvalidArgument, match="min_path_prob"):
        chain_policy_from_msg(common_pb2.ChainPolicy(min_path_prob=2.0)).over(tree)


def test_the_cache_loads_no_model_code() -> None:
    """convert.py imports StepResult from card.engine.target.chain_source at the top: the cache process (and
    anything else that speaks the wire) never pulls in the drafter, the sources or transformers."""
    import subprocess
    import sys

    heavy = ("transformers", "card.engine.inprocess.sources", "card.engine.draft.drafter",
             "card.engine.loading.models")
    code = f"import sys, card.cache_service.server; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_status_table() -> None:
    assert status_code(errors.NotFound("x")) is grpc.StatusCode.NOT_FOUND
    assert status_code(ValueError("x")) is grpc.StatusCode.INTERNAL
    assert status_code(errors.CardError("x")) is grpc.StatusCode.INTERNAL
    assert len(set(STATUS_CODES.values())) == len(STATUS_CODES) == 8
    assert status_code(errors.Unauthenticated("no key")) is grpc.StatusCode.UNAUTHENTICATED
    assert http_status(errors.Unauthenticated("no key")) == 401
    for cls, code in STATUS_CODES.items():
        assert cls.code == code.name  # the engine's own names agree with the table


class _Raising(cache_pb2_grpc.CacheServiceServicer):
    """Raises whatever the request's session id names, from a unary and a streaming method."""

    ERRORS: ClassVar[dict[str, Exception]] = {
        "not_found": errors.NotFound("session x is not open"), "bug": ZeroDivisionError("oops"),
        "aborted": errors.Aborted("stale epoch 3"), "exhausted": errors.ResourceExhausted("full"),
    }

    @grpc_errors
    def CloseSession(self, request, context):
        raise self.ERRORS[request.session_id]

    @grpc_errors
    def Commands(self, request, context):
        yield cache_pb2.DraftCommand(stop=cache_pb2.StopSession(session_id="first"))
        raise self.ERRORS[request.worker_id]


@pytest.fixture
def raising_server() -> Iterator[str]:
    server = make_server(4)
    cache_pb2_grpc.add_CacheServiceServicer_to_server(_Raising(), server)
    health = add_health(server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    set_serving(health, True, ["card.v1.CacheService"])
    yield f"127.0.0.1:{port}"
    server.stop(0).wait()


@pytest.mark.parametrize(("key", "code", "cls"), [
    ("not_found", grpc.StatusCode.NOT_FOUND, errors.NotFound),
    ("aborted", grpc.StatusCode.ABORTED, errors.Aborted),
    ("exhausted", grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted),
    ("bug", grpc.StatusCode.INTERNAL, errors.CardError),
])
def test_grpc_errors_on_real_calls(raising_server: str, key: str, code: grpc.StatusCode, cls: type) -> None:
    wait_serving(raising_server, 10, "card.v1.CacheService")
    with channel(raising_server) as ch:
        stub = cache_pb2_grpc.CacheServiceStub(ch)
        with pytest.raises(grpc.RpcError) as unary:
            stub.CloseSession(cache_pb2.CloseSessionRequest(session_id=key), timeout=10)
        stream = stub.Commands(cache_pb2.CommandsRequest(worker_id=key), timeout=10)
        assert next(stream).stop.session_id == "first"
        with pytest.raises(grpc.RpcError) as streamed:
            next(stream)
    for err in (unary.value, streamed.value):
        assert err.code() is code
        back = error_from_rpc(err, raising_server)
        assert type(back) is cls
        if key == "bug":
            assert "ZeroDivisionError" in err.details()
        else:
            assert str(back) == str(_Raising.ERRORS[key])


def test_unreachable_peer_is_unavailable() -> None:
    from tests.services.conftest import free_port

    addr = f"127.0.0.1:{free_port()}"
    with channel(addr) as ch, pytest.raises(grpc.RpcError) as info:
        cache_pb2_grpc.CacheServiceStub(ch).Status(cache_pb2.StatusRequest(), timeout=2)
    back = error_from_rpc(info.value, addr)
    assert isinstance(back, errors.Unavailable) and addr in str(back)
    with pytest.raises(errors.Unavailable, match=addr):
        wait_serving(addr, 0.5)


def test_log_formatters() -> None:
    import json
    import logging

    from card.common.serving import JsonFormatter, TextFormatter

    record = logging.LogRecord("card.x", logging.WARNING, __file__, 1, "session %s ended", ("s1",), None)
    record.session_id = "s1"
    entry = json.loads(JsonFormatter().format(record))
    assert entry["level"] == "WARNING" and entry["logger"] == "card.x" and entry["msg"] == "session s1 ended"
    assert entry["session_id"] == "s1" and entry["ts"].endswith("+00:00")
    assert TextFormatter().format(record).endswith("card.x: session s1 ended session_id=s1")


def test_top_p_zero_is_refused_not_taken_as_one() -> None:
    from card.common.convert import sampling_from_msg
    from card.engine.shared.errors import InvalidArgument
    from card.v1 import common_pb2

    assert sampling_from_msg(common_pb2.SamplingParams(temperature=0.5)).top_p == 1.0  # unset
    with pytest.raises(InvalidArgument, match="top_p"):
        sampling_from_msg(common_pb2.SamplingParams(temperature=0.5, top_p=0.0))
