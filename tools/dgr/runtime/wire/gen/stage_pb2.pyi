# Generated from proto/dgr/v1/stage.proto by `dgr wire protoc` (grpc_tools). DO NOT EDIT.
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    F32: _ClassVar[Dtype]
    F16: _ClassVar[Dtype]
    BF16: _ClassVar[Dtype]
    Q8_0: _ClassVar[Dtype]

class LogitsMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOGITS_NONE: _ClassVar[LogitsMode]
    LOGITS_LAST: _ClassVar[LogitsMode]
    LOGITS_ALL: _ClassVar[LogitsMode]

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_UNSPECIFIED: _ClassVar[ErrorCode]
    CACHE_MISS: _ClassVar[ErrorCode]
    SCHEMA_MISMATCH: _ClassVar[ErrorCode]
    WRONG_STAGE: _ClassVar[ErrorCode]
    WRONG_RANGE: _ClassVar[ErrorCode]
    UNKNOWN_SESSION: _ClassVar[ErrorCode]
    STALE_EPOCH: _ClassVar[ErrorCode]
    OVERLOADED: _ClassVar[ErrorCode]
    BAD_FRAME: _ClassVar[ErrorCode]
    MESSAGE_TOO_LARGE: _ClassVar[ErrorCode]
    HOP_UNREACHABLE: _ClassVar[ErrorCode]
    ENGINE: _ClassVar[ErrorCode]
    INTERNAL: _ClassVar[ErrorCode]
DTYPE_UNSPECIFIED: Dtype
F32: Dtype
F16: Dtype
BF16: Dtype
Q8_0: Dtype
LOGITS_NONE: LogitsMode
LOGITS_LAST: LogitsMode
LOGITS_ALL: LogitsMode
ERROR_UNSPECIFIED: ErrorCode
CACHE_MISS: ErrorCode
SCHEMA_MISMATCH: ErrorCode
WRONG_STAGE: ErrorCode
WRONG_RANGE: ErrorCode
UNKNOWN_SESSION: ErrorCode
STALE_EPOCH: ErrorCode
OVERLOADED: ErrorCode
BAD_FRAME: ErrorCode
MESSAGE_TOO_LARGE: ErrorCode
HOP_UNREACHABLE: ErrorCode
ENGINE: ErrorCode
INTERNAL: ErrorCode

class BoundarySchema(_message.Message):
    __slots__ = ("n_streams", "n_embd", "dtype", "token_ids", "bundle_id", "layer")
    N_STREAMS_FIELD_NUMBER: _ClassVar[int]
    N_EMBD_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    n_streams: int
    n_embd: int
    dtype: Dtype
    token_ids: bool
    bundle_id: str
    layer: int
    def __init__(self, n_streams: _Optional[int] = ..., n_embd: _Optional[int] = ..., dtype: _Optional[_Union[Dtype, str]] = ..., token_ids: _Optional[bool] = ..., bundle_id: _Optional[str] = ..., layer: _Optional[int] = ...) -> None: ...

