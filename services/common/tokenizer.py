"""Tokenizers shared by all kvmesh nodes and the conductor.

Two implementations of one interface (:class:`Tokenizer`):

* :class:`ByteTokenizer` for the random presets (ids 0..255 are UTF-8 bytes);
* :class:`HFTokenizer` for Hugging Face model directories (``tokenizer.json`` through
  the ``tokenizers`` library, BOS/EOS from ``tokenizer_config.json``, ``config.json``
  and ``generation_config.json``).

:func:`load_tokenizer` picks one from a model spec (preset name, shipped model, directory,
or a Hugging Face hub id from the HF cache). This
module must stay torch-free: the conductor imports it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable


class TokenizerError(ValueError):
    """A tokenizer file is missing or malformed (the message names the file)."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine and the conductor need from a tokenizer."""

    name: str  # identifies the vocabulary/merges; part of the model fingerprint
    bos_id: int | None  # prepended by encode(add_bos=True); None when the model has none
    eos_id: int  # the primary end-of-sequence id
    eos_ids: frozenset[int]  # every id that ends generation
    vocab_size: int
    # the most UTF-8 bytes of input one token can stand for, when the tokenizer keeps
    # every input byte (so a text of n bytes is at least ceil(n / max_token_bytes)
    # tokens); None when no such bound is known (normalizers, stripping)
    max_token_bytes: int | None

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """Byte-level tokenizer: ids 0..255 are raw UTF-8 bytes, 256 is BOS, 257 is EOS."""

    name = "byte-v1"
    bos_id = 256
    eos_id = 257
    eos_ids = frozenset({257})
    vocab_size = 258
    max_token_bytes = 1

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Encode text to token ids, optionally prefixed with BOS."""
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Decode token ids to text, skipping special / out-of-byte-range ids."""
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")


def read_json(path: str, required: bool = True) -> dict[str, Any] | None:
    """Parse a JSON object file; a clear :class:`TokenizerError` naming it when bad."""
    if not os.path.isfile(path):
        if required:
            raise TokenizerError(f"{path}: file not found")
        return None
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: malformed JSON ({e})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _ids(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    vals = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in vals):
        raise TokenizerError(
            f"{where}: eos_token_id must be an int or a list of ints, got {value!r}"
        )
    return list(vals)


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


LONG_TEXT = 1 << 14  # characters


def _byte_level_bound(spec: dict, tok: Any) -> int | None:
    """``max_token_bytes`` of a ``tokenizer.json``: known for byte-level BPE that keeps
    every byte (no normalizer, a ByteLevel pre-tokenizer, nothing split off as removed, the
    whole byte alphabet in the vocabulary, no added token that strips the text around
    it), as the longest token in UTF-8 bytes; None for anything else."""
    from tokenizers import pre_tokenizers

    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if (
        spec.get("normalizer") is not None
        or (spec.get("model") or {}).get("type") != "BPE"
        or not any(p.get("type") == "ByteLevel" for p in steps)
        or any(p.get("type") not in ("ByteLevel", "Split", "Digits") for p in steps)
        or any(p.get("behavior", "Isolated") == "Removed" for p in steps)
        or any(a.get("lstrip") or a.get("rstrip") for a in spec.get("added_tokens") or [])
    ):
        return None
    vocab = tok.get_vocab(with_added_tokens=True)
    if not set(pre_tokenizers.ByteLevel.alphabet()) <= vocab.keys():
        return None
    return max(len(t.encode("utf-8")) for t in vocab)


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (via ``tokenizers``) plus the model's special ids.

    * ``encode`` runs the tokenizer *without* its post-processor's special tokens and
      prepends ``bos_id`` itself when ``add_bos`` (so BOS is never doubled and a model
      without BOS, e.g. Qwen2, gets none);
    * ``bos_id``: ``tokenizer_config.json`` ``bos_token`` when that file exists (``null``
      or ``add_bos_token: false`` means no BOS), else ``config.json`` ``bos_token_id``;
    * ``eos_ids``: union of ``eos_token_id`` (an int or a list) from
      ``generation_config.json`` and ``config.json`` and the ``eos_token`` of
      ``tokenizer_config.json``; ``eos_id`` is the first of them (generation config first);
    * ``name``: ``"hf-"`` + sha256 of the ``tokenizer.json`` bytes (first 32 hex digits).
    """

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as _HFTok  # torch-free

        self.path = os.path.abspath(path)
        tok_file = os.path.join(self.path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise TokenizerError(
                f"{tok_file}: file not found (only tokenizer.json tokenizers are supported)"
            )
        with open(tok_file, "rb") as f:
            raw = f.read()
        try:
            self._tok = _HFTok.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON/schema
            raise TokenizerError(f"{tok_file}: cannot load tokenizer ({e})") from None
        self.name = "hf-" + hashlib.sha256(raw).hexdigest()[:32]
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

        cfg = read_json(os.path.join(self.path, "config.json"), required=False) or {}
        gen = read_json(os.path.join(self.path, "generation_config.json"), required=False) or {}
        tcfg = read_json(os.path.join(self.path, "tokenizer_config.json"), required=False)

        if tcfg is not None:
            bos_tok = _token_content(tcfg.get("bos_token"))
            self.bos_id = self._tok.token_to_id(bos_tok) if bos_tok else None
            if tcfg.get("add_bos_token") is False:
                self.bos_id = None
        else:
            b = cfg.get("bos_token_id")
            self.bos_id = b if isinstance(b, int) and not isinstance(b, bool) else None

        eos: list[int] = []
        eos += _ids(gen.get("eos_token_id"), os.path.join(self.path, "generation_config.json"))
        eos += _ids(cfg.get("eos_token_id"), os.path.join(self.path, "config.json"))
        if tcfg is not None:
            eos_tok = _token_content(tcfg.get("eos_token"))
            tid = self._tok.token_to_id(eos_tok) if eos_tok else None
            if tid is not None:
                eos.append(tid)
        if not eos:
            raise TokenizerError(
                f"{self.path}: no eos_token_id in config.json / generation_config.json "
                f"and no eos_token in tokenizer_config.json"
            )
        self.eos_id = eos[0]
        self.eos_ids = frozenset(eos)
        self.max_token_bytes = _byte_level_bound(json.loads(raw), self._tok)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text``, prefixed with ``bos_id`` when ``add_bos`` and the model has one.

        A long text goes through ``encode_batch``, which lets go of the GIL while it
        works: called from a thread, it leaves the caller's event loop running."""
        if len(text) > LONG_TEXT:
            ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else list(ids)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, skipping special tokens (BOS/EOS/...)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, name={self.name!r})"


