"""Byte-level tokenizer shared by all kvmesh nodes."""

from __future__ import annotations


class ByteTokenizer:
    """Byte-level tokenizer: ids 0..255 are raw UTF-8 bytes, 256 is BOS, 257 is EOS."""

    name = "byte-v1"
    bos_id = 256
    eos_id = 257
    vocab_size = 258

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Encode text to token ids, optionally prefixed with BOS."""
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        """Decode token ids to text, skipping special / out-of-byte-range ids."""
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")
