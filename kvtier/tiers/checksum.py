"""Page checksums: computed when a page leaves HBM, verified when it comes back (DESIGN §5.6).

The function is a position-weighted sum of 64-bit words, "wsum64/512":

    words  w[i]     the page bytes as little-endian 64-bit words (tail zero-padded to 512 bytes)
    blocks S[b]   = sum of the 64 words of 512-byte block b                mod 2**64
    checksum      = sum over b of (2b + 1) * S[b]                          mod 2**64

Why this one (measured on the 2-core CI machine, copy of a page then checksum of the
destination while it is in cache, 2 MiB pages, GB/s; memcpy alone 19.6):

    wsum64/512 in torch   14.9     zlib.crc32   4.5     zlib.adler32  ~3.9 (alone)
    xxh3_64 (PyPI)        14.8     crc32c (PyPI, SSE4.2)  11.2     blake2b-8  ~1.4 (alone)

It is as fast as xxh3 without a new dependency, it reduces a whole run of pages in one
batched tensor op (no per-page Python call: that overhead halves crc32/xxh3 on 32 KiB
pages), and the same integer arithmetic runs on a CUDA tensor, so pages are summed in
HBM before they leave and again in HBM after they return (end to end, no host CPU).
Integer addition mod 2**64 is associative, so every reduction order gives the same value.

What it guarantees: any change confined to one 64-bit word is detected (a flipped bit or
byte changes the word by d * 2**(8k) with 0 < |d| < 256, k < 8, which is not 0 mod 2**64,
and the odd weight is invertible mod 2**64), and so is a swap of two 512-byte blocks
whose sums differ. What it gives up against a CRC: errors that cancel inside one block
(+x in one word, -x in another) or a reordering of words inside a block go unseen.
Storage fails by flipped bits, torn or zeroed sectors and misdirected writes; the NVMe
slot header adds the page key and slot number against the last, so the trade is taken.
"""

from __future__ import annotations

import numpy as np
import torch

CHECKSUM_ALGORITHM = 1  # stored in NVMe slot headers; bump when the function changes
BLOCK_BYTES = 512
_WORDS_PER_BLOCK = BLOCK_BYTES // 8
_MASK64 = (1 << 64) - 1

_torch_weights: dict[tuple[int, torch.device], torch.Tensor] = {}
_numpy_weights: dict[int, np.ndarray] = {}


def _weights_t(num_blocks: int, device: torch.device) -> torch.Tensor:
    w = _torch_weights.get((num_blocks, device))
    if w is None:
        w = torch.arange(1, 2 * num_blocks, 2, dtype=torch.int64, device=device)
        _torch_weights[(num_blocks, device)] = w
    return w


def _weights_np(num_blocks: int) -> np.ndarray:
    w = _numpy_weights.get(num_blocks)
    if w is None:
        w = np.arange(1, 2 * num_blocks, 2, dtype=np.uint64)
        _numpy_weights[num_blocks] = w
    return w


def page_checksums(pages: torch.Tensor) -> torch.Tensor:
    """Checksums of a run of pages ``[n, ...]`` as an int64 tensor ``[n]`` on the same device.

    One batched reduction for the whole run. Values are the unsigned checksums stored
    as two's complement; ``to_unsigned`` turns one into the ``int`` that
    ``page_checksum`` returns.
    """
    if pages.dim() == 0:
        raise ValueError("page_checksums needs a run of pages [n, ...], got a scalar")
    n = pages.shape[0]
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=pages.device)
    raw = pages.contiguous().view(n, -1).view(torch.uint8)
    tail = (-raw.shape[1]) % BLOCK_BYTES
    if tail or raw.data_ptr() % 8:
        raw = torch.nn.functional.pad(raw, (0, tail))
    blocks = raw.view(torch.int64).view(n, -1, _WORDS_PER_BLOCK).sum(dim=2)
    return (blocks * _weights_t(blocks.shape[1], blocks.device)).sum(dim=1)


def to_unsigned(value: int) -> int:
    return value & _MASK64


def page_checksum(buf: memoryview | bytes | bytearray | torch.Tensor) -> int:
    """Checksum of one page (a tensor of any dtype, or its raw bytes) as an unsigned 64-bit int."""
    if isinstance(buf, torch.Tensor):
        return to_unsigned(int(page_checksums(buf.reshape(1, -1))[0]))
    raw = np.frombuffer(buf, dtype=np.uint8)
    tail = (-raw.size) % BLOCK_BYTES
    if tail:
        raw = np.concatenate([raw, np.zeros(tail, dtype=np.uint8)])
    # numpy uint64 arithmetic wraps mod 2**64 exactly like torch's int64.
    blocks = raw.view("<u8").reshape(-1, _WORDS_PER_BLOCK).sum(axis=1, dtype=np.uint64)
    return int((blocks * _weights_np(blocks.size)).sum(dtype=np.uint64))
