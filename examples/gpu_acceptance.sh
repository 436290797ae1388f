#!/usr/bin/env bash
# Every published GPU table, regenerated from runs on the GPU machine, plus the GPU tests and
# the peers' GPU cases. Each part fits in one 10-minute call:
#
#   bash examples/gpu_acceptance.sh OUTDIR tests        # build, GPU tests, DeepSpeed + safetensors peers (~5 min)
#   bash examples/gpu_acceptance.sh OUTDIR checkpoint   # checkpoint benchmark: 4 GB disk, 4 GB /dev/shm, 16 GB (~6 min)
#   bash examples/gpu_acceptance.sh OUTDIR shapes       # shapes + sink, load stages, AioHandle ring, DP ranks (~6 min)
#   bash examples/gpu_acceptance.sh OUTDIR features     # safetensors, DCP, training overhead (~8 min)
#   bash examples/gpu_acceptance.sh OUTDIR gds          # GdsHandle: tests, DeepSpeed test_gds.py per path, bench gds (~6 min)
#   bash examples/gpu_acceptance.sh OUTDIR multigpu     # 2+ GPUs: multigpu tests, DDP + Lightning examples (~8 min)
#                                                       # (= multigpu-tests, then multigpu-examples)
#   bash examples/gpu_acceptance.sh OUTDIR multigpu-bench  # 2+ GPUs: collective save (disk, sink), DDP training (~8 min)
#   bash examples/gpu_acceptance.sh OUTDIR multigpu-async  # 2+ GPUs: async collective vs rank-0 saves in DDP training, shm + disk
#   bash examples/gpu_acceptance.sh OUTDIR scaling      # 4+ GPUs: collective save at 1, 2, 4(, 8) ranks, DDP training
#   bash examples/gpu_acceptance.sh OUTDIR scaling-dcp  # 4+ GPUs: DCP writer/reader at 1, 2, 4(, 8) ranks (NCCL)
#   bash examples/gpu_acceptance.sh OUTDIR pace         # every storage-pace target ratio, one table (~8 min; fio on PATH)
#   bash examples/gpu_acceptance.sh OUTDIR trainer      # Hugging Face Trainer + 1.1 B Llama: unpatched vs patch() (~6 min)
#   bash examples/gpu_acceptance.sh OUTDIR all          # everything for one GPU, one after the other
#   cp OUTDIR/*.json docs/results/ && python -m fastpersist.bench report --update-docs
#
# Peer suites come from paths outside the repository: DEEPSPEED_DIR (default .devcarry/deepspeed)
# and SAFETENSORS_DIR (default .devcarry/peer-safetensors); a missing one is reported and skipped.
# JSON names start with the GPU (h100-, h200-) so runs on both machines sit side by side.
# FASTPERSIST_NO_BUILD=1 skips the build (when parts run side by side on one machine after one build).
set -uo pipefail
out=${1:?usage: examples/gpu_acceptance.sh OUTDIR PART (see the comment at the top)}
part=${2:-all}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1 FASTPERSIST_BENCH_TRACEBACK=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" 2>/dev/null; then
  echo "examples/gpu_acceptance.sh needs a CUDA GPU (torch.cuda.is_available() is False here);" \
       "run it on the GPU machine, or run the CPU tests with: python -m pytest -q" >&2
  exit 2
fi
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0))" \
  || exit 1
if [ "${FASTPERSIST_NO_BUILD:-0}" != 1 ]; then
  python3 setup.py build_ext --inplace -q > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
fi
machine=$(python3 -c "import re, torch; m = re.search(r'[HAB]\d{2,3}', torch.cuda.get_device_name(0)); print(m.group(0).lower() if m else 'gpu')")
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
scratch=${FASTPERSIST_SCRATCH:-$PWD/.benchmarks}
mkdir -p "$scratch"

step() {  # step NAME SECONDS COMMAND...: runs with a time limit, log in OUTDIR/NAME.log, status kept
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T))"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 12 "$out/$name.log"
  [ $rc -eq 0 ] || { echo "!! $name exited $rc"; status=1; }
}

