"""Page checksum: one value whatever the input form, and the error classes it must catch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.tiers.checksum import BLOCK_BYTES, page_checksum, page_checksums, to_unsigned


def _random_pages(n: int, page_bytes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, page_bytes), dtype=torch.uint8, generator=g)


def test_golden_values_pin_the_on_disk_algorithm():
    # NVMe slot headers store these values: changing the function needs a new
    # CHECKSUM_ALGORITHM id, not a silent change.
    assert page_checksum(bytes(range(256)) * 4) == 0x8281807F7E7D7C00
    assert page_checksum(bytes(range(256)) * 3 + b"xyz") == 0x3190F04FB07DD9E8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensor_bytes_and_batched_forms_agree(dtype):
    pages = torch.randn(5, 4, 2, 16, 2, 32).to(dtype)
    batched = [to_unsigned(v) for v in page_checksums(pages).tolist()]
    for i in range(5):
        raw = pages[i].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        assert page_checksum(pages[i]) == batched[i] == page_checksum(raw) == page_checksum(memoryview(raw))


@pytest.mark.parametrize("num_bytes", [1, 7, 8, 511, 513, 3 * 1024 + 12])
def test_lengths_that_are_not_whole_blocks_are_zero_padded(num_bytes):
    raw = _random_pages(1, num_bytes)[0]
    padded = torch.cat([raw, torch.zeros((-num_bytes) % BLOCK_BYTES, dtype=torch.uint8)])
    assert page_checksum(raw) == page_checksum(raw.numpy().tobytes()) == page_checksum(padded)


def test_every_single_byte_change_is_detected():
    page = _random_pages(1, 4096, seed=1)[0]
    base = page_checksum(page)
    # Every position with three masks, batched: 3 * 4096 variants.
    for mask in (0x01, 0x80, 0xFF):
        variants = page.repeat(4096, 1)
        idx = torch.arange(4096)
        variants[idx, idx] ^= mask
        assert base not in {to_unsigned(v) for v in page_checksums(variants).tolist()}
    # Every possible new value at the positions of the first and last word.
    positions = list(range(8)) + list(range(4088, 4096))
    variants = page.repeat(len(positions) * 255, 1)
    row = 0
    for pos in positions:
        for mask in range(1, 256):
            variants[row, pos] ^= mask
            row += 1
    assert base not in {to_unsigned(v) for v in page_checksums(variants).tolist()}


def test_any_change_inside_one_word_is_detected():
    page = _random_pages(1, 2048, seed=2)[0]
    words = page.view(torch.int64)
    base = page_checksum(page)
    g = np.random.default_rng(3)
    for _ in range(200):
        w = words.clone()
        i = int(g.integers(0, w.numel()))
        w[i] = int(g.integers(-(2**63), 2**63 - 1, dtype=np.int64))
        if torch.equal(w, words):
            continue
        assert page_checksum(w.view(torch.uint8)) != base


def test_swapped_blocks_and_zeroed_sectors_are_detected():
    page = _random_pages(1, 8 * BLOCK_BYTES, seed=4)[0]
    base = page_checksum(page)
    swapped = page.clone().view(8, BLOCK_BYTES)
    swapped[[2, 5]] = swapped[[5, 2]]
    assert page_checksum(swapped) != base
    zeroed = page.clone()
    zeroed[3 * BLOCK_BYTES : 4 * BLOCK_BYTES] = 0
    assert page_checksum(zeroed) != base


def test_known_blind_spot_compensating_errors_inside_one_block():
    # Documented trade (kvtier/tiers/checksum.py): +x in one word and -x in another word of
    # the same 512-byte block cancel. A CRC would catch this; storage faults do not look like it.
    words = _random_pages(1, BLOCK_BYTES, seed=5)[0].view(torch.int64).clone()
    base = page_checksum(words)
    words[0] += 12345
    words[1] -= 12345
    assert page_checksum(words) == base


def test_page_checksums_handles_an_empty_run_and_rejects_a_scalar():
    assert page_checksums(torch.empty(0, 16)).numel() == 0
    with pytest.raises(ValueError):
        page_checksums(torch.tensor(1.0))
