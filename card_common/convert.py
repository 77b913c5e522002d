"""Engine values <-> card.v1 messages (and the HTTP usage's statistics). Every crossing of the
wire goes through here."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from card.common.tensors import DTYPES, from_tensor_msg, ids_from_msg, ids_to_msg, to_tensor_msg
from card.engine.shared.commands import AdvanceDraft, DraftCommand, StartDraft, StopDraft
from card.engine.shared.config import (
    MAX_LOGIT_BIAS_ENTRIES,
    ChainDraw,
    ChainPolicy,
    Constraint,
    SamplingParams,
    Verify,
)
from card.engine.shared.errors import InvalidArgument
from card.engine.shared.session import StepResult
from card.engine.shared.stats import GenerationStats
from card.engine.shared.tree import Advance, Chain, Correction, Layer, Outcome, Proposal
from card.engine.target.chain_source import DraftKind
from card.engine.target.verify import TokenLogprob
from card.v1 import cache_pb2, common_pb2, target_pb2

# ---- outcome ----------------------------------------------------------------------------------
_OUTCOMES: dict[Outcome, common_pb2.Outcome] = {
    Outcome.HIT: common_pb2.OUTCOME_HIT,
    Outcome.SECONDARY_HIT: common_pb2.OUTCOME_SECONDARY_HIT,
    Outcome.MISS: common_pb2.OUTCOME_MISS,
}
_FROM_PROTO: dict[int, Outcome] = {v: k for k, v in _OUTCOMES.items()}


def outcome_to_proto(outcome: Outcome | None) -> common_pb2.Outcome:
    return common_pb2.OUTCOME_UNSPECIFIED if outcome is None else _OUTCOMES[outcome]


def outcome_from_proto(value: int) -> Outcome | None:
    return _FROM_PROTO.get(value)


# ---- layer (draft -> cache) -------------------------------------------------------------------
def layer_to_msg(session_id: str, layer: Layer, worker_id: str = "", draft_forwards: int = 0,
                 draft_idle_s: float = 0.0) -> cache_pb2.LayerMessage:
    return cache_pb2.LayerMessage(
        worker_id=worker_id,
        session_id=session_id,
        epoch=layer.epoch,
        parent_ids=to_tensor_msg(layer.parent_ids, "int64"),
        node_ids=to_tensor_msg(layer.node_ids, "int64"),
        tokens=to_tensor_msg(layer.tokens, "int64"),
        local_logp=to_tensor_msg(layer.local_logp, "float32"),
        b_parent_ids=to_tensor_msg(layer.b_parent_ids, "int64"),
        b_tokens=to_tensor_msg(layer.b_tokens, "int64"),
        b_logp=to_tensor_msg(layer.b_logp, "float32"),
        drawn=to_tensor_msg(layer.drawn, "bool") if layer.drawn is not None else None,
        draft_forwards=draft_forwards,
        draft_idle_s=draft_idle_s,
    )


def _column(msg: common_pb2.Tensor, dtype: str, name: str) -> torch.Tensor:
    if not msg.dtype and not msg.shape and not msg.data:
        return from_tensor_msg(common_pb2.Tensor(dtype=dtype, shape=[0]))
    t = from_tensor_msg(msg)
    if t.dim() != 1:
        raise InvalidArgument(f"layer column {name} must be 1-D, got shape {list(t.shape)}")
    return t.to(DTYPES[dtype])


def layer_from_msg(msg: cache_pb2.LayerMessage) -> Layer:
    """Decode a layer; InvalidArgument when its columns disagree in length."""
    cols = {
        name: _column(getattr(msg, name), dtype, name)
        for name, dtype in (("parent_ids", "int64"), ("node_ids", "int64"), ("tokens", "int64"),
                            ("local_logp", "float32"), ("b_parent_ids", "int64"),
                            ("b_tokens", "int64"), ("b_logp", "float32"))
    }
    n = {cols[c].numel() for c in ("parent_ids", "node_ids", "tokens", "local_logp")}
    m = {cols[c].numel() for c in ("b_parent_ids", "b_tokens", "b_logp")}
    if len(n) != 1 or len(m) != 1:
        raise InvalidArgument(
            f"layer of session {msg.session_id}: primary columns have lengths {sorted(n)} and "
            f"secondary columns {sorted(m)}; each group must agree"
        )
    drawn = None
    if msg.HasField("drawn"):
        drawn = from_tensor_msg(msg.drawn)
        if drawn.dtype != torch.bool or drawn.dim() != 1 or drawn.numel() != cols["node_ids"].numel():
            raise InvalidArgument(f"layer of session {msg.session_id}: drawn must be bool "
                                  f"[{cols['node_ids'].numel()}], got {drawn.dtype} {list(drawn.shape)}")
    return Layer(**cols, epoch=msg.epoch, drawn=drawn)


# ---- correction (target -> cache) and chain (cache -> target) ---------------------------------
_DRAFTERS = {None: cache_pb2.DRAFTER_NONE, DraftKind.LOOKUP: cache_pb2.DRAFTER_LOOKUP,
             DraftKind.WORKER: cache_pb2.DRAFTER_WORKER}


def drafter_to_msg(kind: DraftKind | None) -> cache_pb2.Drafter:
    return _DRAFTERS[kind]


def worker_off(drafter: cache_pb2.Drafter) -> bool:
    """The cache's side of ``Drafter``: no worker drafts for the session (none, or the lookup)."""
    return drafter in (cache_pb2.DRAFTER_NONE, cache_pb2.DRAFTER_LOOKUP)


