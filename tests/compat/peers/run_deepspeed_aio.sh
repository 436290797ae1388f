#!/usr/bin/env bash
# Runs DeepSpeed's own DeepNVMe tests, unchanged, against fastpersist.AioHandle and
# fastpersist.GdsHandle (test_gds.py, which skips itself without a CUDA device), plus a
# FastFileWriter check (torch.save through deepspeed.io.FastFileWriter on
# AioHandle, read back with torch.load).
#
# Usage: tests/compat/peers/run_deepspeed_aio.sh PATH_TO_DEEPSPEED_CHECKOUT [pytest args...]
#   e.g. tests/compat/peers/run_deepspeed_aio.sh /work/peer/deepspeed -q -rs
#        tests/compat/peers/run_deepspeed_aio.sh .devcarry/deepspeed -q -rs --fp-json "$OUT/deepspeed_aio.json"
#
# The checkout needs tests/unit/v1/nvme/{test_aio,test_pinned_manager,test_aio_gil}.py
# (test_fast_file_writer_fd_close.py and test_gds.py too, if present) and deepspeed/io/.
# Nothing of DeepSpeed is copied into this repository: the shim in
# tests/compat/peers/deepspeed_shim maps AsyncIOBuilder and GDSBuilder to fastpersist and
# stubs DeepSpeed's test scaffolding. GdsHandle's data path follows FASTPERSIST_GDS_PATH
# (auto, cufile or bounce); run once per path to cover both.
set -euo pipefail
if [ $# -lt 1 ] || [ ! -d "$1" ]; then
  echo "usage: $0 PATH_TO_DEEPSPEED_CHECKOUT [pytest args...]" >&2
  exit 2
fi
DS=$(cd "$1" && pwd)
shift
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../../.." && pwd)
NVME="$DS/tests/unit/v1/nvme"
files=()
for name in test_aio.py test_pinned_manager.py test_aio_gil.py test_fast_file_writer_fd_close.py test_gds.py; do
  if [ -f "$NVME/$name" ]; then
    files+=("$NVME/$name")
  else
    echo "note: $NVME/$name not found; not run" >&2
  fi
done
if [ ! -d "$DS/deepspeed/io" ]; then
  echo "error: $DS/deepspeed/io not found (FastFileWriter is taken from there)" >&2
  exit 2
fi
export FASTPERSIST_DEEPSPEED_PATH="$DS"
export PYTHONPATH="$HERE/deepspeed_shim:$REPO${PYTHONPATH:+:$PYTHONPATH}"
cd "$REPO"
exec python -m pytest -c "$HERE/deepspeed_shim/pytest.ini" --rootdir "$HERE/deepspeed_shim" --noconftest \
  -p no:cacheprovider -p fp_json_report "${files[@]}" "$HERE/check_fast_file_writer.py" "$@"