part_tests() {
  python3 -m fastpersist info > "$out/info.txt"
  python3 -m fastpersist info --dir /dev/shm >> "$out/info.txt"
  step gpu-tests 420 python3 -m pytest -q -p no:cacheprovider -rs -m "gpu or multigpu" tests/
  step examples 120 bash -c "python3 examples/train_loop.py --dir $scratch/ex --mode pipelined && \
    python3 examples/train_loop.py --dir $scratch/ex --mode snapshot && \
    python3 examples/lightning_callback.py --dir $scratch/lit --async-mode snapshot --check"
  local deepspeed=${DEEPSPEED_DIR:-.devcarry/deepspeed} st=${SAFETENSORS_DIR:-.devcarry/peer-safetensors}
  if [ -d "$deepspeed" ]; then
    step peer-deepspeed 240 bash tests/compat/peers/run_deepspeed_aio.sh "$deepspeed" -q -rs
  else
    echo "!! DeepSpeed tests not found at $deepspeed: skipped"
  fi
  if [ -d "$st" ]; then
    step peer-safetensors 120 python3 tests/compat/peers/run_safetensors_tests.py "$st" --mode both \
      --json "$out/$machine-peer-safetensors.json"
  else
    echo "!! safetensors tests not found at $st: skipped"
  fi
}

bench() {  # bench NAME ARGS...: the checkpoint benchmark, JSON in OUTDIR
  local name=$1; shift
  step "$machine-$name" 300 python3 -m fastpersist.bench checkpoint --no-progress --json "$out/$machine-$name.json" "$@"
}

part_checkpoint() {
  local methods=torch.save,fastpersist,fastpersist-async,torch.load,fastpersist.load,fastpersist.load-torchfile
  # 4 GB bf16 state dict on the GPU: durable saves to disk, cold loads to CUDA, against the disk's ceilings.
  bench gpu-4g-disk --device cuda --model llama-3-8b --size 4G --repeats 2 --warmup 1 --dir "$scratch" --methods "$methods"
  # The same through /dev/shm (tmpfs: page-allocation bound on that machine; no O_DIRECT).
  bench gpu-4g-shm --device cuda --model llama-3-8b --size 4G --repeats 2 --warmup 1 --dir /dev/shm --methods "$methods"
  # Host memory while saving and loading a 16 GB GPU state dict (one round; no ceiling, which would need 32 GB).
  bench gpu-16g-disk --device cuda --model llama-3-8b --size 16G --repeats 1 --warmup 0 --no-ceiling --dir "$scratch" \
    --methods fastpersist,fastpersist.load
}

part_shapes() {
  step "$machine-shapes-medium-4g-shm" 150 python3 -m fastpersist.bench shapes --shape many-medium --tensors 120 --size 4G \
    --device cuda --dir /dev/shm --sink --repeats 2 --warmup 1 --json "$out/$machine-shapes-medium-4g-shm.json"
  step "$machine-shapes-medium-4g-disk" 150 python3 -m fastpersist.bench shapes --shape many-medium --tensors 120 --size 4G \
    --device cuda --dir "$scratch" --repeats 2 --warmup 1 --json "$out/$machine-shapes-medium-4g-disk.json"
  step "$machine-shapes-small-100k" 120 python3 -m fastpersist.bench shapes --shape many-small --tensors 100000 \
    --tensor-bytes 16-256 --dir "$scratch" --repeats 2 --warmup 1 --json "$out/$machine-shapes-small-100k.json"
  step "$machine-stages-4g-shm" 90 python3 -m fastpersist.bench stages --dir /dev/shm --size 4G --rounds 5 \
    --json "$out/$machine-stages-4g-shm.json"
  step "$machine-stages-4g-sink" 60 python3 -m fastpersist.bench stages --sink --size 4G --rounds 5 \
    --json "$out/$machine-stages-4g-sink.json"
  step "$machine-aio-handle" 90 python3 -m fastpersist.bench aio_handle --dir "$scratch/aio" --size 1G --repeat 3 \
    --json "$out/$machine-aio-handle.json"
  step "$machine-ranks-file" 150 python3 -m fastpersist.bench ranks --ranks 1,2,4 --size 2G --device cuda --dir "$scratch" \
    --repeat 2 --json "$out/$machine-ranks-file.json"
}

part_gds() {  # GdsHandle (DeepNVMe's gds_handle): both data paths, DeepSpeed's own test_gds.py, the benchmark
  python3 -m fastpersist info > "$out/info-gds.txt"
  step gds-tests 300 python3 -m pytest -q -p no:cacheprovider -rs tests/deepnvme tests/bench/test_bench_gds.py \
    tests/cli/test_deepnvme_flags.py
  local deepspeed=${DEEPSPEED_DIR:-.devcarry/deepspeed} path
  if [ -f "$deepspeed/tests/unit/v1/nvme/test_gds.py" ]; then
    for path in cufile bounce; do
      step "peer-deepspeed-gds-$path" 180 env FASTPERSIST_GDS_PATH=$path bash tests/compat/peers/run_deepspeed_aio.sh \
        "$deepspeed" -q -rs -k test_gds
    done
  else
    echo "!! DeepSpeed's test_gds.py not found under $deepspeed: skipped"
  fi
  step "$machine-gds" 240 python3 -m fastpersist.bench gds --dir "$scratch" --size 1G --repeats 3 \
    --json "$out/$machine-gds.json"
}

