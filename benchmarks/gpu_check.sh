#!/usr/bin/env bash
# Every GPU check in one go, as benchmarks/results/gpu-h100/ was made: the compiled-kernel tests, then the three
# benchmarks (and the CUDA-graph ceiling of a decode step, and the prefill cost of the cache), each output also written
# to OUT_DIR. Costs do not depend on the weights, so MODEL may be a
# randomly initialised copy of the model (benchmarks/random_copy.py) where the weights cannot be brought along; a
# MODEL folder is also the model of the GPU chat tests (RETENTION_GPU_MODEL), which otherwise need the embedded one.
#
#   benchmarks/gpu_check.sh [OUT_DIR]                       # default OUT_DIR runs/gpu-check
#   PY=python3 MODEL=/path/to/model PYTEST_ARGS="-n 8" benchmarks/gpu_check.sh out
#
# Without the GGUF there: `python -m benchmarks.random_copy smollm2-135m shape --no-weights` here (3 MB), carry `shape`,
# then `python3 -m benchmarks.random_copy shape /tmp/smol-random && MODEL=/tmp/smol-random benchmarks/gpu_check.sh` there.
# Budget about 10 minutes: the fp32 attention tests at d = 128 each take 200-215 s to compile on an H100.
set -u -o pipefail
OUT=${1:-runs/gpu-check}
PY=${PY:-python}
MODEL=${MODEL:-smollm2-135m}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d "$MODEL" ]; then export RETENTION_GPU_MODEL=$MODEL; fi
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device: these checks need a GPU'" || exit 1
# a process of its own: interpreter-mode test modules set TRITON_INTERPRET=1 for theirs
$PY -m pytest -p no:cacheprovider -m gpu tests/test_gpu_kernels.py tests/test_gpu_train.py -v --durations=8 ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.txt"
$PY -m benchmarks.kernels --seq 4096 16384 32768 --dims 64 128 2>&1 | tee "$OUT/bench_kernels.txt"
for dtype in float32 bfloat16; do
  $PY -m benchmarks.train_step --model "$MODEL" --seq-len 4096 --reps 5 --dtype $dtype 2>&1
done | tee "$OUT/bench_train.txt"
$PY -m benchmarks.decode --model "$MODEL" --contexts 2048 4096 8192 --budget 512 --new 32 --dtype bfloat16 --repeats 3 \
  --profile "$OUT/decode_profile.txt" 2>&1 \
  | tee "$OUT/bench_decode.txt"
$PY -m benchmarks.graph_ceiling --model "$MODEL" --context 4096 --budget 512 --new 32 --repeats 4 --dtype bfloat16 2>&1 \
  | tee "$OUT/bench_graph_ceiling.txt"
$PY -m benchmarks.prefill --model "$MODEL" --contexts 4096 16384 --chunk 0 --dtype bfloat16 --repeats 3 2>&1 \
  | tee "$OUT/bench_prefill.txt"
