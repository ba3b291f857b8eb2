"""A prefill request's prompt as the node works on it."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.protos import kvmesh_pb2 as pb


@dataclass
class Prompt:
    """A request's tokens and its full blocks: ``hashes[i]`` names ``blocks_tokens[i]``."""

    tokens: list[int]
    hashes: list[bytes]
    blocks_tokens: list[tuple[int, ...]]
    usable: int  # leading full blocks a cache may supply: >= 1 token is left to compute

    @classmethod
    def of(cls, req: pb.PrefillRequest, bs: int) -> Prompt:
        tokens, hashes = list(req.token_ids), list(req.block_hashes)
        blocks_tokens = [tuple(tokens[i * bs : (i + 1) * bs]) for i in range(len(hashes))]
        return cls(tokens, hashes, blocks_tokens, min(len(hashes), (len(tokens) - 1) // bs))