# the files a tokenizer needs from a Hugging Face hub snapshot
HUB_TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "generation_config.json",
]
# models shipped inside kvmesh (engine.config.SHIPPED_MODELS), found without importing the
# engine: their folders beside the engine's modules
SHIPPED_TOKENIZERS = ("demo",)


def shipped_dir(name: str) -> str:
    """The folder of the shipped model ``name`` (package data of ``services/engine``)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine", name)


def hub_tokenizer_dir(repo_id: str) -> str:
    """The local snapshot folder holding hub id ``repo_id``'s tokenizer files, from the
    Hugging Face cache (``HF_HOME``/``HF_HUB_CACHE``; the nodes' download of the model put
    them there), downloaded there first unless ``HF_HUB_OFFLINE=1``. A clear
    :class:`TokenizerError` when it cannot be had."""
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise TokenizerError(
            f"{repo_id}: a Hugging Face hub id needs huggingface_hub (pip install "
            f"huggingface_hub, or give a model directory)"
        ) from None
    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        return str(
            snapshot_download(repo_id, allow_patterns=HUB_TOKENIZER_FILES, local_files_only=offline)
        )
    except LocalEntryNotFoundError:
        raise TokenizerError(
            f"{repo_id}: not in the Hugging Face cache {constants.HF_HUB_CACHE}"
            + (" (HF_HUB_OFFLINE is set: nothing is downloaded)" if offline else "")
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise TokenizerError(f"{repo_id}: cannot get it from the Hugging Face hub: {e}") from None


def _looks_like_hub_id(spec: str) -> bool:
    org, _, name = spec.partition("/")
    return bool(org and name) and "/" not in name and not spec.startswith((".", "~"))


def load_tokenizer(spec: str, hub: bool = False) -> ByteTokenizer | HFTokenizer:
    """Tokenizer of a model spec: a directory -> :class:`HFTokenizer`; a shipped model's
    name (``demo``) -> its folder's; with ``hub``, a Hugging Face hub id (``org/name``)
    -> its snapshot's (:func:`hub_tokenizer_dir`); else (a preset name, e.g.
    ``tiny``/``small``: every preset uses bytes) -> :class:`ByteTokenizer`.

    A spec that looks like a path (contains a path separator) but is not a directory (nor,
    with ``hub``, a hub id) raises :class:`TokenizerError`.
    """
    if os.path.isdir(spec):
        return HFTokenizer(spec)
    if spec in SHIPPED_TOKENIZERS and os.path.isdir(shipped_dir(spec)):
        return HFTokenizer(shipped_dir(spec))
    if hub and _looks_like_hub_id(spec) and not os.path.exists(spec):
        return HFTokenizer(hub_tokenizer_dir(spec))
    if os.sep in spec or "/" in spec or os.path.exists(spec):
        raise TokenizerError(f"{spec}: not a model directory")
    return ByteTokenizer()
