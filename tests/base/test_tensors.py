"""fastpersist.tensors: byte views of tensors."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from fastpersist.tensors import host_memoryview


def test_a_memoryview_keeps_its_tensor_alive():
    # A view of a temporary (``t.cpu()``, ``t.contiguous()``) must stay valid: the
    # collective save once wrote freed memory from exactly such a view.
    tensor = torch.full((1 << 20,), 7, dtype=torch.uint8)
    owner = weakref.ref(tensor)
    view = host_memoryview(tensor)
    piece = view[10:20]
    del tensor, view
    gc.collect()
    assert owner() is not None
    scratch = [torch.full((1 << 20,), 1, dtype=torch.uint8) for _ in range(8)]  # reuse freed memory if any
    assert bytes(piece) == b"\x07" * 10
    del piece, scratch
    gc.collect()
    assert owner() is None


def test_a_memoryview_is_writable_and_shares_the_storage():
    tensor = torch.zeros(8, dtype=torch.int16)
    view = host_memoryview(tensor)
    assert view.nbytes == 16 and view.format == "B"
    view[0] = 1
    assert tensor[0].item() == 1


@pytest.mark.parametrize("tensor", [torch.zeros(4, 4).t(), torch.zeros(4, device="meta")])
def test_only_contiguous_cpu_tensors(tensor):
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        host_memoryview(tensor)


def test_an_empty_tensor_gives_an_empty_view():
    assert host_memoryview(torch.empty(0)).nbytes == 0
