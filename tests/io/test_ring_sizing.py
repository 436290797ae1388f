"""The staging ring is sized to the checkpoint, allocated on first use, reused, and releasable."""

from __future__ import annotations

import torch

import fastpersist
from fastpersist.io import memory

MiB = 1 << 20


def test_ring_shape_follows_the_checkpoint():
    assert memory.ring_shape(3 * MiB, 64 * MiB, 4) == (1, 4 * MiB)
    assert memory.ring_shape(100, 64 * MiB, 4) == (1, MiB)
    assert memory.ring_shape(64 * MiB, 64 * MiB, 4) == (1, 64 * MiB)
    assert memory.ring_shape(65 * MiB, 64 * MiB, 4) == (2, 64 * MiB)
    assert memory.ring_shape(10 << 30, 64 * MiB, 8) == (8, 64 * MiB)  # no growth with the checkpoint
    assert memory.ring_shape(0, 64 * MiB, 4)[0] <= 1
    assert memory.ring_shape(3 * MiB, 2 * MiB, 4) == (2, 2 * MiB)  # never above buffer_size


def test_tiny_save_does_not_pin_the_full_ring(tmp_path):
    fastpersist.release_buffers()
    before = memory.pooled_bytes()
    fastpersist.save({"w": torch.randn(1000)}, tmp_path / "tiny.pt")
    assert memory.pooled_bytes() - before <= 2 * MiB  # not 4 x 64 MiB


def test_ring_is_reused_then_released(tmp_path):
    state = {"w": torch.randn(3 * MiB // 4)}  # 3 MiB: one 4 MiB buffer
    fastpersist.release_buffers()
    fastpersist.save(state, tmp_path / "a.pt")
    after_first = memory.pooled_bytes()
    assert after_first > 0
    for _ in range(3):
        fastpersist.save(state, tmp_path / "a.pt")
    assert memory.pooled_bytes() == after_first  # reused, not reallocated
    assert fastpersist.release_buffers() >= after_first
    assert memory.pooled_bytes() == 0
    fastpersist.save(state, tmp_path / "a.pt")  # allocated again on first use
    assert torch.equal(fastpersist.load(tmp_path / "a.pt")["w"], state["w"])


def test_pool_holds_few_size_classes(tmp_path):
    fastpersist.release_buffers()
    for n in range(1, 40, 3):  # 39 different checkpoint sizes
        fastpersist.save({"w": torch.randn(n * 25_000)}, tmp_path / "x.pt")
    # Power-of-two classes: at most 1+2+4 MiB here, not one buffer per size.
    assert memory.pooled_bytes() <= 8 * MiB
    fastpersist.release_buffers()


def test_a_cuda_load_smaller_than_its_ring_spreads_over_every_buffer():
    """One storage waited for on its own (weights_only=False) is read by all the ring's handles, not one."""
    from fastpersist import config
    from fastpersist.io.reader import _window_size

    settings = config.resolve({})  # 16 MiB x 16 by default
    assert _window_size(36 * MiB, settings) == 36 * MiB // 16  # a 36 MB record: 16 windows of 2.25 MiB
    assert _window_size(10 << 30, settings) == 16 * MiB  # a batch larger than the ring: full windows
    assert _window_size(2 * MiB, settings) == MiB  # never below 1 MiB
    assert _window_size(36 * MiB + 1, settings) % 4096 == 0
    small = config.resolve({"read_buffer_size": "256K", "block_size": "256K"})
    assert _window_size(100 * MiB, small) == 256 << 10 and _window_size(10, small) == 256 << 10
