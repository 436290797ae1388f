"""Offloaded inference on the CPU: every checkpoint format, budgets from all-resident to one slot, and bad input.

The model is a small transformer-like network (embedding tied to the output
head, blocks of LayerNorm + MLP, a persistent and a non-persistent buffer);
its outputs after ``dispatch`` must equal the fully loaded model's, bit for
bit, under ``no_grad`` and ``inference_mode``, over several passes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch

import fastpersist
from fastpersist.errors import CorruptCheckpointError, UnsafeCheckpointPathError, UnsupportedObjectError
from fastpersist.offload import CheckpointChangedError, OffloadPlanError, dispatch
from fastpersist.offload import index as offload_index

WIDTH, BLOCKS, VOCAB = 64, 6, 100


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self, width: int = WIDTH, blocks: int = BLOCKS, reuse: bool = False):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(blocks))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.tensor(0.5))
        self.register_buffer("offsets", torch.arange(width, dtype=torch.float32) / width, persistent=False)
        self.reuse = reuse

    def forward(self, ids):
        x = self.embed(ids) * self.scale + self.offsets
        for block in self.blocks:
            x = block(x)
        if self.reuse:
            x = self.blocks[0](x)  # a module called twice in one forward
        return self.head(self.norm(x))


def reference(dtype=torch.float32, reuse=False) -> Net:
    torch.manual_seed(0)
    model = Net(reuse=reuse).to(dtype).eval()
    with torch.no_grad():
        model.scale.fill_(0.75)
    return model


def empty(dtype=torch.float32, reuse=False) -> Net:
    """The same network with no weights: parameters on the meta device, the non-persistent buffer real."""
    with torch.device("meta"):
        model = Net(reuse=reuse).to(dtype)
    model.offsets = (torch.arange(WIDTH, dtype=torch.float32) / WIDTH).to(dtype)
    return model


IDS = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(1))


def expected(model: Net) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS)


def save(model: Net, tmp_path, kind: str) -> str:
    state = model.state_dict()
    if kind == "torch":
        path = str(tmp_path / "model.pt")
        torch.save(state, path)
    elif kind == "fastpersist":
        path = str(tmp_path / "model.fp")
        fastpersist.save(state, path)
    elif kind == "safetensors":
        path = str(tmp_path / "model.safetensors")
        fastpersist.save_file(_untied(state), path)
    elif kind == "sharded":
        names = sorted(_untied(state))
        weight_map = {}
        for shard, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
            file = f"model-{shard + 1:05d}-of-00002.safetensors"
            fastpersist.save_file({k: state[k] for k in part}, str(tmp_path / file))
            weight_map.update(dict.fromkeys(part, file))
        with open(tmp_path / "model.safetensors.index.json", "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
        path = str(tmp_path)
    else:
        raise AssertionError(kind)
    return path


def _untied(state: dict) -> dict:
    """safetensors refuses shared storages: keep the first name of tied tensors (as Hugging Face does)."""
    seen, result = set(), {}
    for key, value in state.items():
        if value.data_ptr() not in seen:
            seen.add(value.data_ptr())
            result[key] = value.contiguous()
    return result


@pytest.fixture(autouse=True)
def _close_models():
    models = []
    yield models
    for model in models:
        model.fastpersist_offload.close()


def run(model, passes: int = 3, mode=torch.no_grad):
    outputs = []
    with mode():
        for _ in range(passes):
            outputs.append(model(IDS))
    return outputs


@pytest.mark.parametrize("kind", ["torch", "fastpersist", "safetensors", "sharded"])
@pytest.mark.parametrize("budget", [None, 500_000, 200_000])
def test_outputs_equal_the_loaded_model(kind, budget, tmp_path, _close_models):
    original = reference()
    path = save(original, tmp_path, kind)
    model = dispatch(empty(), path, device="cpu", max_host_memory=budget)
    _close_models.append(model)
    want = expected(original)
    for output in run(model):
        assert torch.equal(output, want)
    placed = model.fastpersist_offload.describe()
    if budget is None:
        assert not placed["streamed"]
    else:
        assert placed["streamed"] and placed["slots"] >= 1


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_slots_prefetch_and_inference_mode(slots, tmp_path, _close_models):
    original = reference(torch.bfloat16)
    path = save(original, tmp_path, "safetensors")
    model = dispatch(empty(torch.bfloat16), path, device="cpu", max_host_memory=450_000, slots=slots, unit_bytes=80_000)
    _close_models.append(model)
    offloaded = model.fastpersist_offload
    assert offloaded.describe()["slots"] == slots
    want = expected(original)
    for output in run(model, mode=torch.inference_mode):
        assert output.dtype == torch.bfloat16 and torch.equal(output, want)
    stats = offloaded.stats()
    assert stats.units_loaded >= len(offloaded.streamed) and stats.bytes_read > 0


def test_module_called_twice_per_forward(tmp_path, _close_models):
    original = reference(reuse=True)
    path = save(original, tmp_path, "torch")
    model = dispatch(empty(reuse=True), path, device="cpu", max_host_memory=250_000, slots=2)
    _close_models.append(model)
    for output in run(model):
        assert torch.equal(output, expected(original))


def test_a_model_built_on_the_cpu_gets_meta_placeholders(tmp_path, _close_models):
    """Values of streamed weights are dropped at dispatch: no second copy in host memory, no stale reads."""
    original = reference()
    path = save(original, tmp_path, "torch")
    built = reference()  # real (CPU) parameters
    model = dispatch(built, path, device="cpu", max_host_memory=250_000, slots=2)
    _close_models.append(model)
    streamed = model.fastpersist_offload.streamed
    assert streamed and all(
        b.module._parameters[b.name].is_meta for u in streamed for b in u.bindings if b.is_parameter
    )
    assert torch.equal(run(model, passes=1)[0], expected(original))


def test_weights_are_restored_to_placeholders_between_passes(tmp_path, _close_models):
    path = save(reference(), tmp_path, "torch")
    model = dispatch(empty(), path, device="cpu", max_host_memory=250_000, slots=2)
    _close_models.append(model)
    run(model, passes=1)
    streamed = model.fastpersist_offload.streamed
    assert streamed and all(
        b.module._parameters[b.name].is_meta for u in streamed for b in u.bindings if b.is_parameter
    )
    assert model.embed.weight.device.type == "cpu" and model.head.weight is model.embed.weight  # tied: resident


def test_threads_share_one_model(tmp_path, _close_models, in_threads):
    original = reference()
    path = save(original, tmp_path, "fastpersist")
    model = dispatch(empty(), path, device="cpu", max_host_memory=250_000, slots=2)
    _close_models.append(model)
    want, results = expected(original), []

    def work(_):
        results.extend(run(model, passes=4))

    errors = in_threads(work, 4)
    assert not errors and len(results) == 16 and all(torch.equal(r, want) for r in results)


def test_close_stops_the_loader_and_refuses_forwards(tmp_path):
    path = save(reference(), tmp_path, "torch")
    model = dispatch(empty(), path, device="cpu", max_host_memory=250_000)
    run(model, passes=1)
    thread = model.fastpersist_offload._thread
    assert thread is not None and thread.is_alive()
    model.fastpersist_offload.close()
    assert not thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        run(model, passes=1)


# ----------------------------------------------------------------------------- bad input


def test_missing_extra_and_mismatched_keys_are_named_at_once(tmp_path):
    state = reference().state_dict()
    state.pop("blocks.1.up.weight")
    state["blocks.9.up.weight"] = torch.zeros(3)
    state["norm.weight"] = torch.zeros(WIDTH + 1)
    state["norm.bias"] = state["norm.bias"].double()
    path = str(tmp_path / "bad.pt")
    torch.save(state, path)
    with pytest.raises(OffloadPlanError) as info:
        dispatch(empty(), path, device="cpu")
    message = str(info.value)
    for text in ("blocks.1.up.weight", "blocks.9.up.weight", "norm.weight", "norm.bias", "torch.float64"):
        assert text in message


def test_budget_below_the_minimum_says_the_minimum(tmp_path):
    path = save(reference(), tmp_path, "torch")
    with pytest.raises(OffloadPlanError, match=r"give at least .* \((\d+) bytes\)") as info:
        dispatch(empty(), path, device="cpu", max_host_memory=10_000)
    minimum = int(info.value.args[0].rsplit("(", 1)[1].split()[0])
    model = dispatch(empty(), path, device="cpu", max_host_memory=minimum, slots=1)
    try:
        assert torch.equal(run(model, passes=1)[0], expected(reference()))
    finally:
        model.fastpersist_offload.close()


def test_checkpoint_changed_on_disk_is_refused(tmp_path, _close_models):
    path = save(reference(), tmp_path, "torch")
    model = dispatch(empty(), path, device="cpu", max_host_memory=250_000)
    _close_models.append(model)
    run(model, passes=1)
    with open(path, "r+b") as f:
        f.seek(0, os.SEEK_END)
        f.write(b"\0" * 10)
    with pytest.raises(CheckpointChangedError, match="changed on disk"):
        run(model, passes=1)


def test_not_a_state_dict_and_strided_tensors_are_refused(tmp_path):
    path = str(tmp_path / "object.pt")
    torch.save({"model": torch.nn.Linear(2, 2)}, path)
    with pytest.raises(UnsupportedObjectError, match="state_dict"):
        dispatch(empty(), path, device="cpu")
    strided = reference().state_dict()
    strided["blocks.0.up.weight"] = strided["blocks.0.up.weight"].t().contiguous().t()
    path = str(tmp_path / "strided.pt")
    torch.save(strided, path)
    with pytest.raises(UnsupportedObjectError, match="blocks.0.up.weight"):
        dispatch(empty(), path, device="cpu")


def test_bad_arguments(tmp_path):
    path = save(reference(), tmp_path, "torch")
    with pytest.raises(ValueError, match="slots"):
        dispatch(empty(), path, device="cpu", slots=0)
    with pytest.raises(ValueError, match="max_gpu_memory is for"):
        dispatch(empty(), path, device="cpu", max_gpu_memory=10)
    with pytest.raises(ValueError, match="byte count"):
        dispatch(empty(), path, device="cpu", max_host_memory=-1)
    with pytest.raises(ValueError, match="12 gigs"):
        dispatch(empty(), path, device="cpu", max_host_memory="12 gigs")
    with pytest.raises(ValueError, match="'cuda' or 'cpu'"):
        dispatch(empty(), path, device="meta")
    with pytest.raises(FileNotFoundError):
        dispatch(empty(), str(tmp_path / "absent.pt"), device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            dispatch(empty(), path, device="cuda")
    model = dispatch(empty(), path, device="cpu")
    try:
        with pytest.raises(ValueError, match="already dispatched"):
            dispatch(model, path, device="cpu")
    finally:
        model.fastpersist_offload.close()


def test_meta_non_persistent_buffers_are_named_as_such(tmp_path, _close_models):
    """A model built under torch.device("meta"): its non-persistent buffers are the fault, not the checkpoint."""
    original = reference()
    path = save(original, tmp_path, "torch")
    with torch.device("meta"):
        model = Net()
    with pytest.raises(OffloadPlanError) as info:
        dispatch(model, path, device="cpu")
    message = str(info.value)
    assert "non-persistent buffers are on the meta device: offsets" in message
    assert "accelerate.init_empty_weights()" in message and "assign those buffers" in message
    assert "missing from the checkpoint" not in message and "does not match" not in message
    state = original.state_dict()
    state.pop("blocks.2.up.bias")
    torch.save(state, str(tmp_path / "partial.pt"))
    with pytest.raises(OffloadPlanError) as info:  # a real mismatch as well: both named, each as what it is
        dispatch(model, str(tmp_path / "partial.pt"), device="cpu")
    assert "missing from the checkpoint: blocks.2.up.bias." in str(info.value)
    assert "on the meta device: offsets" in str(info.value)
    model.offsets = torch.arange(WIDTH, dtype=torch.float32) / WIDTH  # the way out the message gives
    model = dispatch(model, path, device="cpu", max_host_memory=250_000)
    _close_models.append(model)
    assert torch.equal(run(model, passes=1)[0], expected(original))


def _sharded_with(tmp_path, shard_of_last_key: str | None = None) -> tuple[str, str]:
    """A sharded checkpoint in tmp_path/checkpoint whose last index entry names ``shard_of_last_key``."""
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    path = save(reference(), directory, "sharded")
    index_path = directory / "model.safetensors.index.json"
    document = json.loads(index_path.read_text())
    key = list(document["weight_map"])[-1]
    if shard_of_last_key is not None:
        document["weight_map"][key] = shard_of_last_key
        index_path.write_text(json.dumps(document))
    return path, key


@pytest.mark.parametrize("shard", ["../outside.safetensors", "absolute", "sub/model.safetensors", "..", ".", ""])
def test_index_naming_a_file_outside_its_directory_is_refused(shard, tmp_path, monkeypatch):
    """Every weight_map entry must be a plain file name in the index's directory, checked before any shard is
    opened. The files it would lead to exist and hold the right tensors: followed, dispatch would succeed."""
    outside = tmp_path / "outside.safetensors"
    fastpersist.save_file(_untied(reference().state_dict()), str(outside))
    if shard == "absolute":
        shard = str(outside)
    path, key = _sharded_with(tmp_path, shard)
    (tmp_path / "checkpoint" / "sub").mkdir()
    shutil.copy(outside, tmp_path / "checkpoint" / "sub" / "model.safetensors")
    opened = []
    indexed = offload_index._safetensors_file
    monkeypatch.setattr(offload_index, "_safetensors_file", lambda file: opened.append(file) or indexed(file))
    with pytest.raises(UnsafeCheckpointPathError, match="plain file names") as info:
        dispatch(empty(), path, device="cpu")
    assert isinstance(info.value, CorruptCheckpointError)  # what read_index raised for bad indexes before
    assert info.value.record == key and repr(shard) in str(info.value)
    assert opened == []  # the bad entry is the last one: no shard was opened, not even the good ones


def test_index_entries_that_are_not_file_names_are_corrupt(tmp_path):
    path, _ = _sharded_with(tmp_path, None)
    index_path = tmp_path / "checkpoint" / "model.safetensors.index.json"
    document = json.loads(index_path.read_text())
    document["weight_map"]["embed.weight"] = 7
    index_path.write_text(json.dumps(document))
    with pytest.raises(CorruptCheckpointError, match="not a file name"):
        dispatch(empty(), path, device="cpu")
    index_path.write_text(json.dumps({"weight_map": [["embed.weight", "model-00001-of-00002.safetensors"]]}))
    with pytest.raises(CorruptCheckpointError, match="weight_map is not an object"):
        dispatch(empty(), path, device="cpu")


def test_shards_linked_from_elsewhere_are_followed(tmp_path, _close_models):
    """The Hugging Face cache's layout: plain names in the snapshot, symbolic links to blobs in a sibling folder."""
    original = reference()
    path, _ = _sharded_with(tmp_path, None)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for shard in sorted((tmp_path / "checkpoint").glob("*.safetensors")):
        blob = blobs / shard.name.replace("model", "blob")
        shard.rename(blob)
        shard.symlink_to(os.path.relpath(blob, shard.parent))
    model = dispatch(empty(), path, device="cpu", max_host_memory=250_000)
    _close_models.append(model)
    assert torch.equal(run(model, passes=1)[0], expected(original))