def correction_to_msg(session_id: str, correction: Correction, drafter: DraftKind | None = DraftKind.WORKER
                      ) -> cache_pb2.StepRequest:
    return cache_pb2.StepRequest(
        session_id=session_id,
        drafter=_DRAFTERS[drafter],
        epoch=correction.epoch,
        accepted_tokens=ids_to_msg(correction.accepted_tokens),
        accepted_node_ids=ids_to_msg(correction.accepted_node_ids),
        next_token=correction.next_token,
    )


def correction_from_msg(msg: cache_pb2.StepRequest) -> Correction:
    return Correction(
        epoch=msg.epoch,
        accepted_tokens=tuple(ids_from_msg(msg.accepted_tokens)),
        accepted_node_ids=tuple(ids_from_msg(msg.accepted_node_ids)),
        next_token=msg.next_token,
    )


def chain_to_msg(chain: Chain, outcome: Outcome | None = None) -> cache_pb2.StepResponse:
    msg = cache_pb2.StepResponse(
        epoch=chain.epoch,
        chain_tokens=ids_to_msg(chain.tokens),
        chain_node_ids=ids_to_msg(chain.node_ids),
        outcome=outcome_to_proto(outcome),
    )
    if chain.proposal is not None:
        msg.chain_q_tokens.CopyFrom(to_tensor_msg(chain.proposal.tokens, "int64"))
        msg.chain_q_probs.CopyFrom(to_tensor_msg(chain.proposal.probs, "float64"))
    return msg


def step_result_from_msg(msg: cache_pb2.StepResponse) -> StepResult:
    """The chain and the verdict on the correction, as ``ChainSource.step`` returns them. A
    proposal's values are the target's to judge (engine.target.verify.proposal_holds): one that
    does not hold up is verified exactly, which is lossless whatever the chain."""
    tokens = tuple(ids_from_msg(msg.chain_tokens))
    node_ids = tuple(ids_from_msg(msg.chain_node_ids))
    if len(tokens) != len(node_ids):
        raise InvalidArgument(f"chain has {len(tokens)} tokens but {len(node_ids)} node ids")
    proposal = None
    if msg.HasField("chain_q_tokens") or msg.HasField("chain_q_probs"):
        q_tokens, q_probs = from_tensor_msg(msg.chain_q_tokens), from_tensor_msg(msg.chain_q_probs)
        if (q_tokens.dim() != 2 or q_tokens.shape != q_probs.shape or q_tokens.shape[0] != len(tokens)
                or q_tokens.dtype != torch.int64 or q_probs.dtype != torch.float64):
            raise InvalidArgument(f"a drawn chain of {len(tokens)} tokens needs int64 and float64 "
                                  f"[{len(tokens)}, w] proposals, got {q_tokens.dtype} "
                                  f"{list(q_tokens.shape)} and {q_probs.dtype} {list(q_probs.shape)}")
        proposal = Proposal(q_tokens, q_probs)
    return StepResult(Chain(tokens, node_ids, msg.epoch, proposal), outcome_from_proto(msg.outcome))


