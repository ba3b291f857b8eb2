"""Options of a model node (prefill or decode): the model, its KV pool and store segment,
and the data plane. Validating them needs the engine (presets, dtypes), so they live here
in the node layer rather than in the torch-free ``services/common``."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.rdma.tcp import MAX_CONNS
from kvmesh.services.common.config import ConfigError, option, parse_memory, parse_size
from kvmesh.services.common.settings import (
    DEV_SECRET,
    TE_MAX_CONNS_HELP,
    ServiceConfig,
    check_data_plane_secret,
)
from kvmesh.services.engine.checkpoint import CheckpointError, resolve_model
from kvmesh.services.engine.config import resolve_dtype
from kvmesh.services.engine.device import DEVICES, resolve_device


@dataclass
class NodeConfig(ServiceConfig):
    """Options of a model node (prefill or decode)."""

    model: str = option(
        "tiny",
        "model to serve: a random preset (tiny, small, medium), demo (a small trained "
        "model shipped with kvmesh), a Hugging Face model directory "
        "(config.json, *.safetensors, tokenizer.json) or a Hugging Face hub id "
        "(org/name: the snapshot in the HF_HOME cache, downloaded there first "
        "unless HF_HUB_OFFLINE=1)",
    )
    dtype: str = option(
        "float32",
        "compute dtype, as vllm serve's --dtype: float32, bfloat16, float16 (CUDA only: a "
        "CPU has no fast half-precision kernels) or auto (bfloat16 on CUDA, float32 on a CPU)",
    )
    device: str = option(
        "cpu",
        "where the weights and the KV pool live and the model computes: cpu, cuda "
        "(cuda:N; a start-up error without a CUDA device) or auto (CUDA where torch "
        "sees it, else the CPU); on CUDA the transfer engine registers a pinned host "
        "mirror of the pool (as much host memory again) and --kv-memory's share is of "
        "free device memory",
    )
    seed: int = option(0, "seed of a random preset's weights; all nodes must agree")
    block_size: int = option(256, "tokens per KV block (engine block = store block)")
    prefill_chunk_tokens: int = option(
        2048,
        "a prompt with more new tokens than this is computed in chunks of at "
        "most this many tokens (rounded down to whole blocks), each attending to "
        "the KV of the chunks before it: a prefill's peak memory is bounded by "
        "the chunk, not the prompt, and a decode node's batch steps between "
        "its chunks",
    )
    kv_memory: str = option(
        "256MiB",
        "memory for this node's KV pool: a size (2GiB) or a "
        "share of the memory available at start (40%)",
    )
    segment_memory: str = option(
        "256MiB", "DRAM this node lends to the cluster KV store (0 = none)"
    )
    ssd_dir: str = option(
        "",
        "directory backing the store segment with an SSD tier: blocks "
        "evicted from DRAM spill there (empty = no SSD tier)",
    )
    ssd_bytes: str = option("1GiB", "most bytes of block data the SSD tier keeps on disk")
    data_port: int = option(0, "transfer-engine (data plane) port (0 = any free port)")
    secret: str = option(DEV_SECRET, "cluster secret; data-plane peers must share it")
    threads: int = option(
        0,
        "torch intra-op threads (0 = the share of the cores kvmesh up gives each node, "
        "else torch's default, which OMP_NUM_THREADS sets)",
    )
    cpus: float = option(
        0.0,
        "CPU budget in cores, a fraction allowed (0.375): the node runs in a cgroup of "
        "its own whose CFS quota is cpus x a 10 ms period, with ceil(cpus) torch "
        "threads unless --threads says otherwise; needs root or a delegated cgroup "
        "(v1 cpu or v2 cpu.max), else a start-up error; 0 = no budget",
    )
    te_poll_us: int = option(
        200,
        "busy-poll window in microseconds: after a request the "
        "transfer engine's threads spin this long for the next one, "
        "and the event loop this long for a small transfer's or a "
        "store call's answer, before sleeping; trades CPU for "
        "latency, 0 = never spin",
    )
    te_max_conns: int = option(
        MAX_CONNS,
        TE_MAX_CONNS_HELP,
    )
    checksum: bool = option(
        False,
        "integrity checking on the data plane: every KV slice carries "
        "a crc32 that the receiver checks; a damaged handoff fails "
        "(the prefill is retried) and a damaged store read is a miss",
    )

    def validate(self) -> None:
        super().validate()
        try:  # looks only: a hub id missing from the cache is downloaded at setup
            resolve_model(self.model, download=False)
        except CheckpointError as e:
            raise ConfigError(str(e)) from None
        try:
            device = resolve_device(self.device)
        except ValueError as e:
            raise ConfigError(f"device: {e} (one of {', '.join(DEVICES)})") from None
        try:
            resolve_dtype(self.dtype, cuda=device.type == "cuda")
        except ValueError as e:
            raise ConfigError(f"dtype: {e}") from None
        if not 1 <= self.block_size <= 4096:
            raise ConfigError(f"block_size: {self.block_size} must be between 1 and 4096")
        if not self.block_size <= self.prefill_chunk_tokens <= 1 << 20:
            raise ConfigError(
                f"prefill_chunk_tokens: {self.prefill_chunk_tokens} must be between "
                f"block_size ({self.block_size}) and {1 << 20}"
            )
        if parse_memory(self.kv_memory) <= 0:
            raise ConfigError("kv_memory: must be > 0")
        parse_size(self.segment_memory)
        if self.ssd_dir and parse_size(self.ssd_bytes) <= 0:
            raise ConfigError("ssd_bytes: must be > 0 when ssd_dir is set")
        if not self.secret:
            raise ConfigError(
                "secret: the cluster secret must not be empty: set KVMESH_SECRET "
                "(e.g. to the output of `openssl rand -hex 32`)"
            )
        check_data_plane_secret(self.secret, self.host)
        if not 0 <= self.data_port < 65536:
            raise ConfigError(f"data_port: {self.data_port} is not a TCP port")
        if not 0 <= self.cpus <= 1024:
            raise ConfigError(
                f"cpus: {self.cpus} must be a number of cores between 0 (no budget) "
                "and 1024, e.g. 0.375"
            )
        if not 0 <= self.te_poll_us <= 5000:
            raise ConfigError(
                f"te_poll_us: {self.te_poll_us} must be between 0 and 5000 "
                f"(the event loop spins that long at most)"
            )
        if not 1 <= self.te_max_conns <= 1 << 20:
            raise ConfigError(f"te_max_conns: {self.te_max_conns} must be between 1 and {1 << 20}")

    @property
    def prefill_chunk(self) -> int:
        """Tokens of one prefill chunk: ``prefill_chunk_tokens`` in whole blocks, so that
        no block is written by two chunks."""
        return self.prefill_chunk_tokens // self.block_size * self.block_size