# ----------------------------------------------------------------------------- memory and processes

_RSS_CHILD = r"""
import sys, torch
from fastpersist.offload import dispatch
def status(field):  # VmRSS, VmHWM (this process's peak; ru_maxrss would start at the parent's)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
path, budget = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(1)
with torch.device("meta"):
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(12)])  # 201 MB of float32
x = torch.randn(4, 2048)
before, peak_before = status("VmRSS"), status("VmHWM")
model = dispatch(model, path, device="cpu", max_host_memory=budget, slots=2)
with torch.no_grad():
    for _ in range(2):
        model(x)
print(max(status("VmHWM"), peak_before) - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_peak_rss_stays_within_the_budget(tmp_path):
    """A 201 MB model under a 48 MB budget: the process grows by about the budget, not the model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(12)])
    path = str(tmp_path / "big.safetensors")
    fastpersist.save_file(model.state_dict(), path)
    budget = 48 << 20
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD, path, str(budget)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    growth = int(out.stdout.split()[-1])
    assert growth < budget + (24 << 20), f"RSS grew by {growth / 2**20:.0f} MiB with a {budget >> 20} MiB budget"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_streams_with_its_own_loader(tmp_path, _close_models):
    """The child loads units with its own thread and handle (it computes nothing: torch's OpenMP pool is
    not usable after fork, which is torch's limit, not ours)."""
    original = reference()
    path = save(original, tmp_path, "torch")
    model = dispatch(empty(), path, device="cpu", max_host_memory=250_000, slots=2)
    _close_models.append(model)
    run(model, passes=1)  # the parent's loader thread exists and has prefetched
    offloaded = model.fastpersist_offload
    expected_weights = [
        original.get_submodule(name).weight.tolist()
        for name in (u.name for u in offloaded.streamed)
        if hasattr(original.get_submodule(name), "weight")
    ]
    pid = os.fork()
    if pid == 0:
        ok = True
        try:
            units = [u for u in offloaded.streamed if hasattr(u.module, "weight")]
            for unit, weight in zip(units, expected_weights):
                offloaded._activate(unit)
                ok = ok and unit.module.weight.tolist() == weight
                offloaded._deactivate(unit)
        except BaseException:  # noqa: BLE001 - the exit code says it
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert torch.equal(run(model, passes=1)[0], expected(original))


