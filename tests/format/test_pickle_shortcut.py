"""The plain tensor pickling shortcut: same data.pkl as torch.save, and torch's own reduction for the rest."""

from __future__ import annotations

import io
import pickle
import warnings
import zipfile
from collections import OrderedDict

import pytest
import torch

import fastpersist
from fastpersist.format import serializer


class _Subclass(torch.Tensor):
    pass


def _kinds() -> dict:
    """Tensors the shortcut takes, and tensors it must hand to torch's reduction."""
    base = torch.arange(24, dtype=torch.float32)
    with_attribute = torch.ones(2)
    with_attribute.note = "kept"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated
        quantized = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.quint8)
    state = {
        "plain": torch.randn(4, 4),
        "view": base[3:15].view(3, 4).t(),
        "same_storage": base,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, dtype=torch.int64),
        "grad": torch.ones(2, 3, dtype=torch.float64, requires_grad=True),
        "bf16": torch.ones(3, dtype=torch.bfloat16),
        "bool": torch.zeros(4, dtype=torch.bool),
        "conj": torch.ones(2, dtype=torch.complex64).conj(),
        "neg": torch.ones(3)._neg_view(),
        "uint16": torch.arange(4).to(torch.uint16),
        "float8": torch.zeros(3, dtype=torch.float8_e4m3fn),
        "parameter": torch.nn.Parameter(torch.ones(2)),
        "subclass": torch.ones(3).as_subclass(_Subclass),
        "attribute": with_attribute,
        "sparse": torch.eye(3).to_sparse(),
        "quantized": quantized,
        "nested": OrderedDict(a=[torch.ones(1), (torch.zeros(2), 3)]),
        "python": {"step": 3, "lr": 0.1, "name": "x"},
    }
    return state


def _data_pkl(path) -> bytes:
    with zipfile.ZipFile(path) as archive:
        return archive.read(f"{path.stem}/data.pkl")


def _assert_same_data_pkl(state, tmp_path) -> None:
    """Saves ``state`` with fastpersist and torch.save under the same file name; their data.pkl must match."""
    (tmp_path / "ours").mkdir()
    (tmp_path / "torch").mkdir()
    fastpersist.save(state, tmp_path / "ours" / "ckpt.pt")
    torch.save(state, tmp_path / "torch" / "ckpt.pt")
    assert _data_pkl(tmp_path / "ours" / "ckpt.pt") == _data_pkl(tmp_path / "torch" / "ckpt.pt")


def test_data_pkl_is_torch_saves(tmp_path):
    state = _kinds()
    _assert_same_data_pkl(state, tmp_path)
    loaded = fastpersist.load(tmp_path / "ours" / "ckpt.pt", weights_only=False)
    assert torch.equal(loaded["view"], state["view"]) and loaded["view"].stride() == state["view"].stride()
    assert loaded["conj"].is_conj() and loaded["neg"].is_neg() and loaded["grad"].requires_grad
    assert loaded["uint16"].dtype == torch.uint16 and loaded["attribute"].note == "kept"
    assert type(loaded["subclass"]) is _Subclass and isinstance(loaded["parameter"], torch.nn.Parameter)
    assert loaded["view"].untyped_storage().data_ptr() == loaded["same_storage"].untyped_storage().data_ptr()


def test_shortcut_reduces_only_plain_tensors():
    table = serializer._plain_tensor_dispatch_table(2)
    assert table is not None
    reduce = table[torch.Tensor]
    assert torch.nn.Parameter not in table and _Subclass not in table  # exact types only
    function, args = reduce(torch.ones(2))
    assert function is torch._utils._rebuild_tensor_v2
    assert type(args[0]) is serializer._TypedStorageStandIn and type(args[5]) is serializer._NoHooks
    function, args = reduce(torch.ones(2, dtype=torch.uint16))
    assert function is torch._utils._rebuild_tensor_v3 and isinstance(args[0], torch.UntypedStorage)
    with_attribute = torch.ones(2)
    with_attribute.note = 1
    assert reduce(with_attribute)[0] is torch._tensor._rebuild_from_type_v2  # torch's own reduction
    sparse = torch.eye(2).to_sparse()
    assert reduce(sparse)[0] is torch._utils._rebuild_sparse_tensor
    meta = torch.empty(2, device="meta")
    assert reduce(meta)[0] is torch._utils._rebuild_meta_tensor_no_storage


def test_tensor_with_hooks_warns_as_torch_does(tmp_path):
    tensor = torch.ones(2, requires_grad=True)
    tensor.register_hook(lambda grad: grad)
    with pytest.warns(UserWarning, match="backward hook"):
        fastpersist.save({"t": tensor}, tmp_path / "a.pt")


def test_no_shortcut_when_its_check_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(serializer, "_shortcut_checked", {})
    monkeypatch.setattr(serializer, "_shortcut_pickles_as_torch", lambda protocol: False)
    assert serializer._plain_tensor_dispatch_table(2) is None
    state = _kinds()
    _assert_same_data_pkl(state, tmp_path)


def test_check_turns_the_shortcut_off_when_it_differs(monkeypatch):
    def wrong_reducer(protocol):
        def reduce(tensor):
            function, args = tensor.__reduce_ex__(protocol)
            return function, args[:4] + (not args[4],) + args[5:]  # requires_grad flipped

        return reduce

    monkeypatch.setattr(serializer, "_plain_tensor_reducer", wrong_reducer)
    assert serializer._shortcut_pickles_as_torch(2) is False


def test_no_shortcut_under_skip_data_or_a_function_mode():
    with torch.serialization.skip_data():
        assert serializer._plain_tensor_dispatch_table(2) is None

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        assert serializer._plain_tensor_dispatch_table(2) is None


def test_user_pickle_module_gets_torchs_reduction(tmp_path):
    seen = []

    class Pickler(pickle.Pickler):
        def reducer_override(self, obj):
            seen.append(type(obj))
            return NotImplemented

    module = type("Module", (), {"Pickler": Pickler, "Unpickler": pickle.Unpickler})
    fastpersist.save({"t": torch.ones(2)}, tmp_path / "a.pt", pickle_module=module)
    assert serializer._TypedStorageStandIn not in seen and serializer._NoHooks not in seen
    assert OrderedDict in seen  # torch's own backward-hooks dict
    assert torch.equal(torch.load(tmp_path / "a.pt")["t"], torch.ones(2))


def test_protocols_other_than_two(tmp_path):
    state = {"a": torch.ones(3), "b": torch.arange(4).to(torch.uint16)}
    for protocol in (3, 4, 5):
        buffer = io.BytesIO()
        torch.save(state, buffer, pickle_protocol=protocol)
        ours = io.BytesIO()
        fastpersist.save(state, ours, pickle_protocol=protocol)
        with zipfile.ZipFile(buffer) as a, zipfile.ZipFile(ours) as b:
            assert a.read("archive/data.pkl") == b.read("archive/data.pkl")


def test_check_emits_no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert serializer._shortcut_pickles_as_torch(2)
