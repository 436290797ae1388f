"""Synthetic checkpoints with the exact parameter shapes of real models.

Nothing is downloaded: each entry of :data:`CATALOGUE` lists the tensor names
and shapes that the Hugging Face ``transformers`` implementation puts in the
model's ``state_dict()`` for the published configuration, and
:func:`build_state` fills them with random numbers (never zeros, so that no
layer of the stack can take a shortcut on sparse or constant data).

Tied weights are stored once. GPT-2, Llama-3.2-1B and the ``tiny`` model
share the output projection with the token embedding; ``model.state_dict()``
would list ``lm_head.weight`` as a second name for the same storage, and
``save_pretrained`` / safetensors keep only one copy. The catalogue does the
same, so the parameter count of a full model equals its published count
(GPT-2 small: 124,439,808) and every tensor owns its storage (safetensors
refuses shared storages).

Non-persistent buffers (GPT-2's causal mask, rotary ``inv_freq``) are not part
of a saved ``state_dict`` and are left out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "ModelSpec",
    "CATALOGUE",
    "DEFAULT_MODEL",
    "DTYPES",
    "get_model",
    "model_names",
    "format_bytes",
    "parameter_shapes",
    "layers_for_size",
    "state_bytes",
    "build_state",
    "flatten_state",
]

DEFAULT_MODEL = "tiny"

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The state-dict layout of one model.

    Attributes:
        name: the catalogue key (``--model``).
        description: one line for ``--list-models``.
        architecture: ``gpt2``, ``llama`` or ``phi3`` (the naming scheme of the keys).
        vocab_size, hidden_size, num_layers: as in the model's ``config.json``.
        intermediate_size: MLP width (GPT-2: 4 x hidden).
        num_heads, num_kv_heads: attention heads and key/value heads.
        max_positions: GPT-2's learned position table; unused elsewhere.
        tied_embeddings: the output projection shares the token embedding (stored once).
        published_parameters: the parameter count the model card states, for the full depth.
        default_layers: how many blocks the catalogue entry keeps (``None``: all).
    """

    name: str
    description: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    tied_embeddings: bool
    published_parameters: int | None = None
    max_positions: int = 0
    default_layers: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


CATALOGUE: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="toy",
            description="GPT-2 architecture shrunk to 2 x 64 wide (about 0.2 M parameters); for tests",
            architecture="gpt2",
            vocab_size=1000,
            max_positions=128,
            hidden_size=64,
            num_layers=2,
            intermediate_size=256,
            num_heads=4,
            num_kv_heads=4,
            tied_embeddings=True,
        ),
        ModelSpec(
            name="tiny",
            description="TinyLlama-1.1B shapes, first 4 of 22 blocks (307 M parameters, 0.61 GB in bf16); the default",
            architecture="llama",
            vocab_size=32000,
            hidden_size=2048,
            num_layers=22,
            intermediate_size=5632,
            num_heads=32,
            num_kv_heads=4,
            tied_embeddings=False,
            published_parameters=1_100_048_384,
            default_layers=4,
        ),
        ModelSpec(
            name="gpt2",
            description="GPT-2 small (124 M parameters, lm_head tied to wte)",
            architecture="gpt2",
            vocab_size=50257,
            max_positions=1024,
            hidden_size=768,
            num_layers=12,
            intermediate_size=3072,
            num_heads=12,
            num_kv_heads=12,
            tied_embeddings=True,
            published_parameters=124_439_808,
        ),
        ModelSpec(
            name="gpt2-xl",
            description="GPT-2 XL (1.56 B parameters, lm_head tied to wte)",
            architecture="gpt2",
            vocab_size=50257,
            max_positions=1024,
            hidden_size=1600,
            num_layers=48,
            intermediate_size=6400,
            num_heads=25,
            num_kv_heads=25,
            tied_embeddings=True,
            published_parameters=1_557_611_200,
        ),
        ModelSpec(
            name="tinyllama-1.1b",
            description="TinyLlama-1.1B (1.10 B parameters, untied lm_head, grouped-query attention)",
            architecture="llama",
            vocab_size=32000,
            hidden_size=2048,
            num_layers=22,
            intermediate_size=5632,
            num_heads=32,
            num_kv_heads=4,
            tied_embeddings=False,
            published_parameters=1_100_048_384,
        ),
        ModelSpec(
            name="llama-3.2-1b",
            description="Llama-3.2-1B (1.24 B parameters, lm_head tied to embed_tokens)",
            architecture="llama",
            vocab_size=128256,
            hidden_size=2048,
            num_layers=16,
            intermediate_size=8192,
            num_heads=32,
            num_kv_heads=8,
            tied_embeddings=True,
            published_parameters=1_235_814_400,
        ),
        ModelSpec(
            name="phi-3-mini",
            description="Phi-3-mini-4k (3.82 B parameters, fused qkv_proj and gate_up_proj)",
            architecture="phi3",
            vocab_size=32064,
            hidden_size=3072,
            num_layers=32,
            intermediate_size=8192,
            num_heads=32,
            num_kv_heads=32,
            tied_embeddings=False,
            published_parameters=3_821_079_552,
        ),
        ModelSpec(
            name="llama-3-8b",
            description="Llama-3-8B (8.03 B parameters, untied lm_head)",
            architecture="llama",
            vocab_size=128256,
            hidden_size=4096,
            num_layers=32,
            intermediate_size=14336,
            num_heads=32,
            num_kv_heads=8,
            tied_embeddings=False,
            published_parameters=8_030_261_248,
        ),
    )
}