def test_transformers_llama_generates_as_the_loaded_model(tmp_path, _close_models):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    original = transformers.LlamaForCausalLM(config).eval()
    original.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    model = transformers.LlamaForCausalLM(config).eval()  # built on the CPU: its rotary buffers hold values
    model = dispatch(model, str(tmp_path), device="cpu", max_host_memory=200_000, slots=2)
    _close_models.append(model)
    assert model.fastpersist_offload.describe()["streamed"]
    prompt = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = original.generate(prompt, max_new_tokens=5, do_sample=False)
        got = model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert torch.equal(got, want)


def llama_config(transformers, tied: bool, layers: int = 2):
    return transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )


def saved_llama(transformers, config, directory, sharded: bool):
    """A random LlamaForCausalLM (eval mode) and its save_pretrained directory."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, **({"max_shard_size": "100KB"} if sharded else {}))
    assert (directory / "model.safetensors.index.json").exists() == sharded
    return model


LLAMA_IDS = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize(
    ("layout", "tied"), [("sharded directory", True), ("directory", True), ("file", True), ("sharded directory", False)]
)
def test_llama_built_as_the_docs_say_equals_the_loaded_model(layout, tied, tmp_path, _close_models):
    """accelerate.init_empty_weights() + from_config: the tied head is not tied on meta, and save_pretrained
    stored the tied weight once (model.embed_tokens.weight); dispatch ties it, as from_pretrained does."""
    transformers = pytest.importorskip("transformers")
    accelerate = pytest.importorskip("accelerate")
    config = llama_config(transformers, tied)
    original = saved_llama(transformers, config, tmp_path, sharded=layout == "sharded directory")
    path = tmp_path / "model.safetensors" if layout == "file" else tmp_path
    assert ("lm_head.weight" in offload_index.read_index(path)) != tied
    with accelerate.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model = dispatch(model, str(path), device="cpu", max_host_memory=150_000, slots=2)
    _close_models.append(model)
    assert model.fastpersist_offload.describe()["streamed"]
    head, embedding = model.lm_head.weight, model.model.embed_tokens.weight
    assert (head is embedding) == tied and not embedding.is_meta  # tied: one tensor, resident
    with torch.no_grad():
        want = original(LLAMA_IDS).logits
        for _ in range(2):
            assert torch.equal(model(LLAMA_IDS).logits, want)
        tokens = original.generate(LLAMA_IDS, max_new_tokens=4, do_sample=False)
        assert torch.equal(model.generate(LLAMA_IDS, max_new_tokens=4, do_sample=False), tokens)


def test_tied_llama_dispatched_inside_init_empty_weights(tmp_path, _close_models):
    """Inside the context tie_weights() cannot tie (each assigned parameter is wrapped anew): the model's
    declared ties (its expanded _tied_weights_keys) find lm_head.weight under model.embed_tokens.weight."""
    transformers = pytest.importorskip("transformers")
    accelerate = pytest.importorskip("accelerate")
    config = llama_config(transformers, tied=True)
    original = saved_llama(transformers, config, tmp_path, sharded=True)
    with accelerate.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        model.tie_weights()
        assert model.lm_head.weight is not model.model.embed_tokens.weight
        model = dispatch(model, str(tmp_path), device="cpu", max_host_memory=150_000, slots=2)
    _close_models.append(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # bound as one tensor, resident once
    with torch.no_grad():
        assert torch.equal(model(LLAMA_IDS).logits, original(LLAMA_IDS).logits)


class DeclaredNet(Net):
    """Net whose head is a separate tensor in memory, declared tied to the embedding (transformers' convention)."""

    _tied_weights_keys = {"head.weight": "embed.weight"}

    def __init__(self, config=None):
        super().__init__()
        self.head.weight = torch.nn.Parameter(torch.empty_like(self.embed.weight))
        if config is not None:
            self.config = config


def test_declared_ties_of_a_plain_module_and_its_config(tmp_path, _close_models):
    original = reference()
    path = save(original, tmp_path, "safetensors")  # the tied tensor once, as embed.weight
    with torch.device("meta"):
        model = DeclaredNet()
    model.offsets = torch.arange(WIDTH, dtype=torch.float32) / WIDTH
    model = dispatch(model, path, device="cpu", max_host_memory=250_000, slots=2)
    _close_models.append(model)
    assert model.head.weight is model.embed.weight
    assert torch.equal(run(model, passes=2)[-1], expected(original))
    for untied in (Net, lambda: DeclaredNet(types.SimpleNamespace(tie_word_embeddings=False))):
        with torch.device("meta"):
            model = untied()
        if isinstance(model, DeclaredNet):
            model.offsets = torch.arange(WIDTH, dtype=torch.float32) / WIDTH
        else:
            model.head.weight = torch.nn.Parameter(torch.empty_like(model.embed.weight))  # untied, undeclared
            model.offsets = torch.arange(WIDTH, dtype=torch.float32) / WIDTH
        with pytest.raises(OffloadPlanError, match="missing from the checkpoint: head.weight"):
            dispatch(model, path, device="cpu")


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(WIDTH))
        self.gain = self.scale  # one tensor under two names of one module, saved once
        self.bound = []  # per call: both names are the one tensor, with values

    def forward(self, x):
        self.bound.append(self.gain is self.scale and not self.gain.is_meta)
        return x * self.gain + self.scale


