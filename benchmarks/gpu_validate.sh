#!/usr/bin/env bash
# The GPU suite and the GPU benchmark on one CUDA machine, results under $OUT (default ./gpu-results).
#
#   bash benchmarks/gpu_validate.sh                 # suite, then benchmark
#   SUITE_S=300 BENCH_S=200 bash benchmarks/gpu_validate.sh
#   BENCH_S=0 bash benchmarks/gpu_validate.sh       # suite and demo only
#
# It uses the machine's own CUDA torch (never installs one). Wheels of packages the machine lacks
# (optree, say) can be put in .whl/: they are installed into a private folder first. zeroplan itself
# is installed without dependencies. The suite runs in three parts: the correctness tests four at a
# time, then the overlap probe alone (it times backward against reductions, so nothing shares the
# GPU with it), then the multi-GPU NCCL tests one at a time (each takes up to four GPUs; skipped
# with fewer than two). Files written: env.txt, suite.log, suite.xml, overlap.log, multi.log,
# multi.xml, sanitizer.log, results.tgz (each scenario's measurements as JSON), demo.txt, gpu_step.txt,
# gpu_step.json, profile.txt, gpu_offload.txt, gpu_offload.json.
set -u
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export ZEROPLAN_CUDA_OUT=/tmp/zeroplan-cuda-results  # each scenario's JSON (tests/cuda/results.py)
PY=${PYTHON:-python3}
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())"
} >"$OUT/env.txt" 2>&1
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/zeroplan-site .whl/*.whl
    export PYTHONPATH=/tmp/zeroplan-site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$OUT/env.txt" 2>&1; then
    # No build backend there: the two packages as links (the console script is then missing).
    mkdir -p /tmp/zeroplan-src/zeroplan
    ln -sfn "$PWD/core" /tmp/zeroplan-src/zeroplan/core
    ln -sfn "$PWD/facade" /tmp/zeroplan-src/zeroplan/facade
    export PYTHONPATH=/tmp/zeroplan-src${PYTHONPATH:+:$PYTHONPATH}
fi
$PY -c "import zeroplan.facade, optree, rich; print('zeroplan imports')" >>"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

parallel=()
$PY -c "import xdist" 2>/dev/null && parallel=(-n 4)
timeout "${SUITE_S:-240}" $PY -m pytest tests/cuda "${parallel[@]}" -k "not test_bucket_reductions_run_while_backward_computes" -rA -q \
    --ignore=tests/cuda/test_nccl_multi.py --junitxml="$OUT/suite.xml" >"$OUT/suite.log" 2>&1
echo "suite rc=$?"; tail -n 40 "$OUT/suite.log"
timeout "${OVERLAP_S:-120}" $PY -m pytest tests/cuda -k test_bucket_reductions_run_while_backward_computes -rA -q >"$OUT/overlap.log" 2>&1
echo "overlap rc=$?"; tail -n 15 "$OUT/overlap.log"
# NCCL on 2-8 GPUs (ZEROPLAN_NCCL_WORLD caps the world, default 4): torchrun per configuration.
timeout "${MULTI_S:-600}" $PY -m pytest tests/cuda/test_nccl_multi.py -rA -q --junitxml="$OUT/multi.xml" \
    >"$OUT/multi.log" 2>&1
echo "multi-GPU rc=$?"; tail -n 20 "$OUT/multi.log"
timeout 60 $PY tests/cuda/retire_probe.py 29591 >"$ZEROPLAN_CUDA_OUT/retire-probe.json" 2>"$ZEROPLAN_CUDA_OUT/retire-probe.err"
echo "retire probe rc=$?"; cat "$ZEROPLAN_CUDA_OUT/retire-probe.json"
# CUDA's stream sanitizer (CSAN) over the configurations that use side streams: it reports a kernel
# reading or writing a tensor another stream may still be using without an event between them.
for cfg in stage2-bf16 stage1-bf16-rank-major stage2-fp16-dynamic-scale stage3-bf16 stage3-bf16-clip-checkpoint; do
    TORCH_CUDA_SANITIZER=1 timeout "${SANITIZER_S:-120}" $PY tests/cuda/nccl_matrix.py 29593 "$cfg" \
        >/tmp/zeroplan-csan.log 2>&1
    rc=$?
    cat /tmp/zeroplan-csan.log >>"$OUT/sanitizer.log"
    echo "sanitizer $cfg rc=$rc races=$(grep -c 'CSAN detected' /tmp/zeroplan-csan.log)" | tee -a "$OUT/sanitizer.log"
done
tar -czf "$OUT/results.tgz" -C "$ZEROPLAN_CUDA_OUT" . 2>/dev/null
# The demo as a user starts it, on one GPU (one rank: NCCL needs a GPU per rank), stages 2 and 3.
for stage in 2 3; do
    timeout "${DEMO_S:-90}" zeroplan demo --device cuda --world 1 --stage "$stage" --dtype bf16 --steps 30 \
        >>"$OUT/demo.txt" 2>&1
    echo "demo stage $stage rc=$?" | tee -a "$OUT/demo.txt"
done
if [ "${BENCH_S:-150}" -gt 0 ]; then
    timeout "${BENCH_S:-150}" $PY benchmarks/gpu_step.py --rounds "${ROUNDS:-15}" ${ONLY:+--only "$ONLY"} \
        --json "$OUT/gpu_step.json" --profile "$OUT/profile.txt" >"$OUT/gpu_step.txt" 2>&1
    echo "benchmark rc=$?"; tail -n 30 "$OUT/gpu_step.txt"
fi
if [ "${OFFLOAD_S:-150}" -gt 0 ]; then  # CPU offload against FSDP2's (docs/offload.md)
    timeout "${OFFLOAD_S:-150}" $PY benchmarks/gpu_step.py --rounds "${OFFLOAD_ROUNDS:-8}" \
        --only "zero2 bf16,zero2 bf16 offload,zero2 bf16 offload half,fsdp2 bf16,fsdp2 bf16 offload" \
        --json "$OUT/gpu_offload.json" >"$OUT/gpu_offload.txt" 2>&1
    echo "offload benchmark rc=$?"; tail -n 20 "$OUT/gpu_offload.txt"
fi
