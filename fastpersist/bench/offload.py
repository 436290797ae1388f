"""``python -m fastpersist.bench offload``: generation with a Llama-shaped model streamed from the checkpoint.

Greedy generation from a random bf16 model saved in ``--dir``: ``full-gpu`` (the compute bound; its tokens are the
reference), ``fastpersist-disk`` (``fastpersist.offload.dispatch`` within ``--gpu-budget``), ``fastpersist-host`` (plus
a host tier) and ``accelerate-disk``, each against its tier's bound from the disk read and host-to-device ceilings
measured in the same run. See docs/offload.md.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

import torch

from fastpersist.bench.harness import Benchmark, Svg, UsageError, markdown_table, option, size

__all__ = ["BENCHMARK", "METHODS", "main", "to_markdown", "to_svg"]

METHODS = ("full-gpu", "fastpersist-disk", "fastpersist-host", "accelerate-disk")


def _options(parser: argparse.ArgumentParser) -> None:
    option(parser, "size", default=4 << 30, help="model bytes")
    option(parser, "dir", help="where the model file is written (the storage to measure); required to run")
    parser.add_argument("--batch", default="32", help="comma-separated batch sizes")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--gpu-budget", type=size, default=None, help="GPU bytes for weights (default: size/4)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--accelerate-tokens", type=int, default=4, help="new tokens for accelerate (it is slow)")
    disk = "new tokens for fastpersist-disk (default: --new-tokens; every step reads the streamed weights from disk)"
    parser.add_argument("--disk-tokens", type=int, default=None, help=disk)
    folder = "accelerate's offload_folder (default: DIR/accelerate-offload; it writes a copy of the offloaded weights)"
    parser.add_argument("--accelerate-offload-dir", default=None, help=folder)
    free = "let cuBLAS and torch pick nondeterministic kernels (default: deterministic ones: tokens comparable bit for bit)"
    parser.add_argument("--nondeterministic", action="store_true", help=free)


def _llama_config(size: int):
    import transformers

    hidden, intermediate, vocab = 4096, 14336, 32000
    layer = 2 * (2 * hidden * hidden + 2 * hidden * 1024 + 3 * hidden * intermediate + 2 * hidden)
    layers = max(1, (size - 2 * 2 * vocab * hidden) // layer)  # less the embeddings and the output head
    shape = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=int(layers))
    heads = dict(num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096)
    return transformers.LlamaConfig(**shape, **heads, tie_word_embeddings=False, torch_dtype="bfloat16")


def _empty_model(llama_config):
    import transformers

    try:
        from accelerate import init_empty_weights
    except ImportError:  # meta parameters, real (CPU) rotary buffers
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(llama_config).to(torch.bfloat16)
        model.model.rotary_emb = type(model.model.rotary_emb)(config=llama_config)  # built outside the meta device
        return model.eval()
    with init_empty_weights():
        model = transformers.LlamaForCausalLM(llama_config).to(torch.bfloat16)
    return model.eval()


class _Clock:
    """A logits processor noting the time of every step (the first: prefill done) and keeping the prefill's logits;
    ``between_steps`` runs after each step's time is noted, its duration left out of the timeline."""

    def __init__(self, between_steps=None):
        self.times: list[float] = []
        self.first_scores: torch.Tensor | None = None
        self._between = between_steps
        self._excluded = 0.0

    def __call__(self, input_ids, scores):
        torch.cuda.synchronize()
        now = time.perf_counter()
        if self.first_scores is None:
            self.first_scores = scores.float().cpu()
            self._excluded += time.perf_counter() - now
        self.times.append(now - self._excluded)
        if self._between is not None:
            self._between()
            self._excluded += time.perf_counter() - now
        return scores


def _generate(model, batch: int, prompt: int, new_tokens: int, between_steps=None) -> dict[str, Any]:
    import transformers

    from fastpersist.bench.measure import PeakMemory

    ids = torch.randint(100, 30000, (batch, prompt), generator=torch.Generator().manual_seed(0)).cuda()
    clock = _Clock(between_steps)
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
        "host_rss_baseline_bytes": host.baseline,
        "new_tokens": new_tokens,
        "tokens": out[:, prompt:].cpu(),
        "logits": clock.first_scores,
    }


