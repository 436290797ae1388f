"""``python -m fastpersist.bench offload``: generation with a Llama-shaped model streamed from the checkpoint.

Builds a Llama-shaped ``transformers`` model of about ``--size`` bytes of
bf16 with random weights (no downloads), saves it as one safetensors file in
``--dir``, and times greedy generation (``--prompt`` tokens, ``--new-tokens``
new ones, each ``--batch``) for each method:

* ``full-gpu``: the model entirely on the GPU (where it fits): the compute bound;
* ``fastpersist-disk``: ``fastpersist.offload.dispatch`` with
  ``max_gpu_memory=--gpu-budget``: the weights that do not fit are read from
  the file for every forward pass;
* ``fastpersist-host``: the same plus a host tier of the model's size: the
  first pass reads the disk, later ones copy from pinned host memory;
* ``accelerate-disk``: accelerate's ``load_checkpoint_and_dispatch`` with the
  same GPU budget and ``offload_folder`` (where accelerate is installed).

Measured in the same run: the disk's read ceiling (O_DIRECT, page cache
dropped) and the host-to-device copy ceiling, giving each tier's bound in
tokens/s: ``batch x ceiling / bytes streamed per forward pass``. Reported
per method: time to first token, decoding tokens/s (batch x steps / time of
the decoding steps), peak GPU memory, peak host RSS, and the ratio to its bound.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

from fastpersist import config

__all__ = ["build_parser", "main", "to_markdown"]

METHODS = ("full-gpu", "fastpersist-disk", "fastpersist-host", "accelerate-disk")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fastpersist.bench offload", description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=config.size_argument, default=config.size_argument("4G"), help="model bytes")
    parser.add_argument("--dir", required=True, help="where the model file is written (the storage to measure)")
    parser.add_argument("--batch", default="32", help="comma-separated batch sizes")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--gpu-budget", type=config.size_argument, default=None, help="GPU bytes for weights (default: size/4)"
    )
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--accelerate-tokens", type=int, default=4, help="new tokens for accelerate (it is slow)")
    parser.add_argument("--json", default=None)
    return parser


def _llama_config(size: int):
    import transformers

    hidden, intermediate, vocab = 4096, 14336, 32000
    layer = 2 * (2 * hidden * hidden + 2 * hidden * 1024 + 3 * hidden * intermediate + 2 * hidden)
    embeddings = 2 * 2 * vocab * hidden
    layers = max(1, (size - embeddings) // layer)
    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=int(layers),
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )


def _empty_model(llama_config):
    import transformers

    try:
        from accelerate import init_empty_weights
    except ImportError:  # meta parameters, real (CPU) rotary buffers
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(llama_config).to(torch.bfloat16)
        rotary = type(model.model.rotary_emb)(config=llama_config)  # built outside the meta device
        model.model.rotary_emb = rotary
        return model.eval()
    with init_empty_weights():
        model = transformers.LlamaForCausalLM(llama_config).to(torch.bfloat16)
    return model.eval()


class _Clock:
    """A logits processor that notes the time of every generation step (the first one: prefill done)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return scores


def _generate(model, batch: int, prompt: int, new_tokens: int) -> dict[str, Any]:
    import transformers

    from fastpersist.bench.measure import PeakMemory

    ids = torch.randint(100, 30000, (batch, prompt), generator=torch.Generator().manual_seed(0)).cuda()
    clock = _Clock()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with PeakMemory() as host, torch.inference_mode():
        out = model.generate(
            ids,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            logits_processor=transformers.LogitsProcessorList([clock]),
            pad_token_id=0,
        )
    steps = len(clock.times) - 1
    decode = clock.times[-1] - clock.times[0]
    return {
        "batch": batch,
        "ttft_seconds": clock.times[0] - start,
        "decode_tokens_per_second": batch * steps / decode if steps else None,
        "total_seconds": time.perf_counter() - start,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(),
        "peak_host_rss_bytes": host.peak,
        "tokens": out[:, prompt:].cpu(),
    }