class TwoNames(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(WIDTH, WIDTH)
        self.scaled = Scaled()
        self.head = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.head(self.scaled(self.proj(x)))


@pytest.mark.parametrize("budget", [None, 0])
def test_one_tensor_under_two_names_of_one_module(budget, tmp_path, _close_models):
    """Both names get the tensor, resident (budget None) or streamed in their module's unit (the minimum)."""
    torch.manual_seed(0)
    original = TwoNames()
    path = str(tmp_path / "two.safetensors")
    fastpersist.save_file({k: v for k, v in original.state_dict().items() if k != "scaled.gain"}, path)
    with torch.device("meta"):
        model = TwoNames()
    if budget == 0:
        with pytest.raises(OffloadPlanError, match=r"\((\d+) bytes\)") as info:
            dispatch(model, path, device="cpu", max_host_memory=1, slots=1)
        budget = int(info.value.args[0].rsplit("(", 1)[1].split()[0])
    model = dispatch(model, path, device="cpu", max_host_memory=budget, slots=1)
    _close_models.append(model)
    streamed = [name for name, _ in model.fastpersist_offload.describe()["streamed"]]
    assert ("scaled" in streamed) == (budget is not None)
    x = torch.randn(3, WIDTH)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), original(x))
    assert model.scaled.bound == [True, True]