_ALIASES = {
    "gpt2-small": "gpt2",
    "gpt-2": "gpt2",
    "gpt-2-xl": "gpt2-xl",
    "llama3.2-1b": "llama-3.2-1b",
    "llama-3.1-8b": "llama-3-8b",
    "llama3-8b": "llama-3-8b",
    "phi3-mini": "phi-3-mini",
}


def model_names() -> list[str]:
    return list(CATALOGUE)


def get_model(name: str) -> ModelSpec:
    """The catalogue entry for ``name`` (case-insensitive; a few aliases accepted).

    Raises:
        KeyError: unknown model; the message lists the known ones.
    """
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in CATALOGUE:
        raise KeyError(f"unknown model {name!r}; known models: {', '.join(CATALOGUE)}")
    return CATALOGUE[key]


def _block_shapes(spec: ModelSpec, i: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    h, f = spec.hidden_size, spec.intermediate_size
    if spec.architecture == "gpt2":
        p = f"transformer.h.{i}."
        # GPT-2 uses Conv1D: weights are stored (in_features, out_features).
        yield p + "ln_1.weight", (h,)
        yield p + "ln_1.bias", (h,)
        yield p + "attn.c_attn.weight", (h, 3 * h)
        yield p + "attn.c_attn.bias", (3 * h,)
        yield p + "attn.c_proj.weight", (h, h)
        yield p + "attn.c_proj.bias", (h,)
        yield p + "ln_2.weight", (h,)
        yield p + "ln_2.bias", (h,)
        yield p + "mlp.c_fc.weight", (h, f)
        yield p + "mlp.c_fc.bias", (f,)
        yield p + "mlp.c_proj.weight", (f, h)
        yield p + "mlp.c_proj.bias", (h,)
        return
    p = f"model.layers.{i}."
    kv = spec.num_kv_heads * spec.head_dim
    q = spec.num_heads * spec.head_dim
    if spec.architecture == "llama":
        yield p + "self_attn.q_proj.weight", (q, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        yield p + "self_attn.o_proj.weight", (h, q)
        yield p + "mlp.gate_proj.weight", (f, h)
        yield p + "mlp.up_proj.weight", (f, h)
        yield p + "mlp.down_proj.weight", (h, f)
    elif spec.architecture == "phi3":
        yield p + "self_attn.o_proj.weight", (h, q)
        yield p + "self_attn.qkv_proj.weight", (q + 2 * kv, h)
        yield p + "mlp.gate_up_proj.weight", (2 * f, h)
        yield p + "mlp.down_proj.weight", (h, f)
    else:  # pragma: no cover - the catalogue is closed
        raise AssertionError(spec.architecture)
    yield p + "input_layernorm.weight", (h,)
    yield p + "post_attention_layernorm.weight", (h,)


def parameter_shapes(spec: ModelSpec, layers: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of the state dict, in ``state_dict()`` order.

    Args:
        spec: the model.
        layers: keep only the first ``layers`` transformer blocks (embeddings,
            final norm and output projection are always kept); ``None`` uses the
            entry's default depth.

    Raises:
        ValueError: ``layers`` is negative or larger than the model's depth.
    """
    if layers is None:
        layers = spec.default_layers if spec.default_layers is not None else spec.num_layers
    if not 0 <= layers <= spec.num_layers:
        raise ValueError(f"{spec.name} has {spec.num_layers} layers; cannot keep {layers}")
    h = spec.hidden_size
    shapes: list[tuple[str, tuple[int, ...]]] = []
    if spec.architecture == "gpt2":
        shapes.append(("transformer.wte.weight", (spec.vocab_size, h)))
        shapes.append(("transformer.wpe.weight", (spec.max_positions, h)))
        for i in range(layers):
            shapes.extend(_block_shapes(spec, i))
        shapes.append(("transformer.ln_f.weight", (h,)))
        shapes.append(("transformer.ln_f.bias", (h,)))
    else:
        shapes.append(("model.embed_tokens.weight", (spec.vocab_size, h)))
        for i in range(layers):
            shapes.extend(_block_shapes(spec, i))
        shapes.append(("model.norm.weight", (h,)))
    if not spec.tied_embeddings:
        shapes.append(("lm_head.weight", (spec.vocab_size, h)))
    return shapes


def _numel(shapes: list[tuple[str, tuple[int, ...]]]) -> int:
    return sum(math.prod(shape) for _, shape in shapes)


def parameter_count(spec: ModelSpec, layers: int | None = None) -> int:
    return _numel(parameter_shapes(spec, layers))


def state_bytes(spec: ModelSpec, dtype: torch.dtype, layers: int | None = None, training_state: bool = False) -> int:
    """Tensor bytes of the state :func:`build_state` would make (RNG state excluded)."""
    n = parameter_count(spec, layers)
    size = n * torch.empty(0, dtype=dtype).element_size()
    if training_state:
        size += n * 4 * 2  # Adam exp_avg, exp_avg_sq in fp32
        if dtype != torch.float32:
            size += n * 4  # fp32 master weights
    return size


def layers_for_size(spec: ModelSpec, target_bytes: int, dtype: torch.dtype, training_state: bool = False) -> int:
    """The most transformer blocks whose state stays within ``target_bytes``.

    Returns 0 when only the embeddings fit.

    Raises:
        ValueError: even the embeddings alone exceed ``target_bytes``; the
            message names the smallest size possible.
    """
    best = None
    for layers in range(spec.num_layers + 1):
        if state_bytes(spec, dtype, layers, training_state) > target_bytes:
            break
        best = layers
    if best is None:
        smallest = state_bytes(spec, dtype, 0, training_state)
        fitting = sorted(
            (state_bytes(other, dtype, 0, training_state), name)
            for name, other in CATALOGUE.items()
            if name != spec.name and state_bytes(other, dtype, 0, training_state) <= target_bytes
        )
        advice = (
            f"pick a smaller --model ({', '.join(f'{name}: from {format_bytes(size)}' for size, name in fitting)})"
            " or a larger --size"
            if fitting
            else "give a larger --size"
        )
        raise ValueError(
            f"{spec.name} needs at least {format_bytes(smallest)} (its embeddings alone) in this dtype; "
            f"asked for {format_bytes(target_bytes)}: {advice} (--list-models shows them all)"
        )
    return best


def format_bytes(n: float) -> str:
    """``0.61 GB``-style text (decimal units, as GB/s figures use)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _fill_random(t: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    if t.is_floating_point():
        t.normal_(0.0, 0.02, generator=generator)
        # normal_ can round to exactly 0 in low precision for a few elements; that is fine,
        # the tensor as a whole is random. Norm weights are ~1 in real models; keep that.
    else:  # pragma: no cover - the catalogue has only floating tensors
        t.random_(generator=generator)
    return t


def build_state(
    spec: ModelSpec | str,
    *,
    dtype: torch.dtype | str = torch.bfloat16,
    device: torch.device | str = "cpu",
    layers: int | None = None,
    training_state: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """A state with ``spec``'s shapes filled with random numbers.

    Args:
        spec: a catalogue entry or its name.
        dtype: parameter dtype (``torch.bfloat16`` or ``"bf16"``, ...).
        device: where the tensors live (``"cuda"`` to benchmark saving from the GPU).
        layers: keep the first ``layers`` blocks (see :func:`parameter_shapes`).
        training_state: return a full training checkpoint instead of a bare
            state dict: ``{"model", "optimizer" (Adam exp_avg / exp_avg_sq in
            fp32, step tensors, param_groups), "master_weights" (fp32 copies,
            only when dtype is not fp32), "step", "rng_state"
            (torch.get_rng_state(), plus "cuda_rng_state" on CUDA)}``.
        seed: random seed; the same arguments give the same bytes.

    Every tensor is contiguous and owns its storage.
    """
    if isinstance(spec, str):
        spec = get_model(spec)
    if isinstance(dtype, str):
        dtype = DTYPES[dtype]
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    model: dict[str, torch.Tensor] = {}
    for name, shape in parameter_shapes(spec, layers):
        tensor = _fill_random(torch.empty(shape, dtype=dtype, device=device), generator)
        if name.endswith(("norm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight")):
            tensor.add_(1.0)
        model[name] = tensor
    if not training_state:
        return model
    names = list(model)
    optimizer_state: dict[int, dict[str, torch.Tensor]] = {}
    for index, name in enumerate(names):
        param = model[name]
        exp_avg = _fill_random(torch.empty(param.shape, dtype=torch.float32, device=device), generator)
        exp_avg_sq = _fill_random(torch.empty(param.shape, dtype=torch.float32, device=device), generator).abs_()
        optimizer_state[index] = {
            "step": torch.tensor(1000.0, dtype=torch.float32),
            "exp_avg": exp_avg,
            "exp_avg_sq": exp_avg_sq,
        }
    state: dict[str, Any] = {
        "model": model,
        "optimizer": {
            "state": optimizer_state,
            "param_groups": [
                {
                    "lr": 3e-4,
                    "betas": (0.9, 0.95),
                    "eps": 1e-8,
                    "weight_decay": 0.1,
                    "amsgrad": False,
                    "maximize": False,
                    "foreach": None,
                    "capturable": False,
                    "differentiable": False,
                    "fused": None,
                    "params": list(range(len(names))),
                }
            ],
        },
    }
    if dtype != torch.float32:
        state["master_weights"] = {name: model[name].float() for name in names}
    state["step"] = 1000
    state["rng_state"] = torch.get_rng_state()
    if device.type == "cuda":
        state["cuda_rng_state"] = torch.cuda.get_rng_state(device)
    return state


def flatten_state(state: Any, prefix: str = "") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Splits a nested state into ``{path: tensor}`` and ``{path: other leaf}``.

    Paths join dict keys and list indices with ``.`` (``optimizer.state.3.exp_avg``).
    A flat dict of tensors maps to itself, so a safetensors file written from
    the flattened tensors compares key for key with the original.

    Raises:
        ValueError: two leaves would get the same path.
    """
    tensors: dict[str, torch.Tensor] = {}
    objects: dict[str, Any] = {}

    def visit(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            if path in tensors or path in objects:
                raise ValueError(f"two entries of the state flatten to {path!r}")
            tensors[path] = value
        elif isinstance(value, dict):
            if not value and path:
                objects[path] = {}
            for key, item in value.items():
                visit(item, f"{path}.{key}" if path else str(key))
        elif isinstance(value, (list, tuple)) and any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in value):
            for index, item in enumerate(value):
                visit(item, f"{path}.{index}" if path else str(index))
        else:
            if path in tensors or path in objects:
                raise ValueError(f"two entries of the state flatten to {path!r}")
            objects[path] = value

    visit(state, prefix)
    return tensors, objects


def state_nbytes(state: Any) -> int:
    """Bytes of every tensor in ``state`` (what a checkpoint of it must store)."""
    return sum(t.numel() * t.element_size() for t in flatten_state(state)[0].values())
