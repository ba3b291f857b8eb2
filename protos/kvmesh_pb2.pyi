from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "ignore_eos", "stop_token_ids", "stop", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias", "min_tokens", "top_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    ignore_eos: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    logprobs: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    top_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., logprobs: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SLO(_message.Message):
    __slots__ = ("ttft_ms", "tbt_ms")
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TBT_MS_FIELD_NUMBER: _ClassVar[int]
    ttft_ms: float
    tbt_ms: float
    def __init__(self, ttft_ms: _Optional[float] = ..., tbt_ms: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "token_ids", "max_tokens", "sampling", "cache_salt", "slo", "request_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    sampling: SamplingParams
    cache_salt: str
    slo: SLO
    request_id: str
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., slo: _Optional[_Union[SLO, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "computed_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    computed_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ...) -> None: ...

class Route(_message.Message):
    __slots__ = ("prefill_node", "decode_node", "estimated_ttft_ms")
    PREFILL_NODE_FIELD_NUMBER: _ClassVar[int]
    DECODE_NODE_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    prefill_node: str
    decode_node: str
    estimated_ttft_ms: float
    def __init__(self, prefill_node: _Optional[str] = ..., decode_node: _Optional[str] = ..., estimated_ttft_ms: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "route", "logprobs", "top_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: Usage
    route: Route
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., route: _Optional[_Union[Route, _Mapping]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node_id", "role", "grpc_address", "data_address", "model", "fingerprint", "kv_blocks_total", "kv_blocks_free", "queue_depth", "running", "computed_tokens_total", "cached_tokens_total", "fetched_tokens_total", "generated_tokens_total", "reachable", "metrics_address", "http_address", "cpu_budget_cores", "cpu_seconds")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FETCHED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HTTP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CPU_BUDGET_CORES_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    grpc_address: str
    data_address: str
    model: str
    fingerprint: str
    kv_blocks_total: int
    kv_blocks_free: int
    queue_depth: int
    running: int
    computed_tokens_total: int
    cached_tokens_total: int
    fetched_tokens_total: int
    generated_tokens_total: int
    reachable: bool
    metrics_address: str
    http_address: str
    cpu_budget_cores: float
    cpu_seconds: float
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[str] = ..., grpc_address: _Optional[str] = ..., data_address: _Optional[str] = ..., model: _Optional[str] = ..., fingerprint: _Optional[str] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., queue_depth: _Optional[int] = ..., running: _Optional[int] = ..., computed_tokens_total: _Optional[int] = ..., cached_tokens_total: _Optional[int] = ..., fetched_tokens_total: _Optional[int] = ..., generated_tokens_total: _Optional[int] = ..., reachable: _Optional[bool] = ..., metrics_address: _Optional[str] = ..., http_address: _Optional[str] = ..., cpu_budget_cores: _Optional[float] = ..., cpu_seconds: _Optional[float] = ...) -> None: ...

class ClusterStatusResponse(_message.Message):
    __slots__ = ("cluster", "nodes", "store_blocks", "store_bytes_used", "store_bytes_total", "requests_accepted", "requests_rejected", "rejected_by_reason", "slo_attainment", "window_s", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tbt_p50_ms", "tbt_p90_ms", "tbt_p99_ms", "top_routes")
    class RejectedByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    STORE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    SLO_ATTAINMENT_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_P50_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P90_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P99_MS_FIELD_NUMBER: _ClassVar[int]
    TBT_P50_MS_FIELD_NUMBER: _ClassVar[int]
    TBT_P90_MS_FIELD_NUMBER: _ClassVar[int]
    TBT_P99_MS_FIELD_NUMBER: _ClassVar[int]
    TOP_ROUTES_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    store_blocks: int
    store_bytes_used: int
    store_bytes_total: int
    requests_accepted: int
    requests_rejected: int
    rejected_by_reason: _containers.ScalarMap[str, int]
    slo_attainment: float
    window_s: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    tbt_p50_ms: float
    tbt_p90_ms: float
    tbt_p99_ms: float
    top_routes: _containers.RepeatedCompositeFieldContainer[RouteCount]
    def __init__(self, cluster: _Optional[str] = ..., nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ..., store_blocks: _Optional[int] = ..., store_bytes_used: _Optional[int] = ..., store_bytes_total: _Optional[int] = ..., requests_accepted: _Optional[int] = ..., requests_rejected: _Optional[int] = ..., rejected_by_reason: _Optional[_Mapping[str, int]] = ..., slo_attainment: _Optional[float] = ..., window_s: _Optional[int] = ..., ttft_p50_ms: _Optional[float] = ..., ttft_p90_ms: _Optional[float] = ..., ttft_p99_ms: _Optional[float] = ..., tbt_p50_ms: _Optional[float] = ..., tbt_p90_ms: _Optional[float] = ..., tbt_p99_ms: _Optional[float] = ..., top_routes: _Optional[_Iterable[_Union[RouteCount, _Mapping]]] = ...) -> None: ...

class RouteCount(_message.Message):
    __slots__ = ("prefill_node", "decode_node", "requests")
    PREFILL_NODE_FIELD_NUMBER: _ClassVar[int]
    DECODE_NODE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    prefill_node: str
    decode_node: str
    requests: int
    def __init__(self, prefill_node: _Optional[str] = ..., decode_node: _Optional[str] = ..., requests: _Optional[int] = ...) -> None: ...

class MountSegmentRequest(_message.Message):
    __slots__ = ("node_id", "data_address", "region_id", "size", "grpc_address", "ssd_bytes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SSD_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    data_address: str
    region_id: int
    size: int
    grpc_address: str
    ssd_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., data_address: _Optional[str] = ..., region_id: _Optional[int] = ..., size: _Optional[int] = ..., grpc_address: _Optional[str] = ..., ssd_bytes: _Optional[int] = ...) -> None: ...

class MountSegmentResponse(_message.Message):
    __slots__ = ("segment_id",)
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    segment_id: str
    def __init__(self, segment_id: _Optional[str] = ...) -> None: ...

class UnmountSegmentRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class UnmountSegmentResponse(_message.Message):
    __slots__ = ("segments", "blocks_dropped")
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    segments: int
    blocks_dropped: int
    def __init__(self, segments: _Optional[int] = ..., blocks_dropped: _Optional[int] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("hash", "data_address", "region_id", "offset", "size", "node_id", "tier")
    HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    data_address: str
    region_id: int
    offset: int
    size: int
    node_id: str
    tier: str
    def __init__(self, hash: _Optional[bytes] = ..., data_address: _Optional[str] = ..., region_id: _Optional[int] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., node_id: _Optional[str] = ..., tier: _Optional[str] = ...) -> None: ...

class PutStartRequest(_message.Message):
    __slots__ = ("node_id", "hashes", "size", "sizes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    size: int
    sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, node_id: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ..., size: _Optional[int] = ..., sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class PutStartResponse(_message.Message):
    __slots__ = ("placements", "already_present")
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    placements: _containers.RepeatedCompositeFieldContainer[Placement]
    already_present: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, placements: _Optional[_Iterable[_Union[Placement, _Mapping]]] = ..., already_present: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PutEndRequest(_message.Message):
    __slots__ = ("hashes", "abort")
    HASHES_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    abort: bool
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ..., abort: _Optional[bool] = ...) -> None: ...

class PutEndResponse(_message.Message):
    __slots__ = ("committed", "failed")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    committed: int
    failed: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, committed: _Optional[int] = ..., failed: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GetReplicasRequest(_message.Message):
    __slots__ = ("hashes", "node_id", "any_order")
    HASHES_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ANY_ORDER_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    node_id: str
    any_order: bool
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ..., node_id: _Optional[str] = ..., any_order: _Optional[bool] = ...) -> None: ...

class GetReplicasResponse(_message.Message):
    __slots__ = ("replicas", "lease_expires_unix_ms", "lease_ms")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[Placement]
    lease_expires_unix_ms: int
    lease_ms: int
    def __init__(self, replicas: _Optional[_Iterable[_Union[Placement, _Mapping]]] = ..., lease_expires_unix_ms: _Optional[int] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class ExistsRequest(_message.Message):
    __slots__ = ("hashes", "any_order")
    HASHES_FIELD_NUMBER: _ClassVar[int]
    ANY_ORDER_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    any_order: bool
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ..., any_order: _Optional[bool] = ...) -> None: ...

class ExistsResponse(_message.Message):
    __slots__ = ("prefix_blocks", "present")
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    prefix_blocks: int
    present: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, prefix_blocks: _Optional[int] = ..., present: _Optional[_Iterable[bool]] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RemoveResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class StoreStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StoreStatsResponse(_message.Message):
    __slots__ = ("blocks", "bytes_used", "bytes_total", "segments", "evictions", "replicas", "ssd_blocks", "spills", "promotions", "replications", "pinned", "puts_reclaimed")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SSD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SPILLS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    REPLICATIONS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    PUTS_RECLAIMED_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    bytes_used: int
    bytes_total: int
    segments: int
    evictions: int
    replicas: int
    ssd_blocks: int
    spills: int
    promotions: int
    replications: int
    pinned: int
    puts_reclaimed: int
    def __init__(self, blocks: _Optional[int] = ..., bytes_used: _Optional[int] = ..., bytes_total: _Optional[int] = ..., segments: _Optional[int] = ..., evictions: _Optional[int] = ..., replicas: _Optional[int] = ..., ssd_blocks: _Optional[int] = ..., spills: _Optional[int] = ..., promotions: _Optional[int] = ..., replications: _Optional[int] = ..., pinned: _Optional[int] = ..., puts_reclaimed: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("pinned",)
    PINNED_FIELD_NUMBER: _ClassVar[int]
    pinned: int
    def __init__(self, pinned: _Optional[int] = ...) -> None: ...

class WatchBlocksRequest(_message.Message):
    __slots__ = ("node_id", "snapshot", "coalesce", "coalesce_ms")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    COALESCE_FIELD_NUMBER: _ClassVar[int]
    COALESCE_MS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    snapshot: bool
    coalesce: bool
    coalesce_ms: int
    def __init__(self, node_id: _Optional[str] = ..., snapshot: _Optional[bool] = ..., coalesce: _Optional[bool] = ..., coalesce_ms: _Optional[int] = ...) -> None: ...

class BlockEvent(_message.Message):
    __slots__ = ("seq", "type", "hash", "node_id", "tier", "offset", "size", "region_id", "master_id", "more")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    MASTER_ID_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    type: str
    hash: bytes
    node_id: str
    tier: str
    offset: int
    size: int
    region_id: int
    master_id: str
    more: _containers.RepeatedCompositeFieldContainer[BlockEvent]
    def __init__(self, seq: _Optional[int] = ..., type: _Optional[str] = ..., hash: _Optional[bytes] = ..., node_id: _Optional[str] = ..., tier: _Optional[str] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., region_id: _Optional[int] = ..., master_id: _Optional[str] = ..., more: _Optional[_Iterable[_Union[BlockEvent, _Mapping]]] = ...) -> None: ...

class BlockRecord(_message.Message):
    __slots__ = ("hash", "offset", "size", "tier", "region_id")
    HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    hash: bytes
    offset: int
    size: int
    tier: str
    region_id: int
    def __init__(self, hash: _Optional[bytes] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., tier: _Optional[str] = ..., region_id: _Optional[int] = ...) -> None: ...

class ReportBlocksRequest(_message.Message):
    __slots__ = ("node_id", "blocks")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    blocks: _containers.RepeatedCompositeFieldContainer[BlockRecord]
    def __init__(self, node_id: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[BlockRecord, _Mapping]]] = ...) -> None: ...

class ReportBlocksResponse(_message.Message):
    __slots__ = ("accepted", "rejected")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    rejected: int
    def __init__(self, accepted: _Optional[int] = ..., rejected: _Optional[int] = ...) -> None: ...

class PutLocalRequest(_message.Message):
    __slots__ = ("node_id", "region_id", "hashes", "offsets", "sizes", "reserve_size", "reserve_count", "reserve_spare", "release_offsets", "release_sizes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    RESERVE_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESERVE_COUNT_FIELD_NUMBER: _ClassVar[int]
    RESERVE_SPARE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_SIZES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    region_id: int
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    reserve_size: int
    reserve_count: int
    reserve_spare: int
    release_offsets: _containers.RepeatedScalarFieldContainer[int]
    release_sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, node_id: _Optional[str] = ..., region_id: _Optional[int] = ..., hashes: _Optional[_Iterable[bytes]] = ..., offsets: _Optional[_Iterable[int]] = ..., sizes: _Optional[_Iterable[int]] = ..., reserve_size: _Optional[int] = ..., reserve_count: _Optional[int] = ..., reserve_spare: _Optional[int] = ..., release_offsets: _Optional[_Iterable[int]] = ..., release_sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class PutLocalResponse(_message.Message):
    __slots__ = ("status", "reserved")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    status: _containers.RepeatedScalarFieldContainer[int]
    reserved: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, status: _Optional[_Iterable[int]] = ..., reserved: _Optional[_Iterable[int]] = ...) -> None: ...

class StoreHelloRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StoreHelloResponse(_message.Message):
    __slots__ = ("master_id", "lease_ms", "fast_address")
    MASTER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    FAST_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    master_id: str
    lease_ms: int
    fast_address: str
    def __init__(self, master_id: _Optional[str] = ..., lease_ms: _Optional[int] = ..., fast_address: _Optional[str] = ...) -> None: ...

class SpillRequest(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockRecord]
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockRecord, _Mapping]]] = ...) -> None: ...