def test_llama_built_on_meta_is_refused_for_its_buffers(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = llama_config(transformers, tied=True)
    saved_llama(transformers, config, tmp_path, sharded=False)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(OffloadPlanError, match=r"on the meta device: model\.rotary_emb\.inv_freq") as info:
        dispatch(model, str(tmp_path), device="cpu")
    assert "missing from the checkpoint" not in str(info.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("host_tier", [None, 10**6])
def test_cuda_streaming_equals_the_model_on_the_gpu(host_tier, tmp_path, _close_models):
    """Slots in device memory, reads through pinned staging (or the host tier), copies on a side stream."""
    original = reference(torch.bfloat16).cuda()
    path = save(original, tmp_path, "safetensors")
    with torch.no_grad():
        want = original(IDS.cuda())
    model = dispatch(empty(torch.bfloat16), path, device="cuda", max_gpu_memory=250_000, max_host_memory=host_tier)
    _close_models.append(model)
    offloaded = model.fastpersist_offload
    assert offloaded.describe()["streamed"]
    misaligned = []

    def note_alignment(module, args):
        misaligned.extend(n for n, p in module.named_parameters(recurse=False) if p.data_ptr() % 512)

    hooks = [m.register_forward_pre_hook(note_alignment) for m in model.modules()]
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(model(IDS.cuda()), want)
    for hook in hooks:
        hook.remove()
    assert misaligned == []  # as aligned as freshly allocated weights: cuBLAS picks the same kernels
    if host_tier:
        assert offloaded.stats().host_tier_hits > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("host_tier", [None, 10**6])
def test_cuda_tied_llama_equals_the_model_on_the_gpu(host_tier, tmp_path, _close_models):
    """The docs' recipe for a tied Llama (init_empty_weights + from_config), streamed on the GPU."""
    transformers = pytest.importorskip("transformers")
    accelerate = pytest.importorskip("accelerate")
    config = llama_config(transformers, tied=True)
    original = saved_llama(transformers, config, tmp_path, sharded=True).cuda()
    ids = LLAMA_IDS.cuda()
    with torch.no_grad():
        want = original(ids).logits
        tokens = original.generate(ids, max_new_tokens=4, do_sample=False)
    with accelerate.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model = dispatch(model, str(tmp_path), device="cuda", max_gpu_memory=150_000, max_host_memory=host_tier)
    _close_models.append(model)
    assert model.fastpersist_offload.describe()["streamed"]
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.is_cuda
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(ids).logits, want)
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), tokens)


