"""Greedy generation with a Llama-shaped model whose weights are streamed from its checkpoint.

    python examples/offload_generate.py --dir /tmp/offload-example --device cpu
    python examples/offload_generate.py --dir /tmp/offload-example --device cuda --max-gpu-memory 8M --max-host-memory 4M
    python examples/offload_generate.py --dir /tmp/offload-tied --device cpu --tie-word-embeddings

Builds a small randomly initialised LlamaForCausalLM with transformers, saves
it with save_pretrained as sharded safetensors into --dir, builds the same
model without weights (accelerate.init_empty_weights when accelerate is
installed, else on the CPU), dispatches it with fastpersist.offload.dispatch
under a budget smaller than its weights, generates --new-tokens tokens
greedily and checks that they equal those of the fully loaded model. Prints
tokens/s of both, the offload counters and what was placed where.

Without --max-gpu-memory (CUDA) or --max-host-memory (CPU) the budget is half
of the model's weights, so that some modules are streamed. Runs in seconds
on a CPU with the default sizes. With --tie-word-embeddings the output head
is tied to the embedding, as in Llama-3.2-1B, Qwen2.5-0.5B or Gemma:
save_pretrained stores it once and dispatch ties the empty model again.
See docs/offload.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pprint
import sys
import time

import torch

from fastpersist import config
from fastpersist.offload import OffloadPlanError, dispatch


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct parameters and buffers (tied weights counted once)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def generate(model, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float]:
    """Greedy decoding; returns the tokens and the generated tokens per second."""
    if prompt.is_cuda:
        torch.cuda.synchronize(prompt.device)
    start = time.perf_counter()
    with torch.no_grad():
        tokens = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    if prompt.is_cuda:
        torch.cuda.synchronize(prompt.device)
    seconds = time.perf_counter() - start
    return tokens, (tokens.shape[1] - prompt.shape[1]) * tokens.shape[0] / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="where the checkpoint is saved (created if needed)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-gpu-memory", type=config.size_argument, help="device memory for the weights (CUDA)")
    parser.add_argument(
        "--max-host-memory",
        type=config.size_argument,
        help="CUDA: the pinned host tier; CPU: host memory for the weights",
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--tie-word-embeddings",
        action="store_true",
        help="tie the output head to the input embedding (one tensor, stored once)",
    )
    args = parser.parse_args()

    try:
        import transformers
    except ImportError:
        print("this example needs Hugging Face transformers: pip install transformers", file=sys.stderr)
        return 2
    try:
        import accelerate
    except ImportError:
        accelerate = None

    device = torch.device(args.device)
    llama = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=(args.hidden * 8 // 3 + 63) // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=args.tie_word_embeddings,
    )
    torch.manual_seed(0)
    loaded = transformers.LlamaForCausalLM(llama).eval()
    total = weight_bytes(loaded)
    os.makedirs(args.dir, exist_ok=True)
    loaded.save_pretrained(args.dir, safe_serialization=True, max_shard_size=max(total // 4, 1 << 20))
    shards = sorted(name for name in os.listdir(args.dir) if name.endswith(".safetensors"))
    print(f"saved {total / 2**20:.2f} MiB of weights in {len(shards)} safetensors shards to {args.dir}")

    # Parameters on the meta device when accelerate is there (no memory); else real but random, replaced
    # by dispatch. Either way the non-persistent buffers (the rotary frequencies) hold values.
    empty = accelerate.init_empty_weights() if accelerate is not None else contextlib.nullcontext()
    with empty:
        model = transformers.LlamaForCausalLM(llama).eval()
    print(f"empty model built {'with accelerate.init_empty_weights()' if accelerate else 'on the CPU'}")

    gpu_budget, host_budget = args.max_gpu_memory, args.max_host_memory
    if device.type == "cuda" and gpu_budget is None:
        gpu_budget = total // 2
    if device.type == "cpu" and host_budget is None:
        host_budget = total // 2
    try:
        model = dispatch(model, args.dir, device=device, max_gpu_memory=gpu_budget, max_host_memory=host_budget)
    except OffloadPlanError as e:
        print(f"dispatch refused the budget: {e}", file=sys.stderr)
        return 1
    offloaded = model.fastpersist_offload
    budget = gpu_budget if device.type == "cuda" else host_budget
    print(f"dispatched to {device} with a budget of {budget} bytes ({budget / total:.0%} of the weights)")
    if args.tie_word_embeddings:  # saved once, as model.embed_tokens.weight; init_empty_weights() untied them
        print(f"lm_head tied to embed_tokens again: {model.lm_head.weight is model.model.embed_tokens.weight}")

    prompt = torch.randint(0, llama.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1)).to(device)
    try:
        got, offloaded_rate = generate(model, prompt, args.new_tokens)
        streamed_stats = offloaded.stats()
        placed = offloaded.describe()
    finally:
        offloaded.close()
    want, loaded_rate = generate(loaded.to(device), prompt, args.new_tokens)

    same = torch.equal(got, want)
    print(f"generated {args.new_tokens} tokens: {got[0, prompt.shape[1] :].tolist()}")
    print(f"tokens/s: offloaded {offloaded_rate:.1f}, fully loaded {loaded_rate:.1f}")
    print(f"stats: {streamed_stats}")
    print("describe:")
    pprint.pprint(placed, width=120, compact=True)
    print(f"tokens equal the fully loaded model's: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