class Identity(_message.Message):
    __slots__ = ("model", "bundle_id", "stage_index", "stage_count", "layer_begin", "layer_end", "n_layer", "upstream_commit", "patch_series", "lane", "arch", "numerics")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    STAGE_COUNT_FIELD_NUMBER: _ClassVar[int]
    LAYER_BEGIN_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    N_LAYER_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_COMMIT_FIELD_NUMBER: _ClassVar[int]
    PATCH_SERIES_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    model: str
    bundle_id: str
    stage_index: int
    stage_count: int
    layer_begin: int
    layer_end: int
    n_layer: int
    upstream_commit: str
    patch_series: str
    lane: str
    arch: str
    numerics: str
    def __init__(self, model: _Optional[str] = ..., bundle_id: _Optional[str] = ..., stage_index: _Optional[int] = ..., stage_count: _Optional[int] = ..., layer_begin: _Optional[int] = ..., layer_end: _Optional[int] = ..., n_layer: _Optional[int] = ..., upstream_commit: _Optional[str] = ..., patch_series: _Optional[str] = ..., lane: _Optional[str] = ..., arch: _Optional[str] = ..., numerics: _Optional[str] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageDescription(_message.Message):
    __slots__ = ("identity", "schema_in", "schema_out", "is_first", "is_last", "has_vocab", "n_vocab", "n_ctx", "max_sessions", "open_sessions", "queued_steps", "max_message_bytes", "max_frame_bytes_sent", "seam_bytes_per_token", "engine", "eos_token_ids", "reaped_sessions", "session_ttl_s", "max_queued_steps", "overloaded", "tls", "mutual_tls", "cached_positions", "member", "chat_template", "descriptor_json", "can_roll_back", "batch_invariant", "prefix_cache_capacity_bytes", "prefix_cache_bytes", "prefix_cache_entries", "prefix_cache_hits", "prefix_cache_lookups", "has_mtp", "n_draft_max", "prefix_cache_off", "matmul_kernels")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_IN_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_OUT_FIELD_NUMBER: _ClassVar[int]
    IS_FIRST_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_FIELD_NUMBER: _ClassVar[int]
    HAS_VOCAB_FIELD_NUMBER: _ClassVar[int]
    N_VOCAB_FIELD_NUMBER: _ClassVar[int]
    N_CTX_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    SEAM_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REAPED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SESSION_TTL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_STEPS_FIELD_NUMBER: _ClassVar[int]
    OVERLOADED_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    MUTUAL_TLS_FIELD_NUMBER: _ClassVar[int]
    CACHED_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_JSON_FIELD_NUMBER: _ClassVar[int]
    CAN_ROLL_BACK_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HAS_MTP_FIELD_NUMBER: _ClassVar[int]
    N_DRAFT_MAX_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_OFF_FIELD_NUMBER: _ClassVar[int]
    MATMUL_KERNELS_FIELD_NUMBER: _ClassVar[int]
    identity: Identity
    schema_in: BoundarySchema
    schema_out: BoundarySchema
    is_first: bool
    is_last: bool
    has_vocab: bool
    n_vocab: int
    n_ctx: int
    max_sessions: int
    open_sessions: int
    queued_steps: int
    max_message_bytes: int
    max_frame_bytes_sent: int
    seam_bytes_per_token: int
    engine: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    reaped_sessions: int
    session_ttl_s: float
    max_queued_steps: int
    overloaded: int
    tls: bool
    mutual_tls: bool
    cached_positions: int
    member: str
    chat_template: str
    descriptor_json: str
    can_roll_back: bool
    batch_invariant: bool
    prefix_cache_capacity_bytes: int
    prefix_cache_bytes: int
    prefix_cache_entries: int
    prefix_cache_hits: int
    prefix_cache_lookups: int
    has_mtp: bool
    n_draft_max: int
    prefix_cache_off: str
    matmul_kernels: str
    def __init__(self, identity: _Optional[_Union[Identity, _Mapping]] = ..., schema_in: _Optional[_Union[BoundarySchema, _Mapping]] = ..., schema_out: _Optional[_Union[BoundarySchema, _Mapping]] = ..., is_first: _Optional[bool] = ..., is_last: _Optional[bool] = ..., has_vocab: _Optional[bool] = ..., n_vocab: _Optional[int] = ..., n_ctx: _Optional[int] = ..., max_sessions: _Optional[int] = ..., open_sessions: _Optional[int] = ..., queued_steps: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_frame_bytes_sent: _Optional[int] = ..., seam_bytes_per_token: _Optional[int] = ..., engine: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., reaped_sessions: _Optional[int] = ..., session_ttl_s: _Optional[float] = ..., max_queued_steps: _Optional[int] = ..., overloaded: _Optional[int] = ..., tls: _Optional[bool] = ..., mutual_tls: _Optional[bool] = ..., cached_positions: _Optional[int] = ..., member: _Optional[str] = ..., chat_template: _Optional[str] = ..., descriptor_json: _Optional[str] = ..., can_roll_back: _Optional[bool] = ..., batch_invariant: _Optional[bool] = ..., prefix_cache_capacity_bytes: _Optional[int] = ..., prefix_cache_bytes: _Optional[int] = ..., prefix_cache_entries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., prefix_cache_lookups: _Optional[int] = ..., has_mtp: _Optional[bool] = ..., n_draft_max: _Optional[int] = ..., prefix_cache_off: _Optional[str] = ..., matmul_kernels: _Optional[str] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "add_special")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    text: str
    add_special: bool
    def __init__(self, text: _Optional[str] = ..., add_special: _Optional[bool] = ...) -> None: ...

class TokenizeReply(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeReply(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class Hop(_message.Message):
    __slots__ = ("address", "bundle_id", "stage_index", "layer_begin", "layer_end")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAYER_BEGIN_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    address: str
    bundle_id: str
    stage_index: int
    layer_begin: int
    layer_end: int
    def __init__(self, address: _Optional[str] = ..., bundle_id: _Optional[str] = ..., stage_index: _Optional[int] = ..., layer_begin: _Optional[int] = ..., layer_end: _Optional[int] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "grammar", "json_schema", "grammar_accepted", "logprobs", "top_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    grammar: str
    json_schema: str
    grammar_accepted: _containers.RepeatedScalarFieldContainer[int]
    logprobs: bool
    top_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., grammar: _Optional[str] = ..., json_schema: _Optional[str] = ..., grammar_accepted: _Optional[_Iterable[int]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class DrawLogprobs(_message.Message):
    __slots__ = ("logprob", "top")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("session_id", "epoch", "route", "hop_index", "sampling", "logits", "upstream", "prefix_blocks", "prefix_block_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    HOP_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    route: _containers.RepeatedCompositeFieldContainer[Hop]
    hop_index: int
    sampling: Sampling
    logits: LogitsMode
    upstream: StageDescription
    prefix_blocks: _containers.RepeatedScalarFieldContainer[bytes]
    prefix_block_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., route: _Optional[_Iterable[_Union[Hop, _Mapping]]] = ..., hop_index: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., logits: _Optional[_Union[LogitsMode, str]] = ..., upstream: _Optional[_Union[StageDescription, _Mapping]] = ..., prefix_blocks: _Optional[_Iterable[bytes]] = ..., prefix_block_tokens: _Optional[int] = ...) -> None: ...

class OpenSessionReply(_message.Message):
    __slots__ = ("error", "hops", "cached_tokens")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    HOPS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    error: WireError
    hops: _containers.RepeatedCompositeFieldContainer[StageDescription]
    cached_tokens: int
    def __init__(self, error: _Optional[_Union[WireError, _Mapping]] = ..., hops: _Optional[_Iterable[_Union[StageDescription, _Mapping]]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id", "epoch", "chain", "prefix_blocks", "prefix_block_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    chain: bool
    prefix_blocks: _containers.RepeatedScalarFieldContainer[bytes]
    prefix_block_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., chain: _Optional[bool] = ..., prefix_blocks: _Optional[_Iterable[bytes]] = ..., prefix_block_tokens: _Optional[int] = ...) -> None: ...

class CloseSessionReply(_message.Message):
    __slots__ = ("error",)
    ERROR_FIELD_NUMBER: _ClassVar[int]
    error: WireError
    def __init__(self, error: _Optional[_Union[WireError, _Mapping]] = ...) -> None: ...

class Boundary(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("positions", "token_ids", "boundary", "schema", "cache_expect", "sample", "drafts", "rollback", "mtp_drafts")
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    CACHE_EXPECT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    MTP_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    boundary: Boundary
    schema: BoundarySchema
    cache_expect: int
    sample: bool
    drafts: int
    rollback: bool
    mtp_drafts: int
    def __init__(self, positions: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., boundary: _Optional[_Union[Boundary, _Mapping]] = ..., schema: _Optional[_Union[BoundarySchema, _Mapping]] = ..., cache_expect: _Optional[int] = ..., sample: _Optional[bool] = ..., drafts: _Optional[int] = ..., rollback: _Optional[bool] = ..., mtp_drafts: _Optional[int] = ...) -> None: ...

class Generate(_message.Message):
    __slots__ = ("max_new_tokens", "stop_token_ids", "context_ids", "context_text", "draft_source", "draft_k", "cached_ids")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TEXT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SOURCE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_K_FIELD_NUMBER: _ClassVar[int]
    CACHED_IDS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    context_ids: _containers.RepeatedScalarFieldContainer[int]
    context_text: str
    draft_source: str
    draft_k: int
    cached_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., context_ids: _Optional[_Iterable[int]] = ..., context_text: _Optional[str] = ..., draft_source: _Optional[str] = ..., draft_k: _Optional[int] = ..., cached_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class HopTiming(_message.Message):
    __slots__ = ("stage_index", "queue_ns", "compute_ns", "wire_ns", "transit_ns")
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    WIRE_NS_FIELD_NUMBER: _ClassVar[int]
    TRANSIT_NS_FIELD_NUMBER: _ClassVar[int]
    stage_index: int
    queue_ns: int
    compute_ns: int
    wire_ns: int
    transit_ns: int
    def __init__(self, stage_index: _Optional[int] = ..., queue_ns: _Optional[int] = ..., compute_ns: _Optional[int] = ..., wire_ns: _Optional[int] = ..., transit_ns: _Optional[int] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("token_id", "position", "logits", "text", "done", "timings", "origin_sent_ns", "ring_ns", "return_ns", "accepted", "drafted", "speculated", "logprobs", "next_drafts")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_SENT_NS_FIELD_NUMBER: _ClassVar[int]
    RING_NS_FIELD_NUMBER: _ClassVar[int]
    RETURN_NS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    SPECULATED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    position: int
    logits: bytes
    text: str
    done: bool
    timings: _containers.RepeatedCompositeFieldContainer[HopTiming]
    origin_sent_ns: int
    ring_ns: int
    return_ns: int
    accepted: _containers.RepeatedScalarFieldContainer[int]
    drafted: int
    speculated: bool
    logprobs: _containers.RepeatedCompositeFieldContainer[DrawLogprobs]
    next_drafts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_id: _Optional[int] = ..., position: _Optional[int] = ..., logits: _Optional[bytes] = ..., text: _Optional[str] = ..., done: _Optional[bool] = ..., timings: _Optional[_Iterable[_Union[HopTiming, _Mapping]]] = ..., origin_sent_ns: _Optional[int] = ..., ring_ns: _Optional[int] = ..., return_ns: _Optional[int] = ..., accepted: _Optional[_Iterable[int]] = ..., drafted: _Optional[int] = ..., speculated: _Optional[bool] = ..., logprobs: _Optional[_Iterable[_Union[DrawLogprobs, _Mapping]]] = ..., next_drafts: _Optional[_Iterable[int]] = ...) -> None: ...

class Logits(_message.Message):
    __slots__ = ("positions", "values")
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    values: bytes
    def __init__(self, positions: _Optional[_Iterable[int]] = ..., values: _Optional[bytes] = ...) -> None: ...

class WireError(_message.Message):
    __slots__ = ("code", "message", "hop", "held", "expected", "retry_after_ms")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    HOP_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    message: str
    hop: str
    held: int
    expected: int
    retry_after_ms: int
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ..., hop: _Optional[str] = ..., held: _Optional[int] = ..., expected: _Optional[int] = ..., retry_after_ms: _Optional[int] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("session_id", "epoch", "step", "generate", "token", "logits", "error", "origin_sent_ns", "timings", "sent_unix_ns")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_SENT_NS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    step: Step
    generate: Generate
    token: Token
    logits: Logits
    error: WireError
    origin_sent_ns: int
    timings: _containers.RepeatedCompositeFieldContainer[HopTiming]
    sent_unix_ns: int
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., step: _Optional[_Union[Step, _Mapping]] = ..., generate: _Optional[_Union[Generate, _Mapping]] = ..., token: _Optional[_Union[Token, _Mapping]] = ..., logits: _Optional[_Union[Logits, _Mapping]] = ..., error: _Optional[_Union[WireError, _Mapping]] = ..., origin_sent_ns: _Optional[int] = ..., timings: _Optional[_Iterable[_Union[HopTiming, _Mapping]]] = ..., sent_unix_ns: _Optional[int] = ...) -> None: ...
