"""A request's input, checked before the scheduler sees it: the model it names, its
prompt as tokens (tokenized off the event loop when long) and its limits (max_tokens,
context, sampling, SLOs). Anything wrong raises :class:`Rejected` with
INVALID_ARGUMENT (NOT_FOUND for a model the cluster does not serve, UNAVAILABLE when
no model is served yet) and a message that says
what to fix."""

from __future__ import annotations

import asyncio
import os

import grpc

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.services.common.limits import shown
from kvmesh.services.common.sampling_params import Sampling
from kvmesh.services.common.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    TokenizerError,
    load_tokenizer,
)
from kvmesh.services.conductor.cluster import ClusterView
from kvmesh.services.conductor.frontend import Rejected

# prompts longer than this are tokenized off the event loop
LONG_PROMPT_BYTES = 16 << 10


async def tokenize_prompt(tok, prompt: str, max_tokens: int, ctx: int, cap: int) -> list[int]:
    """The tokens of ``prompt`` (BOS first). A prompt whose bytes alone make more tokens
    than the model's context ``ctx`` (less ``max_tokens``) or ``cap`` (--max-prompt-tokens,
    0 = none) allows, even at the tokenizer's most bytes per token (``max_token_bytes``),
    is refused (INVALID_ARGUMENT) before any tokenizing; a prompt that could fit is
    tokenized, a long one in a thread, so the event loop (other requests, /health) runs
    on meanwhile. The caller checks the exact count."""
    nbytes = len(prompt.encode("utf-8"))
    per_token = getattr(tok, "max_token_bytes", None)
    if per_token:
        least = -(-nbytes // per_token) + (tok.bos_id is not None)
        said = f"the prompt is {nbytes} bytes, at least {least} tokens for this model"
        if least + max_tokens > ctx:
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{said}, and max_tokens is {max_tokens}: together they exceed the model's "
                f"context of {ctx} tokens; shorten the prompt or lower max_tokens",
            )
        if cap and least > cap:
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{said}; this cluster accepts at most {cap} prompt tokens",
            )
    if nbytes <= LONG_PROMPT_BYTES:
        return tok.encode(prompt)
    return await asyncio.to_thread(tok.encode, prompt)