class SpillResponse(_message.Message):
    __slots__ = ("spilled", "dropped")
    SPILLED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    spilled: _containers.RepeatedScalarFieldContainer[bytes]
    dropped: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, spilled: _Optional[_Iterable[bytes]] = ..., dropped: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PromoteRequest(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockRecord]
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockRecord, _Mapping]]] = ...) -> None: ...

class PromoteResponse(_message.Message):
    __slots__ = ("promoted",)
    PROMOTED_FIELD_NUMBER: _ClassVar[int]
    promoted: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, promoted: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ReplicateRequest(_message.Message):
    __slots__ = ("sources", "offsets")
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    sources: _containers.RepeatedCompositeFieldContainer[Placement]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sources: _Optional[_Iterable[_Union[Placement, _Mapping]]] = ..., offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class ReplicateResponse(_message.Message):
    __slots__ = ("copied",)
    COPIED_FIELD_NUMBER: _ClassVar[int]
    copied: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, copied: _Optional[_Iterable[bytes]] = ...) -> None: ...

class NodeStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVTarget(_message.Message):
    __slots__ = ("node_id", "data_address", "region_id", "block_ids", "block_nbytes", "held_blocks")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    data_address: str
    region_id: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_nbytes: int
    held_blocks: int
    def __init__(self, node_id: _Optional[str] = ..., data_address: _Optional[str] = ..., region_id: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_nbytes: _Optional[int] = ..., held_blocks: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "block_hashes", "target", "sampling", "deadline_ms", "expected_ms", "expected_computed_tokens", "warm")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_MS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WARM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    target: KVTarget
    sampling: SamplingParams
    deadline_ms: float
    expected_ms: float
    expected_computed_tokens: int
    warm: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., target: _Optional[_Union[KVTarget, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., deadline_ms: _Optional[float] = ..., expected_ms: _Optional[float] = ..., expected_computed_tokens: _Optional[int] = ..., warm: _Optional[bool] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "computed_tokens", "cached_tokens", "fetched_tokens", "prefill_ms", "queue_ms", "first_logprob", "first_top")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FETCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOP_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    computed_tokens: int
    cached_tokens: int
    fetched_tokens: int
    prefill_ms: float
    queue_ms: float
    first_logprob: float
    first_top: TopLogprobs
    def __init__(self, first_token: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., fetched_tokens: _Optional[int] = ..., prefill_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., first_logprob: _Optional[float] = ..., first_top: _Optional[_Union[TopLogprobs, _Mapping]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "max_tokens", "block_hashes", "prefill_here")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_HERE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: int
    max_tokens: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    prefill_here: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., prefill_here: _Optional[bool] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("target", "cached_tokens", "prefix_pinned", "reserve_seq")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PINNED_FIELD_NUMBER: _ClassVar[int]
    RESERVE_SEQ_FIELD_NUMBER: _ClassVar[int]
    target: KVTarget
    cached_tokens: int
    prefix_pinned: bool
    reserve_seq: int
    def __init__(self, target: _Optional[_Union[KVTarget, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., prefix_pinned: _Optional[bool] = ..., reserve_seq: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "first_token", "max_tokens", "sampling", "stop_token_ids", "prefill_here", "prompt_token_ids", "block_hashes", "report_join", "tbt_slo_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_HERE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    REPORT_JOIN_FIELD_NUMBER: _ClassVar[int]
    TBT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token: int
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prefill_here: bool
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    report_join: bool
    tbt_slo_ms: float
    def __init__(self, request_id: _Optional[str] = ..., first_token: _Optional[int] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., prefill_here: _Optional[bool] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., report_join: _Optional[bool] = ..., tbt_slo_ms: _Optional[float] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "prefill", "logprobs", "joined", "top_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    prefill: PrefillResponse
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    joined: bool
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., prefill: _Optional[_Union[PrefillResponse, _Mapping]] = ..., logprobs: _Optional[_Iterable[float]] = ..., joined: _Optional[bool] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: float
    def __init__(self, interval_ms: _Optional[float] = ...) -> None: ...

class PrefillSample(_message.Message):
    __slots__ = ("new_tokens", "cached_tokens", "ms")
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    new_tokens: int
    cached_tokens: int
    ms: float
    def __init__(self, new_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., ms: _Optional[float] = ...) -> None: ...

class DecodeSample(_message.Message):
    __slots__ = ("batch", "kv_tokens", "ms")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    batch: int
    kv_tokens: int
    ms: float
    def __init__(self, batch: _Optional[int] = ..., kv_tokens: _Optional[int] = ..., ms: _Optional[float] = ...) -> None: ...

class StoreFetchSample(_message.Message):
    __slots__ = ("bytes", "ms")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    ms: float
    def __init__(self, bytes: _Optional[int] = ..., ms: _Optional[float] = ...) -> None: ...

class NodeLoad(_message.Message):
    __slots__ = ("queue_depth", "running", "kv_blocks_free", "kv_blocks_total", "prefill_samples", "decode_samples", "bandwidth_bytes_per_s", "store_fetches", "reserves_seen")
    class BandwidthBytesPerSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DECODE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    STORE_FETCHES_FIELD_NUMBER: _ClassVar[int]
    RESERVES_SEEN_FIELD_NUMBER: _ClassVar[int]
    queue_depth: int
    running: int
    kv_blocks_free: int
    kv_blocks_total: int
    prefill_samples: _containers.RepeatedCompositeFieldContainer[PrefillSample]
    decode_samples: _containers.RepeatedCompositeFieldContainer[DecodeSample]
    bandwidth_bytes_per_s: _containers.ScalarMap[str, float]
    store_fetches: _containers.RepeatedCompositeFieldContainer[StoreFetchSample]
    reserves_seen: int
    def __init__(self, queue_depth: _Optional[int] = ..., running: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., prefill_samples: _Optional[_Iterable[_Union[PrefillSample, _Mapping]]] = ..., decode_samples: _Optional[_Iterable[_Union[DecodeSample, _Mapping]]] = ..., bandwidth_bytes_per_s: _Optional[_Mapping[str, float]] = ..., store_fetches: _Optional[_Iterable[_Union[StoreFetchSample, _Mapping]]] = ..., reserves_seen: _Optional[int] = ...) -> None: ...

class NodeEvent(_message.Message):
    __slots__ = ("seq", "reset", "stored", "removed", "load")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    seq: int
    reset: bool
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    load: NodeLoad
    def __init__(self, seq: _Optional[int] = ..., reset: _Optional[bool] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., load: _Optional[_Union[NodeLoad, _Mapping]] = ...) -> None: ...