def chain_draw_to_msg(draw: ChainDraw) -> cache_pb2.ChainDraw:
    return cache_pb2.ChainDraw(temperature=draw.temperature, seed=draw.seed)


def chain_draw_from_msg(msg: cache_pb2.ChainDraw) -> ChainDraw:
    """Validated here, at the cache's edge (InvalidArgument)."""
    return ChainDraw(float(msg.temperature), int(msg.seed))


# ---- advance (cache -> draft) -----------------------------------------------------------------
def advance_to_msg(session_id: str, advance: Advance) -> cache_pb2.AdvanceSession:
    return cache_pb2.AdvanceSession(
        session_id=session_id,
        epoch=advance.epoch,
        accepted_tokens=ids_to_msg(advance.accepted_tokens),
        accepted_node_ids=ids_to_msg(advance.accepted_node_ids),
        next_token=advance.next_token,
        outcome=outcome_to_proto(advance.outcome),
        hit_node_id=-1 if advance.hit_node_id is None else advance.hit_node_id,
    )


def advance_from_msg(msg: cache_pb2.AdvanceSession) -> Advance:
    outcome = outcome_from_proto(msg.outcome)
    if outcome is None:
        raise InvalidArgument(f"advance for session {msg.session_id} carries no outcome")
    return Advance(
        epoch=msg.epoch,
        accepted_tokens=tuple(ids_from_msg(msg.accepted_tokens)),
        accepted_node_ids=tuple(ids_from_msg(msg.accepted_node_ids)),
        next_token=msg.next_token,
        outcome=outcome,
        hit_node_id=None if msg.hit_node_id < 0 else msg.hit_node_id,
    )


# ---- draft commands (cache -> draft) ----------------------------------------------------------
def command_to_msg(cmd: DraftCommand) -> cache_pb2.DraftCommand:
    match cmd:
        case StartDraft():
            return cache_pb2.DraftCommand(start=cache_pb2.StartSession(
                session_id=cmd.session_id, committed_ids=ids_to_msg(cmd.committed), epoch=cmd.epoch,
                draw=chain_draw_to_msg(cmd.draw) if cmd.draw is not None else None))
        case AdvanceDraft():
            return cache_pb2.DraftCommand(advance=advance_to_msg(cmd.session_id, cmd.advance))
        case StopDraft():
            return cache_pb2.DraftCommand(stop=cache_pb2.StopSession(session_id=cmd.session_id))
    raise TypeError(f"not a draft command: {cmd!r}")


def command_from_msg(msg: cache_pb2.DraftCommand) -> DraftCommand:
    """InvalidArgument when the command carries none of start / advance / stop."""
    kind = msg.WhichOneof("command")
    if kind == "start":
        start = msg.start
        draw = chain_draw_from_msg(start.draw) if start.HasField("draw") else None
        return StartDraft(start.session_id, tuple(ids_from_msg(start.committed_ids)), start.epoch, draw)
    if kind == "advance":
        return AdvanceDraft(msg.advance.session_id, advance_from_msg(msg.advance))
    if kind == "stop":
        return StopDraft(msg.stop.session_id)
    raise InvalidArgument("draft command carries none of start / advance / stop")


# ---- sampling and stats -----------------------------------------------------------------------
def _f32(x: float) -> float:
    # the wire holds float32: 0.9 arrives as 0.899999976...; take the shortest decimal that maps
    # to the same float32 so a remote generation uses exactly the value the user typed
    return float(str(np.float32(x)))


def sampling_to_msg(params: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed,
        min_p=params.min_p, repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        logit_bias=dict(params.logit_bias), min_tokens=params.min_tokens,
        constraint=(common_pb2.Constraint(kind=params.constraint.kind, text=params.constraint.text)
                    if params.constraint is not None else None),
    )