class RequestInput:
    """Checks a ``GenerateRequest`` against the models the cluster serves and this
    conductor's limits (``max_tokens_limit``, ``max_prompt_tokens``: 0 = the model's
    context); keeps one tokenizer per model."""

    def __init__(
        self,
        view: ClusterView,
        max_tokens_limit: int,
        max_prompt_tokens: int,
        served_names: tuple[str, ...] = (),
        max_model_len: int = 0,
        tokenizer: str = "",
    ) -> None:
        self.view = view
        self.max_tokens_limit = max_tokens_limit
        self.max_prompt_tokens = max_prompt_tokens
        self.served_names = served_names  # --served-model-name: aliases of the only model
        self.max_model_len = max_model_len  # --max-model-len (0 = the model's context)
        self.tokenizer_spec = tokenizer  # --tokenizer (empty = each model's own)
        self._tokenizers: dict[str, ByteTokenizer | HFTokenizer] = {}

    @classmethod
    def of(cls, view: ClusterView, cfg) -> RequestInput:
        """The checks of a conductor's config ``cfg`` (a ``ConductorConfig``)."""
        return cls(
            view,
            cfg.max_tokens_limit,
            cfg.max_prompt_tokens,
            served_names=cfg.served_model_names,
            max_model_len=cfg.max_model_len,
            tokenizer=cfg.tokenizer,
        )

    def label(self, requested: str) -> str:
        """The name a request for ``requested`` (empty: the only model) is reported under
        (:meth:`public_name`); ``requested`` itself when it names no model served."""
        name = self.alias(requested)
        if not name:
            models = self.view.models()
            name = next(iter(models)) if len(models) == 1 else ""
        return self.public_name(name) if name else requested

    def alias(self, name: str) -> str:
        """The model a request's ``name`` means: a --served-model-name is the cluster's
        only model (with several models it names none, and is refused as unknown)."""
        if name and name in self.served_names:
            models = self.view.models()
            if len(models) == 1:
                return next(iter(models))
        return name

    def public_name(self, model: str) -> str:
        """The name the outside world calls ``model`` by: the first --served-model-name
        (when the cluster serves only ``model``), else its own."""
        if self.served_names and set(self.view.models()) <= {model}:
            return self.served_names[0]
        return model

    def context(self, info: dict) -> int:
        """The context a request may use: the model's, capped by --max-model-len."""
        ctx = int(info.get("max_context", 0))
        return min(ctx, self.max_model_len) if self.max_model_len else ctx

    def resolve_model(self, name: str) -> tuple[str, str]:
        models = self.view.models()
        if not models:
            raise Rejected(
                grpc.StatusCode.UNAVAILABLE,
                "no model is served yet: the cluster has no live decode node",
            )
        name = self.alias(name)
        if not name:
            if len(models) > 1:
                raise Rejected(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"model is required: this cluster serves {sorted(models)}",
                )
            name = next(iter(models))
        if name not in models:
            raise Rejected(
                grpc.StatusCode.NOT_FOUND,
                f"unknown model {shown(name)}; this cluster serves {sorted(models)}",
            )
        return name, models[name][0]

    def lookup(self, requested: str) -> tuple[str, dict]:
        """(model, the registration of a node serving it) for a request's model name."""
        model, fp = self.resolve_model(requested)
        nodes = self.view.nodes("decode") + self.view.nodes("prefill")
        return model, next(n.raw for n in nodes if n.fingerprint == fp)

    def tokenizer(self, info: dict):
        """The tokenizer of the model a node registered: --tokenizer when given, else the
        node's model directory where this conductor sees it, else the model's name (a
        preset, a shipped model, a hub id in the Hugging Face cache). One that is not the
        nodes' (by its name) is refused: its tokens would mean other text to them."""
        path = info.get("model_path", "")
        spec = self.tokenizer_spec or (path if os.path.isdir(path) else info.get("model", ""))
        tok = self._tokenizers.get(spec)
        if tok is None:
            try:
                tok = self._tokenizers[spec] = load_tokenizer(spec, hub=True)
            except TokenizerError as e:
                raise Rejected(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"the conductor cannot load the tokenizer of model "
                    f"{info.get('model', '')!r}: {e}; give the conductor --tokenizer (a hub "
                    f"id in its Hugging Face cache or a model directory it can read)",
                ) from None
        want = info.get("tokenizer")
        if want and tok.name != want:
            raise Rejected(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the conductor's tokenizer for model {info.get('model', '')!r} ({spec}, "
                f"{tok.name}) is not the nodes' ({want}); give the conductor the model's "
                f"own with --tokenizer",
            )
        return tok

    async def tokens(self, req: pb.GenerateRequest, info: dict) -> list[int]:
        bad = grpc.StatusCode.INVALID_ARGUMENT
        if req.max_tokens <= 0:
            raise Rejected(bad, f"max_tokens must be > 0, got {req.max_tokens}")
        if req.max_tokens > self.max_tokens_limit:
            raise Rejected(
                bad,
                f"max_tokens is {req.max_tokens}; this cluster allows at most "
                f"{self.max_tokens_limit}",
            )
        if req.token_ids:
            tokens = list(req.token_ids)
            vocab = int(info.get("vocab_size", 0))
            if any(t < 0 or t >= vocab for t in tokens):
                raise Rejected(bad, f"token_ids must be in [0, {vocab}) for this model")
        else:
            tokens = await self._encode(req, info) if req.prompt else []
        if not tokens or (not req.token_ids and not req.prompt.strip()):
            raise Rejected(bad, "the prompt is empty: give prompt text or token_ids")
        if self.max_prompt_tokens and len(tokens) > self.max_prompt_tokens:
            raise Rejected(
                bad,
                f"the prompt has {len(tokens)} tokens; this cluster accepts at "
                f"most {self.max_prompt_tokens}",
            )
        ctx = self.context(info)
        if len(tokens) + req.max_tokens > ctx:
            raise Rejected(
                bad,
                f"the prompt has {len(tokens)} tokens and max_tokens is "
                f"{req.max_tokens}: together they exceed the model's context "
                f"of {ctx} tokens; shorten the prompt or lower max_tokens",
            )
        err = Sampling.from_proto(req.sampling).validate(int(info.get("vocab_size", 0)))
        if err:
            raise Rejected(bad, err)
        if not (req.slo.ttft_ms >= 0 and req.slo.tbt_ms >= 0):  # NaN included
            raise Rejected(
                bad,
                f"slo.ttft_ms and slo.tbt_ms must be numbers >= 0 (0 = the cluster "
                f"default), got {req.slo.ttft_ms:g} and {req.slo.tbt_ms:g}",
            )
        return tokens

    async def _encode(self, req: pb.GenerateRequest, info: dict) -> list[int]:
        ctx = self.context(info)
        return await tokenize_prompt(
            self.tokenizer(info), req.prompt, req.max_tokens, ctx, self.max_prompt_tokens
        )