class _ColdReads:
    """Drops the page cache of accelerate's files before each step, as for a model larger than host memory (else
    every pass after the first reads memory). Nothing on tmpfs can be dropped: ``detail`` says so."""

    def __init__(self, roots: list[str]):
        from fastpersist.system import CacheDropper, filesystem_of

        self.roots = [root for root in roots if os.path.exists(root)]
        self._dropper = CacheDropper()
        tmpfs = ", ".join(root for root in self.roots if filesystem_of(root).get("type") == "tmpfs")
        note = f"{tmpfs} on tmpfs: accelerate's reads of it are served from memory (nothing to drop); " if tmpfs else ""
        rest = "the rest" if tmpfs else "its files"
        self.detail = f"{note}page cache of {rest} dropped before every step ({self._dropper.mode})"

    def __call__(self) -> None:
        self._dropper.drop(self.roots)


def _agreement(tokens, logits, reference: tuple | None) -> dict[str, Any]:
    """A run's output against full-gpu's ``reference`` tokens and prefill logits: the share of equal tokens says how
    early greedy sequences parted; a logits difference of 0 says the computation is bit for bit the same."""
    if reference is None:
        return {"same_tokens_as_full_gpu": None, "token_agreement": None}
    expected = reference[0][:, : tokens.shape[1]]  # full-gpu made more tokens where the method's count differs
    finite = torch.isfinite(reference[1])  # generate's min_new_tokens sets the end token's score to -inf
    same = torch.equal(finite, torch.isfinite(logits))
    return {
        "same_tokens_as_full_gpu": bool(torch.equal(tokens, expected)),
        "token_agreement": float((tokens == expected).float().mean()),
        "prefill_logits_max_abs_diff": float((logits - reference[1])[finite].abs().max()) if same else float("inf"),
        "prefill_logits_max_abs": float(reference[1][finite].abs().max()),
    }


def _read_ceiling(path: str) -> float:
    """GB/s of an O_DIRECT read of the whole file through a 1 GiB pinned buffer, page cache dropped first."""
    from fastpersist.io import engine, memory
    from fastpersist.system import CacheDropper

    CacheDropper().drop([path])
    size, piece = os.path.getsize(path), 1 << 30
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
        f"({config['layers']} layers), GPU budget {config['gpu_budget'] / 1e9:.2f} GB, prompt {config['prompt']}; "
        f"ceilings in the same run: disk read {ceilings['disk_read_GBps']:.2f} GB/s, "
        f"host to device {ceilings['host_to_device_GBps']:.2f} GB/s"
    ]
    if config.get("accelerate_reads"):
        lines.append(f"accelerate: {config['accelerate_reads']}")
    repeat = next((row["repeat"] for row in document["results"].get("full-gpu", []) if row.get("repeat")), None)
    if repeat:
        lines.append(
            f"full-gpu run twice (batch {document['results']['full-gpu'][0]['batch']}): {_same(repeat)} tokens the "
            f"same, prefill logits max difference {_number(repeat.get('prefill_logits_max_abs_diff'), '{:.3g}')} "
            f"(largest logit {_number(repeat.get('prefill_logits_max_abs'), '{:.3g}')})"
        )
    header = ["method", "batch", "new tokens", "decode tokens/s", "bound tokens/s", "of bound"]
    header += ["time to first token (s)", "peak GPU (GB)", "peak host RSS (GB)", "host RSS added (GB)"]
    header += ["pinned staging (GB)", "same tokens as full-gpu", "prefill logits max difference"]
    lines += ["", *markdown_table(header, "<>>>>>>>>>><>", [])]
    default_tokens = {
        "accelerate-disk": config.get("accelerate_new_tokens"),
        "fastpersist-disk": config.get("disk_new_tokens", config.get("new_tokens")),
    }
    for method, rows in document["results"].items():
        for row in rows:
            tokens = row.get("new_tokens", default_tokens.get(method, config.get("new_tokens")))
            before = row.get("rss_before_dispatch_bytes", row.get("host_rss_baseline_bytes"))
            added = row["peak_host_rss_bytes"] - before if before is not None else None
            lines.append(
                f"| {method} | {row['batch']} | {tokens} | {row['decode_tokens_per_second']:.2f} | "
                f"{_number(row.get('bound_tokens_per_second'), '{:.2f}')} | {_number(row.get('of_bound'), '{:.2f}x')} | "
                f"{row['ttft_seconds']:.2f} | {row['peak_gpu_bytes'] / 1e9:.2f} | "
                f"{row['peak_host_rss_bytes'] / 1e9:.2f} | {_number(added, '{:+.2f}', 1e9)} | "
                f"{_number(row.get('staging_bytes'), '{:.2f}', 1e9)} | {_same(row)} | "
                f"{_number(row.get('prefill_logits_max_abs_diff'), '{:.3g}')} |"
            )
    return "\n".join(lines) + "\n"


