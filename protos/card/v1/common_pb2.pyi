from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_UNSPECIFIED: _ClassVar[Outcome]
    OUTCOME_HIT: _ClassVar[Outcome]
    OUTCOME_SECONDARY_HIT: _ClassVar[Outcome]
    OUTCOME_MISS: _ClassVar[Outcome]
OUTCOME_UNSPECIFIED: Outcome
OUTCOME_HIT: Outcome
OUTCOME_SECONDARY_HIT: Outcome
OUTCOME_MISS: Outcome

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens", "constraint")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    constraint: Constraint
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("kind", "text")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    text: str
    def __init__(self, kind: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class ChainPolicy(_message.Message):
    __slots__ = ("max_chain", "min_path_prob", "b_extension")
    MAX_CHAIN_FIELD_NUMBER: _ClassVar[int]
    MIN_PATH_PROB_FIELD_NUMBER: _ClassVar[int]
    B_EXTENSION_FIELD_NUMBER: _ClassVar[int]
    max_chain: int
    min_path_prob: float
    b_extension: bool
    def __init__(self, max_chain: _Optional[int] = ..., min_path_prob: _Optional[float] = ..., b_extension: _Optional[bool] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("mode", "prompt_tokens", "new_tokens", "wall_s", "prefill_s", "target_forwards", "draft_forwards", "hits", "secondary_hits", "misses", "target_idle_s", "draft_idle_s", "step_rtt_ms", "accepted_lengths", "exact", "verify", "draft_tokens", "accepted_draft_tokens", "loose_kept", "acceptance_histogram", "rejection_fallbacks", "speculation", "drafting_paused_steps", "drafting_pauses", "cached_tokens")
    MODE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TARGET_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    SECONDARY_HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    TARGET_IDLE_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_IDLE_S_FIELD_NUMBER: _ClassVar[int]
    STEP_RTT_MS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOSE_KEPT_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    REJECTION_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    DRAFTING_PAUSED_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFTING_PAUSES_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    mode: str
    prompt_tokens: int
    new_tokens: int
    wall_s: float
    prefill_s: float
    target_forwards: int
    draft_forwards: int
    hits: int
    secondary_hits: int
    misses: int
    target_idle_s: float
    draft_idle_s: float
    step_rtt_ms: _containers.RepeatedScalarFieldContainer[float]
    accepted_lengths: _containers.RepeatedScalarFieldContainer[int]
    exact: bool
    verify: str
    draft_tokens: int
    accepted_draft_tokens: int
    loose_kept: int
    acceptance_histogram: _containers.RepeatedScalarFieldContainer[int]
    rejection_fallbacks: int
    speculation: str
    drafting_paused_steps: int
    drafting_pauses: int
    cached_tokens: int
    def __init__(self, mode: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., new_tokens: _Optional[int] = ..., wall_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., target_forwards: _Optional[int] = ..., draft_forwards: _Optional[int] = ..., hits: _Optional[int] = ..., secondary_hits: _Optional[int] = ..., misses: _Optional[int] = ..., target_idle_s: _Optional[float] = ..., draft_idle_s: _Optional[float] = ..., step_rtt_ms: _Optional[_Iterable[float]] = ..., accepted_lengths: _Optional[_Iterable[int]] = ..., exact: _Optional[bool] = ..., verify: _Optional[str] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., loose_kept: _Optional[int] = ..., acceptance_histogram: _Optional[_Iterable[int]] = ..., rejection_fallbacks: _Optional[int] = ..., speculation: _Optional[str] = ..., drafting_paused_steps: _Optional[int] = ..., drafting_pauses: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...
