from card.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Drafter(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFTER_UNSPECIFIED: _ClassVar[Drafter]
    DRAFTER_NONE: _ClassVar[Drafter]
    DRAFTER_LOOKUP: _ClassVar[Drafter]
    DRAFTER_WORKER: _ClassVar[Drafter]
DRAFTER_UNSPECIFIED: Drafter
DRAFTER_NONE: Drafter
DRAFTER_LOOKUP: Drafter
DRAFTER_WORKER: Drafter

class OpenSessionRequest(_message.Message):
    __slots__ = ("prompt_ids", "tokenizer_fingerprint", "target_model", "draft", "chain", "vocab_size", "context_window", "idle_timeout_ms", "draw", "default_pool", "drafter")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    DRAW_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_POOL_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _common_pb2.Tensor
    tokenizer_fingerprint: str
    target_model: str
    draft: str
    chain: _common_pb2.ChainPolicy
    vocab_size: int
    context_window: int
    idle_timeout_ms: int
    draw: ChainDraw
    default_pool: str
    drafter: Drafter
    def __init__(self, prompt_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., tokenizer_fingerprint: _Optional[str] = ..., target_model: _Optional[str] = ..., draft: _Optional[str] = ..., chain: _Optional[_Union[_common_pb2.ChainPolicy, _Mapping]] = ..., vocab_size: _Optional[int] = ..., context_window: _Optional[int] = ..., idle_timeout_ms: _Optional[int] = ..., draw: _Optional[_Union[ChainDraw, _Mapping]] = ..., default_pool: _Optional[str] = ..., drafter: _Optional[_Union[Drafter, str]] = ...) -> None: ...

class ChainDraw(_message.Message):
    __slots__ = ("temperature", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "draft")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    draft: str
    def __init__(self, session_id: _Optional[str] = ..., draft: _Optional[str] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("session_id", "epoch", "accepted_tokens", "accepted_node_ids", "next_token", "drafter")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    accepted_tokens: _common_pb2.Tensor
    accepted_node_ids: _common_pb2.Tensor
    next_token: int
    drafter: Drafter
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., accepted_tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., accepted_node_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., next_token: _Optional[int] = ..., drafter: _Optional[_Union[Drafter, str]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("epoch", "chain_tokens", "chain_node_ids", "outcome", "draft_forwards", "draft_idle_s", "chain_q_tokens", "chain_q_probs", "draft")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CHAIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHAIN_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_IDLE_S_FIELD_NUMBER: _ClassVar[int]
    CHAIN_Q_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHAIN_Q_PROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    chain_tokens: _common_pb2.Tensor
    chain_node_ids: _common_pb2.Tensor
    outcome: _common_pb2.Outcome
    draft_forwards: int
    draft_idle_s: float
    chain_q_tokens: _common_pb2.Tensor
    chain_q_probs: _common_pb2.Tensor
    draft: str
    def __init__(self, epoch: _Optional[int] = ..., chain_tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., chain_node_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., outcome: _Optional[_Union[_common_pb2.Outcome, str]] = ..., draft_forwards: _Optional[int] = ..., draft_idle_s: _Optional[float] = ..., chain_q_tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., chain_q_probs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., draft: _Optional[str] = ...) -> None: ...

class StepBatchRequest(_message.Message):
    __slots__ = ("steps", "keepalive_session_ids")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[StepRequest]
    keepalive_session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, steps: _Optional[_Iterable[_Union[StepRequest, _Mapping]]] = ..., keepalive_session_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("ok", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: StepResponse
    error: StepError
    def __init__(self, ok: _Optional[_Union[StepResponse, _Mapping]] = ..., error: _Optional[_Union[StepError, _Mapping]] = ...) -> None: ...

class StepBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StepResult]
    def __init__(self, results: _Optional[_Iterable[_Union[StepResult, _Mapping]]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id", "stats")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    stats: _common_pb2.GenerationStats
    def __init__(self, session_id: _Optional[str] = ..., stats: _Optional[_Union[_common_pb2.GenerationStats, _Mapping]] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("draft_forwards", "draft_idle_s")
    DRAFT_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_IDLE_S_FIELD_NUMBER: _ClassVar[int]
    draft_forwards: int
    draft_idle_s: float
    def __init__(self, draft_forwards: _Optional[int] = ..., draft_idle_s: _Optional[float] = ...) -> None: ...

class RegisterDraftRequest(_message.Message):
    __slots__ = ("name", "model", "tokenizer_fingerprint", "capacity", "pool")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    name: str
    model: str
    tokenizer_fingerprint: str
    capacity: int
    pool: str
    def __init__(self, name: _Optional[str] = ..., model: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., capacity: _Optional[int] = ..., pool: _Optional[str] = ...) -> None: ...

class RegisterDraftResponse(_message.Message):
    __slots__ = ("worker_id", "heartbeat_interval_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    heartbeat_interval_s: float
    def __init__(self, worker_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class CommandsRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DraftCommand(_message.Message):
    __slots__ = ("start", "advance", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    ADVANCE_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: StartSession
    advance: AdvanceSession
    stop: StopSession
    def __init__(self, start: _Optional[_Union[StartSession, _Mapping]] = ..., advance: _Optional[_Union[AdvanceSession, _Mapping]] = ..., stop: _Optional[_Union[StopSession, _Mapping]] = ...) -> None: ...

class StartSession(_message.Message):
    __slots__ = ("session_id", "committed_ids", "epoch", "draw")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_IDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DRAW_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    committed_ids: _common_pb2.Tensor
    epoch: int
    draw: ChainDraw
    def __init__(self, session_id: _Optional[str] = ..., committed_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., epoch: _Optional[int] = ..., draw: _Optional[_Union[ChainDraw, _Mapping]] = ...) -> None: ...

class AdvanceSession(_message.Message):
    __slots__ = ("session_id", "epoch", "accepted_tokens", "accepted_node_ids", "next_token", "outcome", "hit_node_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    HIT_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    accepted_tokens: _common_pb2.Tensor
    accepted_node_ids: _common_pb2.Tensor
    next_token: int
    outcome: _common_pb2.Outcome
    hit_node_id: int
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., accepted_tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., accepted_node_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., next_token: _Optional[int] = ..., outcome: _Optional[_Union[_common_pb2.Outcome, str]] = ..., hit_node_id: _Optional[int] = ...) -> None: ...

class StopSession(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class LayerMessage(_message.Message):
    __slots__ = ("worker_id", "session_id", "epoch", "parent_ids", "node_ids", "tokens", "local_logp", "b_parent_ids", "b_tokens", "b_logp", "drawn", "draft_forwards", "draft_idle_s", "dropped")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PARENT_IDS_FIELD_NUMBER: _ClassVar[int]
    NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_LOGP_FIELD_NUMBER: _ClassVar[int]
    B_PARENT_IDS_FIELD_NUMBER: _ClassVar[int]
    B_TOKENS_FIELD_NUMBER: _ClassVar[int]
    B_LOGP_FIELD_NUMBER: _ClassVar[int]
    DRAWN_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_IDLE_S_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    session_id: str
    epoch: int
    parent_ids: _common_pb2.Tensor
    node_ids: _common_pb2.Tensor
    tokens: _common_pb2.Tensor
    local_logp: _common_pb2.Tensor
    b_parent_ids: _common_pb2.Tensor
    b_tokens: _common_pb2.Tensor
    b_logp: _common_pb2.Tensor
    drawn: _common_pb2.Tensor
    draft_forwards: int
    draft_idle_s: float
    dropped: bool
    def __init__(self, worker_id: _Optional[str] = ..., session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., parent_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., node_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., local_logp: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., b_parent_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., b_tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., b_logp: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., drawn: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., draft_forwards: _Optional[int] = ..., draft_idle_s: _Optional[float] = ..., dropped: _Optional[bool] = ...) -> None: ...

class PublishLayersResponse(_message.Message):
    __slots__ = ("layers_received",)
    LAYERS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    layers_received: int
    def __init__(self, layers_received: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "active_sessions", "draining")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    active_sessions: int
    draining: bool
    def __init__(self, worker_id: _Optional[str] = ..., active_sessions: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftInfo(_message.Message):
    __slots__ = ("name", "model", "tokenizer_fingerprint", "capacity", "active_sessions", "last_heartbeat_unix", "pool", "draining", "live")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    name: str
    model: str
    tokenizer_fingerprint: str
    capacity: int
    active_sessions: int
    last_heartbeat_unix: float
    pool: str
    draining: bool
    live: bool
    def __init__(self, name: _Optional[str] = ..., model: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., capacity: _Optional[int] = ..., active_sessions: _Optional[int] = ..., last_heartbeat_unix: _Optional[float] = ..., pool: _Optional[str] = ..., draining: _Optional[bool] = ..., live: _Optional[bool] = ...) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("name", "weight", "workers", "live_workers", "capacity", "active_sessions", "steps", "chains", "chain_tokens", "accepted_tokens", "committed_tokens", "hits", "busy_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    CHAINS_FIELD_NUMBER: _ClassVar[int]
    CHAIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: float
    workers: int
    live_workers: int
    capacity: int
    active_sessions: int
    steps: int
    chains: int
    chain_tokens: int
    accepted_tokens: int
    committed_tokens: int
    hits: int
    busy_s: float
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[float] = ..., workers: _Optional[int] = ..., live_workers: _Optional[int] = ..., capacity: _Optional[int] = ..., active_sessions: _Optional[int] = ..., steps: _Optional[int] = ..., chains: _Optional[int] = ..., chain_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., committed_tokens: _Optional[int] = ..., hits: _Optional[int] = ..., busy_s: _Optional[float] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("name", "pool", "resume")
    NAME_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    name: str
    pool: str
    resume: bool
    def __init__(self, name: _Optional[str] = ..., pool: _Optional[str] = ..., resume: _Optional[bool] = ...) -> None: ...

class PoolWeightsRequest(_message.Message):
    __slots__ = ("weights",)
    class WeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    weights: _containers.ScalarMap[str, float]
    def __init__(self, weights: _Optional[_Mapping[str, float]] = ...) -> None: ...

class PoolWeightsResponse(_message.Message):
    __slots__ = ("weights",)
    class WeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    weights: _containers.ScalarMap[str, float]
    def __init__(self, weights: _Optional[_Mapping[str, float]] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("workers", "sessions_moved")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_MOVED_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedScalarFieldContainer[str]
    sessions_moved: int
    def __init__(self, workers: _Optional[_Iterable[str]] = ..., sessions_moved: _Optional[int] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "target_model", "draft", "epoch", "committed_tokens", "tree_nodes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    target_model: str
    draft: str
    epoch: int
    committed_tokens: int
    tree_nodes: int
    def __init__(self, session_id: _Optional[str] = ..., target_model: _Optional[str] = ..., draft: _Optional[str] = ..., epoch: _Optional[int] = ..., committed_tokens: _Optional[int] = ..., tree_nodes: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("drafts", "sessions", "totals", "cache_device", "redis_connected", "pools")
    class TotalsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    CACHE_DEVICE_FIELD_NUMBER: _ClassVar[int]
    REDIS_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    drafts: _containers.RepeatedCompositeFieldContainer[DraftInfo]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    totals: _containers.ScalarMap[str, float]
    cache_device: str
    redis_connected: bool
    pools: _containers.RepeatedCompositeFieldContainer[PoolInfo]
    def __init__(self, drafts: _Optional[_Iterable[_Union[DraftInfo, _Mapping]]] = ..., sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ..., totals: _Optional[_Mapping[str, float]] = ..., cache_device: _Optional[str] = ..., redis_connected: _Optional[bool] = ..., pools: _Optional[_Iterable[_Union[PoolInfo, _Mapping]]] = ...) -> None: ...
