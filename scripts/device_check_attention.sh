#!/usr/bin/env bash
# GPU check of the Triton paged-attention backend: its tests on CUDA, the registry's
# choice, and the decode benchmark against dense SDPA. Run from the repository root on a
# CUDA machine with python3, torch, triton and pytest (no virtualenv, no Ray/Redis needed):
#
#     bash scripts/device_check_attention.sh        # logs to $OUT/ (default /tmp/kvtier-device-check)
#
# Every step runs under its own timeout, a failing step does not stop the next one, and
# the script exits non-zero if any step failed. Budget: well under 3 minutes.
set -u -o pipefail -x

export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/kvtier-device-check}"
mkdir -p "$OUT"
declare -A STATUS

step() {  # step NAME TIMEOUT_S CMD...: run CMD, log to $OUT/NAME.log, remember its exit status
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    STATUS[$name]="rc=${PIPESTATUS[0]} $((SECONDS - started))s"
}

step env 30 bash -c 'nvidia-smi -L; python3 -c "
import sys, torch, triton
print(sys.version.split()[0], \"torch\", torch.__version__, \"cuda\", torch.version.cuda,
      \"available\", torch.cuda.is_available(), \"triton\", triton.__version__)
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"no CUDA device\")
"'

step tests 100 env KVTIER_TEST_DEVICE=cuda python3 -m pytest --noconftest -q -rs --durations=8 \
    -p no:cacheprovider tests/test_attention_triton.py

step auto_choice 30 python3 -c '
import logging
logging.basicConfig(level=logging.INFO)
from kvtier.engine.attention import get_backend
print("auto on cuda, page_size 16 ->", get_backend("auto", "cuda", page_size=16).name)
'

step bench 60 python3 -m loadtests.bench_attention --device cuda --backend triton --iterations 20

set +x
echo "== device_check_attention summary (logs in $OUT)"
for name in env tests auto_choice bench; do
    echo "$name: ${STATUS[$name]:-not run}"
done | tee "$OUT/summary.txt"
! grep -qv ': rc=0 ' "$OUT/summary.txt"