def test_device_copies_put_each_tensor_at_its_region_start():
    """Host layout: bytes at the file's offset within the page; device layout: at the region's start."""
    from fastpersist.offload.index import TensorSource
    from fastpersist.offload.plan import Binding, Unit

    module = torch.nn.Linear(1, 1)

    def binding(offset, nbytes, name="weight"):
        source = TensorSource(key=name, path="f", offset=offset, nbytes=nbytes, dtype=torch.uint8, shape=(nbytes,))
        return Binding(module, name, True, source)

    same_shift = Unit("u", module, [binding(8 + 4096, 8192), binding(8 + 3 * 4096, 100), binding(8 + 5 * 4096, 4096)])
    same_shift.lay_out()
    assert [b.region for b in same_shift.reads] == [0, 12288, 16384]
    assert same_shift.device_copies() == [(8, 0, 16384 + 4096)]  # one copy: the padding travels along
    mixed = Unit("m", module, [binding(8, 4000), binding(4096 + 100, 50), binding(2 * 4096 + 100, 50)])
    mixed.lay_out()
    assert mixed.device_copies() == [(8, 0, 4000), (4096 + 100, 4096, 4096 + 50)]
    tied = Unit("t", module, [binding(16, 64), binding(16, 64, name="bias")])
    tied.lay_out()
    assert tied.device_copies() == [(16, 0, 64)]