def sampling_from_msg(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Validated params (InvalidArgument on bad values). An unset top_p or repetition_penalty
    means 1.0; a set one, 0 included, is checked as given. The entries of logit_bias are counted
    before they are copied (SamplingParams checks the bound again)."""
    top_p = _f32(msg.top_p) if msg.HasField("top_p") else 1.0
    repetition = _f32(msg.repetition_penalty) if msg.HasField("repetition_penalty") else 1.0
    if (entries := len(msg.logit_bias)) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidArgument(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {entries}")
    return SamplingParams(
        temperature=_f32(msg.temperature), top_k=msg.top_k, top_p=top_p, seed=msg.seed,
        min_p=_f32(msg.min_p), repetition_penalty=repetition, presence_penalty=_f32(msg.presence_penalty),
        frequency_penalty=_f32(msg.frequency_penalty),
        logit_bias=tuple((int(t), _f32(b)) for t, b in msg.logit_bias.items()), min_tokens=msg.min_tokens,
        constraint=(Constraint(msg.constraint.kind, msg.constraint.text) if msg.HasField("constraint")
                    else None),
    )


# Every GenerationStats field crosses the wire under its own name (card.v1 GenerationStats holds
# one field of the same name each; tests/services/test_card_common.py holds them equal): a new
# statistic is one dataclass field and one proto field. The HTTP usage's ``card`` object names
# loose_kept for what it counts, and leaves out the per-forward lists (a reply stays bounded; the
# histogram rides in ``metrics.speculative_decoding``).
_HTTP_NAMES = {"loose_kept": "loose_kept_tokens"}


def stats_to_msg(stats: GenerationStats) -> common_pb2.GenerationStats:
    return common_pb2.GenerationStats(**{f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)})


def stats_from_msg(msg: common_pb2.GenerationStats) -> GenerationStats:
    """Repeated fields as lists; an empty string as the field's default (proto3 cannot tell unset
    from empty, and an older peer leaves a newer field unset)."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(GenerationStats):
        value = getattr(msg, f.name)
        if f.default_factory is list:
            value = list(value)
        elif isinstance(f.default, str):
            value = value or f.default
        values[f.name] = value
    return GenerationStats(**values)


def stats_to_json(stats: GenerationStats) -> dict[str, Any]:
    """The HTTP usage's ``card`` object: every statistic and derived figure but the lists."""
    return {_HTTP_NAMES.get(k, k): v for k, v in stats.to_dict().items() if not isinstance(v, list)}


# ---- logprobs and the acceptance rule (target <-> client) ---------------------------------------
def logprobs_to_msg(logprobs: Sequence[TokenLogprob]) -> list[target_pb2.TokenLogprob]:
    return [target_pb2.TokenLogprob(token=lp.token, logprob=lp.logprob, top_tokens=[t for t, _ in lp.top],
                                    top_logprobs=[v for _, v in lp.top]) for lp in logprobs]


def logprobs_from_msg(msgs: Sequence[target_pb2.TokenLogprob]) -> list[TokenLogprob]:
    return [TokenLogprob(m.token, m.logprob, tuple(zip(m.top_tokens, m.top_logprobs, strict=False)))
            for m in msgs]


def verify_to_msg(mode: Verify, entropy_threshold: float | None = None,
                  window: int | None = None) -> target_pb2.VerifyPolicy:
    """The request's rule; thresholds left unset are the target's own (--loose-*)."""
    msg = target_pb2.VerifyPolicy(mode=mode.value)
    if entropy_threshold is not None:
        msg.entropy_threshold = entropy_threshold
    if window is not None:
        msg.window = window
    return msg


# ---- chain policy (client -> target -> cache) -------------------------------------------------
def chain_policy_to_msg(policy: ChainPolicy) -> common_pb2.ChainPolicy:
    msg = common_pb2.ChainPolicy()
    if policy.max_chain is not None:
        msg.max_chain = policy.max_chain
    if policy.min_path_prob is not None:
        msg.min_path_prob = policy.min_path_prob
    if policy.b_extension is not None:
        msg.b_extension = policy.b_extension
    return msg


def chain_policy_from_msg(msg: common_pb2.ChainPolicy) -> ChainPolicy:
    return ChainPolicy(
        max_chain=msg.max_chain if msg.HasField("max_chain") else None,
        min_path_prob=_f32(msg.min_path_prob) if msg.HasField("min_path_prob") else None,
        b_extension=msg.b_extension if msg.HasField("b_extension") else None,
    )