part_features() {
  step "$machine-safetensors-disk" 180 python3 -m fastpersist.bench safetensors --device cuda --size 4G --dir "$scratch/st" \
    --repeats 2 --skip fastpersist-torch --json "$out/$machine-safetensors-disk.json"
  step "$machine-dcp-4ranks" 200 python3 -m fastpersist.bench dcp --ranks 4 --size 4G --device cuda --threads 1,8 --repeats 2 \
    --dir "$scratch/dcp" --json "$out/$machine-dcp-4ranks.json"
  # Every iteration with the GPU defaults (an iteration shorter than one checkpoint's write: storage-bound),
  # every 4th, and every iteration with a 3x larger batch (an iteration longer than the write).
  step "$machine-training" 200 python3 -m fastpersist.bench training --dir /dev/shm/fp-train --repeats 1 --iterations 12 \
    --json "$out/$machine-training.json"
  step "$machine-training-every4" 200 python3 -m fastpersist.bench training --dir /dev/shm/fp-train --repeats 1 \
    --iterations 16 --every 4 --json "$out/$machine-training-every4.json"
  step "$machine-training-b192" 240 python3 -m fastpersist.bench training --dir /dev/shm/fp-train --repeats 1 \
    --iterations 10 --batch 192 --json "$out/$machine-training-b192.json"
}

need_gpus() {  # need_gpus N: the multi-GPU parts refuse to run (status 1) on fewer GPUs
  if [ "$gpus" -lt "$1" ]; then echo "!! this part needs $1 GPUs, found $gpus"; status=1; return 1; fi
}

part_multigpu_tests() {  # NCCL, one rank per GPU: every distributed test on real devices
  need_gpus 2 || return
  step multigpu-tests 420 python3 -m pytest -q -p no:cacheprovider -rs -m "multigpu or gpu" tests/distributed/test_distributed.py \
    tests/distributed/test_distributed_replicas.py tests/distributed/test_async_collective.py tests/dcp/test_dcp.py
}

part_multigpu_examples() {  # the DDP example and the Lightning example in every mode, on 2 GPUs
  need_gpus 2 || return
  step ddp-example 180 torchrun --nproc-per-node 2 examples/ddp_sharded.py --dir "$scratch/ddp"
  step ddp-example-pipelined 180 torchrun --nproc-per-node 2 examples/ddp_sharded.py --dir "$scratch/ddp" --async-mode pipelined
  step ddp-example-snapshot 180 torchrun --nproc-per-node 2 examples/ddp_sharded.py --dir "$scratch/ddp" --async-mode snapshot
  local mode name
  for mode in "--io callback" "--io callback --async-mode snapshot" "--io callback --async-mode pipelined" \
              "--io strategy" "--io plugin"; do
    name=lightning-ddp$(echo "$mode" | tr -d ' ' | sed 's/--io//; s/--async-mode/-/')
    rm -rf "$scratch/$name"
    step "$name" 180 python3 examples/lightning_callback.py --dir "$scratch/$name" --devices 2 --check $mode
  done
}

rank_counts() {  # 2,4,8 up to the number of GPUs (1 is always added by the benchmark)
  local n=2 list=""
  while [ "$n" -le "$gpus" ]; do list="$list${list:+,}$n"; n=$((n * 2)); done
  echo "$list"
}

