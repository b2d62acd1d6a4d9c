#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one go, on a machine with a CUDA build of PyTorch and nvcc:
#
#     benchmarks/ops/gpu_checks.sh [results dir]
#
# 1. builds the native kernels in place with that machine's python (PYTHON, default: .venv/bin/python if
#    there, else python3): every CPU variant and deepspeed_ppq._C_cuda;
# 2. runs the tests marked `gpu` (the CUDA kernels against their references and the CPU kernels, opcheck,
#    the codecs on CUDA tensors); tests/megatron's GPU test runs too where megatron-core is installed;
# 3. runs benchmarks/ops/bench_cuda.py (each kernel against a device-to-device copy of as many bytes),
#    which writes benchmarks/results/bench_cuda.{json,md}.
# The build log, the test log and the benchmark's results are also copied into the results dir (if given).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUTDIR=${1:-}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package in place, built below
log() { if [ -n "$OUTDIR" ]; then tee "$OUTDIR/$1"; else cat; fi; }

"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible to torch ' + torch.__version__; \
print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0))" || exit 1
nvcc --version | tail -2

export MAX_JOBS=${MAX_JOBS:-$(nproc)}
start=$(date +%s)
"$PY" setup.py -q build_ext --inplace 2>&1 | log build.log | tail -20
build_rc=${PIPESTATUS[0]}
echo "build: rc $build_rc in $(( $(date +%s) - start )) s"
[ "$build_rc" = 0 ] || exit 1
"$PY" -c "import deepspeed_ppq.ops as o; print(o.native_status())"

tests="tests/ops/test_cuda_kernels.py tests/quant/test_master_free.py tests/quant/test_weight_kernels.py \
tests/compress/test_compress.py"
"$PY" -c "import megatron.core" 2>/dev/null && tests="$tests tests/megatron/test_megatron_layers.py"
# with pytest-xdist, in worker processes: a test that crashes its process is reported, the others still run
workers=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 4")
start=$(date +%s)
# shellcheck disable=SC2086
"$PY" -m pytest -q -ra -m gpu -p no:cacheprovider $workers $tests 2>&1 | log gpu_tests.log | tail -60
test_rc=${PIPESTATUS[0]}
echo "gpu tests: rc $test_rc in $(( $(date +%s) - start )) s"

start=$(date +%s)
"$PY" benchmarks/ops/bench_cuda.py 2>&1 | log bench_cuda.log
bench_rc=${PIPESTATUS[0]}
echo "bench_cuda: rc $bench_rc in $(( $(date +%s) - start )) s"
[ -n "$OUTDIR" ] && cp benchmarks/results/bench_cuda.json benchmarks/results/bench_cuda.md "$OUTDIR"/ 2>/dev/null
[ "$test_rc" = 0 ] && [ "$bench_rc" = 0 ]