def to_svg(documents: list[dict[str, Any]]) -> str:
    """A bar chart of decoding tokens/s per method and batch (log scale), each tier's bound as a tick."""
    document = documents[0]
    rows = [(method, row) for method, method_rows in document["results"].items() for row in method_rows]
    values = [row["decode_tokens_per_second"] for _, row in rows] + [
        row["bound_tokens_per_second"] for _, row in rows if row.get("bound_tokens_per_second")
    ]
    low, high = math.log10(min(values) / 2), math.log10(max(values) * 2)
    bar, gap, left, width = 18, 6, 230, 460

    def x(value: float) -> float:
        return left + width * (math.log10(value) - low) / (high - low)

    colors = {"full-gpu": "#888", "accelerate-disk": "#c96", "fastpersist-disk": "#2a7", "fastpersist-host": "#275"}
    config = document["config"]
    svg, y = Svg(), 30
    title = f"{config['model_bytes'] / 1e9:.0f} GB Llama-shaped model, GPU budget {config['gpu_budget'] / 1e9:.1f} GB, "
    svg.title(18, title + f"prompt {config['prompt']}: decoding tokens/s (log scale; | = the tier's bound)", 13)
    for method, row in rows:
        value = row["decode_tokens_per_second"]
        svg.label(left - 6, y + 13, f"{method}, batch {row['batch']}")
        svg.bar(left, y, x(value) - left, bar, colors.get(method, "#888"))
        svg.text(f"{x(value) + 4:.1f}", y + 13, f"{value:.2f}")
        bound = row.get("bound_tokens_per_second")
        if bound:
            svg.line(x(bound), y - 2, x(bound), y + bar + 2, 'stroke="#c33" stroke-width="2"')
        y += bar + gap
    return svg.document(left + width + 80, y + 10)


def _number(value: float | None, pattern: str, unit: float = 1) -> str:
    return "" if value is None else pattern.format(value / unit)


def _same(row: dict[str, Any]) -> str:
    same, share = row.get("same_tokens_as_full_gpu"), row.get("token_agreement")
    if same is None:
        return ""
    if same:
        return "yes"
    return "no" if share is None else f"no ({share:.1%} of tokens)"


def _full_gpu(llama_config, path: str, batches: list[int], args, results: dict, reference: dict) -> None:
    """The compute bound and the ``reference`` tokens: the checkpoint loaded into the model the others get (rotary
    buffers computed on the CPU), not the saved one, whose GPU-computed buffers change a deep model's greedy tokens."""
    import fastpersist

    model = _empty_model(llama_config)
    model.load_state_dict(fastpersist.load_file(path, device="cuda"), assign=True)
    model.cuda()
    _generate(model, batches[0], 8, 2)  # CUDA and cuBLAS warm-up, untimed
    for batch in batches:
        row = _generate(model, batch, args.prompt, args.new_tokens)
        reference[batch] = (row.pop("tokens"), row.pop("logits"))
        if batch == batches[0]:  # how far the same model on the same GPU agrees with itself
            again = _generate(model, batch, args.prompt, args.new_tokens)
            row["repeat"] = _agreement(again["tokens"], again["logits"], reference[batch])
        results.setdefault("full-gpu", []).append(row)
        print(f"full-gpu batch {batch}: {row['decode_tokens_per_second']:.1f} tokens/s", flush=True)


