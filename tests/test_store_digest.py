"""The digest a store-node keeps per indexed block (checked before it re-reports the
block to a restarted store-master): crc32 for small values, block sums for large ones;
either way a changed byte anywhere, or another value in the slot, is caught."""

from __future__ import annotations

import os
import zlib

from kvmesh.services.store.segment import DIGEST_SUM_MIN, digest


def test_small_values_use_crc32():
    data = os.urandom(DIGEST_SUM_MIN - 1)
    assert digest(memoryview(data)) == zlib.crc32(data)


def test_large_values_catch_any_flipped_byte_and_another_value():
    for n in (DIGEST_SUM_MIN, (4 << 20) + 5, (16 << 20) - 3):
        data = bytearray(os.urandom(n))
        d = digest(memoryview(data))
        assert d == digest(memoryview(bytes(data)))  # a function of the bytes alone
        for pos in (0, 7, 4095, 4096, n // 2, n - 9, n - 1):
            data[pos] ^= 0x40
            assert digest(memoryview(data)) != d, (n, pos)
            data[pos] ^= 0x40
        # two 4 KiB blocks swapped, or another value written over the slot
        swapped = data[4096:8192] + data[:4096] + data[8192:]
        assert digest(memoryview(swapped)) != d
        assert digest(memoryview(os.urandom(n))) != d
