#!/usr/bin/env bash
# Everything the lent GPU machine must show, in one call: build, the whole test
# suite (GPU tests included) on its torch, then the checkpoint benchmarks.
# Usage: bash examples/gpu_acceptance.sh OUTDIR [quick]
set -uo pipefail
out=${1:?output directory}
mode=${2:-full}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 FASTPERSIST_BENCH_TRACEBACK=1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0))"
python3 setup.py build_ext --inplace -q > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
python3 -m fastpersist info | tee "$out/info.txt"
python3 -m fastpersist info --dir /dev/shm >> "$out/info.txt"
if [ "$mode" != "bench-only" ]; then
  timeout 420 python3 -m pytest -q -p no:cacheprovider -x tests/ 2>&1 | tail -15 | tee "$out/tests.log"
fi
[ "$mode" = "tests-only" ] && exit 0
bench() { python3 -m fastpersist.bench checkpoint --no-progress "$@"; }
# 4 GB bf16 state dict on the GPU: to disk (time to durable), then cold loads to CUDA.
bench --device cuda --model llama-3-8b --size 4G --json "$out/gpu_disk.json" 2>&1 | tail -28
# Same to /dev/shm (no disk limit).
bench --device cuda --model llama-3-8b --size 4G --dir /dev/shm --json "$out/gpu_shm.json" \
  --methods torch.save,torch.save-fast,fastpersist,fastpersist-async,torch.load,fastpersist.load 2>&1 | tail -20
# Cold loads to CPU from disk.
bench --device cpu --model llama-3-8b --size 4G --json "$out/cpu_disk.json" \
  --methods torch.save,fastpersist,engine-write,torch.load,torch.load-mmap,fastpersist.load,fastpersist.load-torchfile,engine-read 2>&1 | tail -20
# Peak host memory while saving a 16 GB GPU state dict.
bench --device cuda --model llama-3-8b --size 16G --repeats 1 --warmup 0 --json "$out/gpu_16g.json" \
  --methods fastpersist,fastpersist.load 2>&1 | tail -12
