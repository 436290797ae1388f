"""The device digest that decides which bytes another rank may write: its definition, steps and sensitivity.

``device_digests`` runs on any device; here on the CPU, with small rows so
that every code path (whole steps, a short last step, leftover words, tail
bytes, many storages of different lengths) runs on a few KiB. The reference
is the formula in :mod:`fastpersist.distributed.replicas`, computed in one go.
"""

from __future__ import annotations

import pytest
import torch

from fastpersist.distributed import replicas

ROW = 16


@pytest.fixture
def small_rows(monkeypatch):
    monkeypatch.setattr(replicas, "_ROW", ROW)
    monkeypatch.setattr(replicas, "_ROWS_PER_STEP", 3)
    monkeypatch.setattr(replicas, "_weights", {})
    monkeypatch.setattr(replicas, "_offsets", {})


def reference(view: torch.Tensor) -> int:
    """``sum(mix(x[i] * w[i % R] + r[i // R]))`` over 32-bit words, plus the tail bytes, modulo 2**64."""
    weights = replicas._row_weights(view.device)
    words = view.numel() // 4
    index = torch.arange(words, dtype=torch.int64)
    values = view[: words * 4].view(torch.int32).to(torch.int64) * weights[index % ROW]
    values += (index // ROW) * replicas._OFFSET_STEP + replicas._OFFSET_BASE
    tail = view[words * 4 :].to(torch.int64) * weights[: view.numel() - words * 4] + replicas._TAIL_OFFSET
    total = 0
    for part in (values, tail):
        part ^= part >> 31
        total += int(part.sum())
    return replicas._signed(total)


SIZES = [1, 3, 4, 7, 4 * ROW, 4 * ROW + 5, 4 * ROW * 3, 4 * ROW * 3 + 4, 4 * ROW * 7 + 2, 4 * ROW * 9]


def test_batched_digests_follow_the_definition(small_rows):
    generator = torch.Generator().manual_seed(3)
    views = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator) for n in SIZES]
    digests = replicas.device_digests(views)
    assert digests.dtype == torch.int64 and digests.shape == (len(SIZES),)
    assert digests.tolist() == [reference(v) for v in views]
    assert [int(replicas.device_digest(v)) for v in views] == digests.tolist()


def test_every_single_bit_flip_changes_the_digest(small_rows):
    view = torch.randint(0, 256, (4 * ROW * 7 + 3,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    before = int(replicas.device_digest(view))
    seen = {before}
    for position in range(view.numel()):
        for bit in (0, 7):
            changed = view.clone()
            changed[position] ^= 1 << bit
            seen.add(int(replicas.device_digest(changed)))
    assert len(seen) == 1 + 2 * view.numel()


def test_sign_flips_in_two_words_do_not_cancel(small_rows):
    """Without the mix, flipping the top bit of two words could cancel modulo 2**64."""
    view = torch.zeros(4 * ROW * 2, dtype=torch.uint8)
    before = int(replicas.device_digest(view))
    changed = view.clone()
    changed[3] ^= 0x80
    changed[4 * ROW + 3] ^= 0x80
    assert int(replicas.device_digest(changed)) != before


def test_real_row_length_matches_the_definition():
    """The production constants: a storage of several steps plus leftover words and tail bytes."""
    size = 4 * replicas._ROW * (replicas._ROWS_PER_STEP + 1) + 4 * 1000 + 3
    view = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    assert replicas._steps(size) == 4
    weights = replicas._row_weights(view.device)
    words = size // 4
    index = torch.arange(words, dtype=torch.int64)
    values = view[: words * 4].view(torch.int32).to(torch.int64) * weights[index % replicas._ROW]
    values += (index // replicas._ROW) * replicas._OFFSET_STEP + replicas._OFFSET_BASE
    values ^= values >> 31
    tail = view[words * 4 :].to(torch.int64) * weights[:3] + replicas._TAIL_OFFSET
    tail ^= tail >> 31
    assert int(replicas.device_digest(view)) == replicas._signed(int(values.sum()) + int(tail.sum()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_digests_equal_the_cpu_ones():
    """Ranks compare digests made on their own devices: a CUDA digest must be the CPU one of the same bytes."""
    generator = torch.Generator().manual_seed(11)
    sizes = [4 * replicas._ROW * 20 + 17, 4 * replicas._ROW + 4, 70 << 10]
    views = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator) for n in sizes]
    on_gpu = replicas.device_digests([v.cuda() for v in views]).tolist()
    assert on_gpu == replicas.device_digests(views).tolist()