def _accelerate(llama_config, path: str, budget: int, batches: list[int], args, results: dict, reference: dict):
    """Generation with ``load_checkpoint_and_dispatch``, reads cold; what its reads are (None: not installed)."""
    try:
        from accelerate import load_checkpoint_and_dispatch
    except ImportError:
        print("accelerate-disk: skipped (accelerate is not installed)")
        return None
    offload_dir = args.accelerate_offload_dir or os.path.join(args.dir, "accelerate-offload")
    empty, limits = _empty_model(llama_config), {0: budget, "cpu": 1 << 30}
    model = load_checkpoint_and_dispatch(
        empty, path, device_map="auto", max_memory=limits, offload_folder=offload_dir, dtype=torch.bfloat16
    )
    cold = _ColdReads([path, offload_dir])
    print(f"accelerate-disk: {cold.detail}", flush=True)
    for batch in batches:
        cold()
        row = _generate(model, batch, args.prompt, args.accelerate_tokens, between_steps=cold)
        row.update(_agreement(row.pop("tokens"), row.pop("logits"), reference.get(batch)))
        results.setdefault("accelerate-disk", []).append(row)
        print(f"accelerate-disk batch {batch}: {row['decode_tokens_per_second']:.3f} tokens/s", flush=True)
    return cold.detail


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise UsageError("python -m fastpersist.bench offload needs a CUDA GPU")
    if not args.dir:
        raise UsageError("--dir is required (where the model file is written)")
    import transformers

    import fastpersist
    from fastpersist.bench.measure import current_rss, machine_info
    from fastpersist.offload import dispatch

    if not args.nondeterministic:
        # A random Llama's top logits are near ties: without these, the same model run twice agreed on about a
        # third of 32 greedy tokens (H200, 40 GB). The variable must be set before cuBLAS makes its first handle.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
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
    del model
    torch.cuda.empty_cache()
    budget = args.gpu_budget or model_bytes // 4
    layers = llama_config.num_hidden_layers
    print(f"model: {layers} layers, {model_bytes / 1e9:.2f} GB bf16; GPU budget {budget / 1e9:.2f} GB")
    disk_tokens = args.new_tokens if args.disk_tokens is None else args.disk_tokens
    results: dict[str, list[dict[str, Any]]] = {}
    reference: dict[int, tuple] = {}  # batch -> full-gpu's tokens and prefill logits
    if "full-gpu" in methods:
        _full_gpu(llama_config, path, batches, args, results, reference)
    torch.cuda.empty_cache()
    read_ceiling, copy_ceiling = _read_ceiling(path), _copy_ceiling()
    print(f"ceilings: disk read {read_ceiling:.2f} GB/s, host-to-device {copy_ceiling:.2f} GB/s", flush=True)
    streamed_bytes = {}
    for method in [m for m in ("fastpersist-disk", "fastpersist-host") if m in methods]:
        host_tier = model_bytes if method == "fastpersist-host" else None
        empty = _empty_model(llama_config)
        rss_before = current_rss()
        offloaded = dispatch(empty, path, device="cuda", max_gpu_memory=budget, max_host_memory=host_tier)
        state = offloaded.fastpersist_offload
        placement = state.describe()
        streamed_bytes[method] = sum(n for _, n in placement["streamed"])
        ceiling, new_tokens = (read_ceiling, disk_tokens) if host_tier is None else (copy_ceiling, args.new_tokens)
        for batch in batches:
            if host_tier is not None:
                _generate(offloaded, batch, 8, 1)  # fills the host tier (the first pass reads the disk)
            row = _generate(offloaded, batch, args.prompt, new_tokens)
            row["rss_before_dispatch_bytes"] = rss_before
            row["staging_bytes"] = placement["slots"] * placement["slot_bytes"]
            row["host_tier_bytes"] = state.describe()["host_tier_bytes"]
            row.update(_agreement(row.pop("tokens"), row.pop("logits"), reference.get(batch)))
            bound = batch * ceiling * 1e9 / streamed_bytes[method] if streamed_bytes[method] else None
            row["bound_tokens_per_second"] = bound
            row["of_bound"] = row["decode_tokens_per_second"] / bound if bound else None
            row["stats"] = dict(vars(state.stats()))
            results.setdefault(method, []).append(row)
            print(
                f"{method} batch {batch}: {row['decode_tokens_per_second']:.2f} tokens/s (bound {bound or 0:.2f}, "
                f"{(row['of_bound'] or 0):.2f}x), TTFT {row['ttft_seconds']:.2f} s, same tokens {row['same_tokens_as_full_gpu']}",
                flush=True,
            )
        state.close()
        del offloaded
        torch.cuda.empty_cache()
    accelerate_reads = None
    if "accelerate-disk" in methods:
        accelerate_reads = _accelerate(llama_config, path, budget, batches, args, results, reference)
    return {
        "benchmark": "offload",
        "machine": machine_info(args.dir, "cuda"),
        "config": {
            "model_bytes": model_bytes,
            "layers": layers,
            "gpu_budget": budget,
            "prompt": args.prompt,
            "new_tokens": args.new_tokens,
            "accelerate_new_tokens": args.accelerate_tokens,
            "disk_new_tokens": disk_tokens,
            "deterministic": not args.nondeterministic,
            "accelerate_reads": accelerate_reads,
            "batches": batches,
        },
        "ceilings": {"disk_read_GBps": read_ceiling, "host_to_device_GBps": copy_ceiling},
        "streamed_bytes_per_pass": streamed_bytes,
        "results": results,
    }


BENCHMARK = Benchmark(
    "offload", _options, _measure, to_markdown, __doc__.split("\n")[0], svg=to_svg, requires=("transformers",)
)
main = BENCHMARK.main
