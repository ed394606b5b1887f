#!/usr/bin/env bash
# Everything kvtier checks on a GPU, in one run (a device lease is short): the Triton
# paged-attention check (scripts/device_check_attention.sh), the tier tests with HBM on the
# device (the engine decodes through `auto` attention against the transformers oracle), the
# CUDA transfer round trip, the pinned HBM<->DRAM copy benchmark, and the resume-TTFT benchmark
# (history in HBM / in pinned DRAM / recomputed, decision 0011's premise). Needs python3 with
# torch, triton, transformers and pytest; no virtualenv, Ray or Redis. Logs under $OUT.
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/kvtier-device-check}"
mkdir -p "$OUT"
rc=0
bash scripts/device_check_attention.sh || rc=1
timeout --kill-after=5 180 env KVTIER_TEST_DEVICE=cuda python3 -m pytest --noconftest -q -rs -p no:cacheprovider \
    tests/test_tier_manager.py tests/test_transfer.py 2>&1 | tee "$OUT/tiers.log" | tail -15 || rc=1
timeout --kill-after=5 90 python3 -m loadtests.bench_gpu_copy --json 2>&1 | tee "$OUT/gpu_copy.log" | tail -40 || rc=1
timeout --kill-after=5 300 python3 -m loadtests.bench_resume_gpu --contexts 2048,8192,32768 2>&1 | tee "$OUT/resume.log" | tail -10 || rc=1
echo "device_check rc=$rc"
exit $rc
