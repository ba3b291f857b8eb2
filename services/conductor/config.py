"""The conductor's configuration (``--help`` is built from its fields' docs)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.services.common.auth import ApiKeys
from kvmesh.services.common.config import ConfigError, option
from kvmesh.services.common.settings import ServiceConfig
from kvmesh.services.conductor.policy import POLICIES, SLO_MARGIN, PolicyConfig


@dataclass
class ConductorConfig(ServiceConfig):
    """conductor: client API, cache-aware routing and early rejection."""

    ttft_slo_ms: float = option(60000.0, "cluster TTFT SLO in ms; requests may only tighten it")
    tbt_slo_ms: float = option(5000.0, "cluster time-between-tokens SLO in ms")
    policy: str = option("kvmesh", "routing policy: random, load, cache, cache-load, kvmesh")
    colocate_below_tokens: int = option(
        512, "prompts shorter than this are prefilled on the decode node itself (0 = never)"
    )
    direct_share: float = option(
        0.9, "decode-direct when the decode node holds this share of the prefix"
    )
    slo_margin: float = option(
        SLO_MARGIN,
        "admit only when the estimate is within this share of the SLO (room for estimate error)",
    )
    refuse_late: bool = option(
        True,
        "a prefill node refuses a queued request once it can no longer meet its TTFT SLO "
        "(its node runs slower than estimated), rather than compute it late; the client "
        "gets RESOURCE_EXHAUSTED with reason deadline (--no-refuse-late: late instead)",
    )
    wait_for_kv: bool = option(
        True,
        "kvmesh policy: a request no decode node has KV room for now waits for the room "
        "that the requests booked there free as they end, where it still meets its SLOs "
        "(--no-wait-for-kv: refused at once with reason kv)",
    )
    warm_refused: bool = option(
        True,
        "kvmesh policy: a prompt refused for its TTFT whose full blocks no node holds is "
        "computed into the store by an idle prefill node, which stops for any request "
        "that comes to wait, so that the requests sharing its prefix find it cached "
        "(--no-warm-refused: not)",
    )
    hold_first_token: bool = option(
        True,
        "hold a request's first token until its decode node has it in the running batch "
        "(the first step holding it has begun), at most until its TTFT SLO is up: the "
        "gap to its second token is then one step, inside the TBT SLO, and the wait to "
        "join counts in the TTFT admission learns from (--no-hold-first-token: the "
        "prefill node's first token goes out at once)",
    )
    report_interval_ms: float = option(200.0, "period of the nodes' load reports")
    request_timeout_s: float = option(300.0, "longest a request may run end to end")
    max_prompt_tokens: int = option(
        0, "longest prompt accepted, in tokens (0 = the model's context)"
    )
    max_tokens_limit: int = option(4096, "largest max_tokens a request may ask for")
    max_streams_per_client: int = option(
        64, "concurrent Generate streams per client (API key, else peer address)"
    )
    drain_timeout_s: float = option(
        20.0,
        "on shutdown, how long in-flight streams may take "
        "to finish before they end with UNAVAILABLE",
    )
    http_port: int = option(
        8000,
        "OpenAI-compatible HTTP API port on --host (0 = any free port, "
        'advertised in etcd as "http"; -1 = off)',
    )
    http_idle_timeout_s: float = option(
        10.0,
        "the HTTP API closes a connection idle this long: a keep-alive connection between "
        "requests, or one that has not finished sending its request headers",
    )
    api_keys: str = option(
        "",
        "client API keys, comma-separated entries KEY, KEY:TENANT or "
        "KEY:TENANT:shared=NAMESPACE (see services.common.auth); empty "
        "(and no --api-keys-file) = open API",
    )
    api_keys_file: str = option("", "file with one API key entry per line (# comments)")
    api_key: str = option(
        "",
        "one client API key, as vllm serve's --api-key: an --api-keys entry (KEY, the "
        "default tenant), added to those of --api-keys and --api-keys-file (its "
        "environment variable is not KVMESH_API_KEY, the key the command line sends)",
        env="KVMESH_CONDUCTOR_API_KEY",
    )
    served_model_name: str = option(
        "",
        "names clients may call the model by, comma-separated, as vllm serve's "
        "--served-model-name, for a cluster serving one model: requests may name any of "
        "them (or the model's own name); the first is the name /v1/models lists first and "
        "the vllm: metrics' model_name label (empty = the model's own name)",
    )
    max_model_len: int = option(
        0,
        "longest context a request may use, prompt plus max_tokens, in tokens, as vllm "
        "serve's --max-model-len (0 = the model's own context)",
    )
    tokenizer: str = option(
        "",
        "the tokenizer the conductor loads, as vllm serve's --tokenizer: a Hugging Face hub "
        "id (from the HF_HOME cache; downloaded there first unless HF_HUB_OFFLINE=1), a "
        "model directory or a preset name; it must be the nodes' own (checked by name). "
        "Empty = each model's own: the nodes' model directory where this conductor sees "
        "it, else the model's name (a shipped model, or a hub id in the cache)",
    )

    def validate(self) -> None:
        super().validate()
        ApiKeys.from_config(self.api_key_entries, self.api_keys_file)  # ConfigError if bad
        if self.max_model_len < 0:
            raise ConfigError(f"max_model_len: {self.max_model_len} must be >= 0 (0 = the model's)")
        names = self.served_model_names
        if len(set(names)) != len(names):
            raise ConfigError(f"served_model_name: {self.served_model_name!r} repeats a name")
        if not -1 <= self.http_port < 65536:
            raise ConfigError(f"http_port: {self.http_port} is not a TCP port (or -1 = off)")
        if not self.http_idle_timeout_s > 0:
            raise ConfigError(
                f"http_idle_timeout_s must be > 0 (seconds), got {self.http_idle_timeout_s}"
            )
        if self.ttft_slo_ms <= 0 or self.tbt_slo_ms <= 0:
            raise ConfigError("ttft_slo_ms and tbt_slo_ms must be > 0")
        if self.policy not in POLICIES:
            raise ConfigError(f"policy: {self.policy!r} is not one of {', '.join(POLICIES)}")
        if not 0 < self.slo_margin <= 1:
            raise ConfigError("slo_margin must be in (0, 1]")
        if self.colocate_below_tokens < 0 or not 0 < self.direct_share <= 1:
            raise ConfigError("colocate_below_tokens must be >= 0 and direct_share in (0, 1]")

    @property
    def api_key_entries(self) -> str:
        """``api_keys`` with ``api_key`` added: the table's entries, comma-separated."""
        return ",".join(e for e in (self.api_keys, self.api_key) if e.strip())

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return tuple(n.strip() for n in self.served_model_name.split(",") if n.strip())

    def policy_config(self) -> PolicyConfig:
        """The scheduler's configuration: this service's routing options, the rest at
        their defaults."""
        return PolicyConfig(
            policy=self.policy,
            colocate_below_tokens=self.colocate_below_tokens,
            direct_share=self.direct_share,
            slo_margin=self.slo_margin,
            wait_for_kv=self.wait_for_kv,
        )