def _read_ceiling(path: str) -> float:
    """GB/s of an O_DIRECT read of the whole file through a 1 GiB pinned buffer, page cache dropped first."""
    from fastpersist.io import engine, memory
    from fastpersist.system import CacheDropper

    CacheDropper().drop([path])
    size = os.path.getsize(path)
    piece = 1 << 30
    buffer = memory.new_cpu_locked_tensor(piece)
    file = engine.File(path, "r", direct=True)
    handle = engine.make_handle()
    try:
        start = time.perf_counter()
        for offset in range(0, size, piece):
            handle.submit_read(buffer.data_ptr(), min(piece, size - offset), file, offset, buffer)
            handle.wait()
        return size / (time.perf_counter() - start) / 1e9
    finally:
        file.close()


def _copy_ceiling() -> float:
    from fastpersist.io import memory

    host = memory.new_cpu_locked_tensor(1 << 30)
    device = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    device.copy_(host)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(4):
        device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 4 * (1 << 30) / (time.perf_counter() - start) / 1e9


def to_markdown(document: dict[str, Any]) -> str:
    """A Markdown table of one result document: tokens/s against each tier's bound, TTFT, peak memory."""
    config, ceilings = document["config"], document["ceilings"]
    machine = document.get("machine") or {}
    lines = [
        f"{machine.get('device_name', 'GPU')}, Llama-shaped model of {config['model_bytes'] / 1e9:.2f} GB bf16 "
        f"({config['layers']} layers), GPU budget {config['gpu_budget'] / 1e9:.2f} GB, prompt {config['prompt']}, "
        f"{config['new_tokens']} new tokens ({config['accelerate_new_tokens']} for accelerate); ceilings in the same "
        f"run: disk read {ceilings['disk_read_GBps']:.2f} GB/s, host to device {ceilings['host_to_device_GBps']:.2f} GB/s",
        "",
        "| method | batch | decode tokens/s | bound tokens/s | of bound | time to first token (s) | peak GPU (GB) "
        "| peak host RSS (GB) | same tokens as full-gpu |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for method, rows in document["results"].items():
        for row in rows:
            bound, share = row.get("bound_tokens_per_second"), row.get("of_bound")
            lines.append(
                f"| {method} | {row['batch']} | {row['decode_tokens_per_second']:.2f} | "
                f"{_number(bound, '{:.2f}')} | {_number(share, '{:.2f}x')} | "
                f"{row['ttft_seconds']:.2f} | {row['peak_gpu_bytes'] / 1e9:.2f} | "
                f"{row['peak_host_rss_bytes'] / 1e9:.2f} | {_yes(row.get('same_tokens_as_full_gpu'))} |"
            )
    return "\n".join(lines) + "\n"


def _number(value: float | None, pattern: str) -> str:
    return "" if value is None else pattern.format(value)


def _yes(value: bool | None) -> str:
    return "" if value is None else ("yes" if value else "no")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m fastpersist.bench offload needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        import transformers
    except ImportError:
        print("python -m fastpersist.bench offload needs transformers (pip install transformers)", file=sys.stderr)
        return 2
    import fastpersist
    from fastpersist.bench.measure import machine_info
    from fastpersist.offload import dispatch

    methods = [m for m in args.methods.split(",") if m]
    batches = [int(b) for b in args.batch.split(",") if b]
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "offload-model.safetensors")
    llama_config = _llama_config(args.size)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(llama_config).to(torch.bfloat16).eval()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    fastpersist.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    budget = args.gpu_budget or model_bytes // 4
    print(
        f"model: {llama_config.num_hidden_layers} layers, {model_bytes / 1e9:.2f} GB bf16; GPU budget {budget / 1e9:.2f} GB"
    )
    results: dict[str, list[dict[str, Any]]] = {}
    reference: dict[int, torch.Tensor] = {}
    if "full-gpu" in methods:
        _generate(model, batches[0], 8, 2)  # CUDA and cuBLAS warm-up, untimed
        for batch in batches:
            row = _generate(model, batch, args.prompt, args.new_tokens)
            reference[batch] = row.pop("tokens")
            results.setdefault("full-gpu", []).append(row)
            print(f"full-gpu batch {batch}: {row['decode_tokens_per_second']:.1f} tokens/s", flush=True)
    del model
    torch.cuda.empty_cache()
    read_ceiling, copy_ceiling = _read_ceiling(path), _copy_ceiling()
    print(f"ceilings: disk read {read_ceiling:.2f} GB/s, host-to-device {copy_ceiling:.2f} GB/s", flush=True)
    streamed_bytes = {}
    for method in ("fastpersist-disk", "fastpersist-host"):
        if method not in methods:
            continue
        host_tier = model_bytes if method == "fastpersist-host" else None
        offloaded = dispatch(
            _empty_model(llama_config), path, device="cuda", max_gpu_memory=budget, max_host_memory=host_tier
        )
        state = offloaded.fastpersist_offload
        streamed_bytes[method] = sum(n for _, n in state.describe()["streamed"])
        ceiling = read_ceiling if method == "fastpersist-disk" else copy_ceiling
        for batch in batches:
            if method == "fastpersist-host":
                _generate(offloaded, batch, 8, 1)  # fills the host tier (the first pass reads the disk)
            row = _generate(offloaded, batch, args.prompt, args.new_tokens)
            tokens = row.pop("tokens")
            row["same_tokens_as_full_gpu"] = bool(torch.equal(tokens, reference[batch])) if batch in reference else None
            bound = batch * ceiling * 1e9 / streamed_bytes[method] if streamed_bytes[method] else None
            row["bound_tokens_per_second"] = bound
            row["of_bound"] = row["decode_tokens_per_second"] / bound if bound else None
            row["stats"] = {k: v for k, v in vars(state.stats()).items()}
            results.setdefault(method, []).append(row)
            print(
                f"{method} batch {batch}: {row['decode_tokens_per_second']:.2f} tokens/s (bound {bound or 0:.2f}, "
                f"{(row['of_bound'] or 0):.2f}x), TTFT {row['ttft_seconds']:.2f} s, "
                f"same tokens {row['same_tokens_as_full_gpu']}",
                flush=True,
            )
        state.close()
        del offloaded
        torch.cuda.empty_cache()
    if "accelerate-disk" in methods:
        try:
            from accelerate import load_checkpoint_and_dispatch
        except ImportError:
            print("accelerate-disk: skipped (accelerate is not installed)")
        else:
            model = load_checkpoint_and_dispatch(
                _empty_model(llama_config),
                path,
                device_map="auto",
                max_memory={0: budget, "cpu": 1 << 30},
                offload_folder=os.path.join(args.dir, "accelerate-offload"),
                dtype=torch.bfloat16,
            )
            for batch in batches:
                row = _generate(model, batch, args.prompt, args.accelerate_tokens)
                row.pop("tokens")
                results.setdefault("accelerate-disk", []).append(row)
                print(f"accelerate-disk batch {batch}: {row['decode_tokens_per_second']:.3f} tokens/s", flush=True)
            del model
    document = {
        "benchmark": "offload",
        "machine": machine_info(args.dir, "cuda"),
        "config": {
            "model_bytes": model_bytes,
            "layers": llama_config.num_hidden_layers,
            "gpu_budget": budget,
            "prompt": args.prompt,
            "new_tokens": args.new_tokens,
            "accelerate_new_tokens": args.accelerate_tokens,
            "batches": batches,
        },
        "ceilings": {"disk_read_GBps": read_ceiling, "host_to_device_GBps": copy_ceiling},
        "streamed_bytes_per_pass": streamed_bytes,
        "results": results,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(document, f, indent=2)
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