_EXIT_CHILD = r"""
import sys, torch
sys.path.insert(0, sys.argv[2])
from test_offload import empty, run
from fastpersist.offload import dispatch
model = dispatch(empty(), sys.argv[1], device="cpu", max_host_memory=250_000, slots=2)
run(model, passes=1)
print("ran", flush=True)
# no close(): interpreter exit must stop and join the loader thread
"""


def test_interpreter_exit_with_an_open_model_is_clean(tmp_path):
    path = save(reference(), tmp_path, "torch")
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-c", _EXIT_CHILD, path, here], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0 and "ran" in out.stdout, out.stderr


def test_an_interrupted_forward_releases_its_slot(tmp_path, _close_models, monkeypatch):
    """Ctrl-C inside a streamed module: the slot goes back (always_call hooks) and the next pass is right."""
    original = reference()
    path = save(original, tmp_path, "torch")
    model = dispatch(empty(), path, device="cpu", max_host_memory=250_000, slots=2)
    _close_models.append(model)

    linear = torch.nn.functional.linear

    def interrupt(x, weight, bias=None):
        if weight.shape == (WIDTH, 4 * WIDTH):  # inside a streamed "down" module's own forward
            raise KeyboardInterrupt
        return linear(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", interrupt)
    with pytest.raises(KeyboardInterrupt):
        run(model, passes=1)
    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    assert not model.fastpersist_offload._lock._is_owned()
    assert all(slot.active == 0 for slot in model.fastpersist_offload._slots)
    assert torch.equal(run(model, passes=1)[0], expected(original))
