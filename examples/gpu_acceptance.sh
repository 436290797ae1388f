#!/usr/bin/env bash
# Every published GPU table, regenerated from one run on the GPU machine (about 6 minutes):
# build, the GPU tests, then the checkpoint benchmarks, each writing its JSON into OUTDIR.
#
#   bash examples/gpu_acceptance.sh OUTDIR [bench-only|tests-only]
#   cp OUTDIR/*.json docs/results/ && python -m fastpersist.bench report --update-docs
#
# JSON names start with the GPU (h100-, h200-) so runs on both machines sit side by side.
set -uo pipefail
out=${1:?usage: examples/gpu_acceptance.sh OUTDIR [bench-only|tests-only]}
mode=${2:-full}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 FASTPERSIST_BENCH_TRACEBACK=1
status=0
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0))" \
  || exit 1
python3 setup.py build_ext --inplace -q > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
python3 -m fastpersist info > "$out/info.txt"
python3 -m fastpersist info --dir /dev/shm >> "$out/info.txt"
machine=$(python3 -c "import re, torch; m = re.search(r'[HAB]\d{2,3}', torch.cuda.get_device_name(0)); print(m.group(0).lower() if m else 'gpu')")

if [ "$mode" != "bench-only" ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m "gpu or multigpu" tests/ 2>&1 | tail -15 | tee "$out/gpu-tests.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
[ "$mode" = "tests-only" ] && exit $status

bench() {
  local name=$1; shift
  timeout 300 python3 -m fastpersist.bench checkpoint --no-progress --json "$out/$machine-$name.json" "$@" \
    > "$out/$machine-$name.txt" 2>&1
  local rc=$?
  tail -n 30 "$out/$machine-$name.txt"
  [ $rc -eq 0 ] || { echo "benchmark $name exited $rc"; status=1; }
}
methods=torch.save,torch.save-fast,fastpersist,fastpersist-async,torch.load,fastpersist.load,fastpersist.load-torchfile
# 4 GB bf16 state dict on the GPU: durable saves to disk, cold loads to CUDA, against the disk's ceilings.
bench gpu-4g-disk --device cuda --model llama-3-8b --size 4G --repeats 2 --warmup 1 --methods "$methods"
# The same through /dev/shm (tmpfs: page-allocation bound on that machine; no O_DIRECT).
bench gpu-4g-shm --device cuda --model llama-3-8b --size 4G --repeats 2 --warmup 1 --dir /dev/shm --methods "$methods"
# Host memory while saving and loading a 16 GB GPU state dict (one round; no ceiling, which would need 32 GB).
bench gpu-16g-disk --device cuda --model llama-3-8b --size 16G --repeats 1 --warmup 0 --no-ceiling \
  --methods fastpersist,fastpersist.load
ls -l "$out"/*.json
exit $status