part_scaling() {  # the collective save and DDP training at every power-of-two rank count
  need_gpus 4 || return
  local counts n
  counts=$(rank_counts)
  step "$machine-x$gpus-examples" 200 bash -c "torchrun --nproc-per-node $gpus examples/ddp_sharded.py --dir $scratch/ddp$gpus && \
    python3 examples/lightning_callback.py --dir $scratch/lit$gpus --devices $gpus --check --io callback"
  step "$machine-x$gpus-ranks-nccl-disk" 300 python3 -m fastpersist.bench ranks --ranks "$counts" --size 4G --device cuda \
    --backend nccl --dir "$scratch" --repeat 3 --json "$out/$machine-x$gpus-ranks-nccl-disk.json"
  step "$machine-x$gpus-ranks-nccl-sink" 240 python3 -m fastpersist.bench ranks --ranks "$counts" --size 4G --device cuda \
    --backend nccl --sink --repeat 5 --json "$out/$machine-x$gpus-ranks-nccl-sink.json"
  for n in ${counts//,/ }; do
    step "$machine-x$gpus-training-ddp$n-shm" 240 python3 -m fastpersist.bench training --ranks "$n" --dir /dev/shm/fp-train \
      --repeats 1 --iterations 12 --json "$out/$machine-x$gpus-training-ddp$n-shm.json"
  done
}

part_scaling_dcp() {  # DCP's FileSystemWriter against FastPersistWriter, 4 GB over 1, 2, 4(, 8) ranks, NCCL
  need_gpus 4 || return
  local counts n
  counts=$(rank_counts)
  for n in 1 ${counts//,/ }; do
    step "$machine-x$gpus-dcp-nccl-$n" 200 python3 -m fastpersist.bench dcp --ranks "$n" --backend nccl --device cuda \
      --size 4G --threads 1,8 --repeats 2 --dir "$scratch/dcp" --json "$out/$machine-x$gpus-dcp-nccl-$n.json"
  done
}

part_multigpu_bench() {  # 4 GB of bf16 state per rank on its own GPU
  need_gpus 2 || return
  step "$machine-ranks-nccl-disk" 240 python3 -m fastpersist.bench ranks --ranks 2 --size 4G --device cuda \
    --backend nccl --dir "$scratch" --repeat 3 --json "$out/$machine-ranks-nccl-disk.json"
  step "$machine-ranks-nccl-sink" 200 python3 -m fastpersist.bench ranks --ranks 2 --size 4G --device cuda \
    --backend nccl --sink --repeat 3 --json "$out/$machine-ranks-nccl-sink.json"
  step "$machine-training-ddp-shm" 240 python3 -m fastpersist.bench training --ranks 2 --dir /dev/shm/fp-train \
    --repeats 1 --iterations 12 --json "$out/$machine-training-ddp-shm.json"
}

part_multigpu_async() {  # the asynchronous collective save against the rank-0 one, every iteration, shm and disk
  need_gpus 2 || return
  local methods=none,fastpersist-collective-pipelined,fastpersist-collective-snapshot,fastpersist-pipelined,fastpersist-collective
  step "$machine-training-ddp-async-shm" 280 python3 -m fastpersist.bench training --ranks 2 --dir /dev/shm/fp-train \
    --methods "$methods" --repeats 1 --iterations 12 --json "$out/$machine-training-ddp-async-shm.json"
  step "$machine-training-ddp-async-disk" 280 python3 -m fastpersist.bench training --ranks 2 --dir "$scratch/train" \
    --methods "$methods" --repeats 1 --iterations 12 --json "$out/$machine-training-ddp-async-disk.json"
}

part_pace() {  # training every iteration (shm, disk), 4 GB disk save against fio, verified shm->GPU load
  step "$machine-pace" 540 python3 -m fastpersist.bench pace --disk "$scratch/pace" --shm /dev/shm/fp-pace \
    --json "$out/$machine-pace.json"
}

part_trainer() {  # Trainer with a TinyLlama-shaped model: blocked and durable time per checkpoint, disk and shm
  step "$machine-trainer-disk" 290 python3 -m fastpersist.bench trainer --dir "$scratch/trainer" \
    --json "$out/$machine-trainer-disk.json"
  step "$machine-trainer-shm" 230 python3 -m fastpersist.bench trainer --dir /dev/shm/fp-trainer \
    --json "$out/$machine-trainer-shm.json"
}

case "$part" in
  tests) part_tests ;;
  pace) part_pace ;;
  trainer) part_trainer ;;
  checkpoint) part_checkpoint ;;
  shapes) part_shapes ;;
  features) part_features ;;
  gds) part_gds ;;
  multigpu) part_multigpu_tests; part_multigpu_examples ;;
  multigpu-tests) part_multigpu_tests ;;
  multigpu-examples) part_multigpu_examples ;;
  multigpu-async) part_multigpu_async ;;
  scaling) part_scaling ;;
  scaling-dcp) part_scaling_dcp ;;
  multigpu-bench) part_multigpu_bench ;;
  all) part_tests; part_checkpoint; part_shapes; part_features; part_gds ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
ls -l "$out"
exit $status
