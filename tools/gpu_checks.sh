#!/usr/bin/env bash
# Every check that needs CUDA, in one go, for a GPU machine lent for a short time:
#   1. the cuda-marked tests (nccl, SyncBN over gloo on one GPU, bf16/fp16 AMP, CUDA pillars);
#   2. tools/bench.py on CUDA at the OPV2V geometry (every figure: training, evaluation, the
#      kernels against their references), end to end on a small `opv2v`-preset data set.
# Each step's output goes to $OUT (default runs/gpu_checks); a failing step is reported and the
# others still run; the exit status is 1 if any step failed. Expected to take a few minutes on
# one H100 (written without a GPU: the first GPU session should confirm it).
#
#   PYTHONPATH=. OUT=$OUT bash tools/gpu_checks.sh          # no install needed
#   QUICK=1 bash tools/gpu_checks.sh                       # a seconds-long rehearsal (CPU too)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-runs/gpu_checks}
QUICK=${QUICK:-}
mkdir -p "$OUT"
failed=0

step() {  # step NAME OUTFILE COMMAND...: run, log to $OUT/OUTFILE, report one line
  local name=$1 file=$2
  shift 2
  local start=$SECONDS
  "$@" > "$OUT/$file" 2> "$OUT/$file.stderr"
  local code=$?
  if [ $code -eq 0 ]; then
    echo "ok      $name ($((SECONDS - start)) s) -> $OUT/$file"
  else
    echo "FAILED  $name (exit $code, $((SECONDS - start)) s): see $OUT/$file and $file.stderr"
    failed=1
  fi
}

(nvidia-smi || echo "nvidia-smi not available") > "$OUT/nvidia_smi.txt" 2>&1
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" \
  | tee "$OUT/torch.txt"

# Outside $OUT: the device tool copies $OUT back, and the data set is not worth the transfer.
DATA=${DATA:-${TMPDIR:-/tmp}/opencood_gpu_checks_data}
if [ -n "$QUICK" ]; then
  step "cuda-marked tests (collection only)" pytest_cuda.txt python -m pytest -q -m cuda --co
  step "synthetic opv2v data (tiny)" generate.txt python tools/generate_synthetic.py \
    --out "$DATA" --preset tiny --frames 2 --scenarios 1 1 1 --workers 2 --quiet --overwrite
  step "bench.py --quick" bench.jsonl python tools/bench.py --quick --data "$DATA"
else
  step "cuda-marked tests" pytest_cuda.txt python -m pytest -q -m cuda -rA
  step "synthetic opv2v data" generate.txt python tools/generate_synthetic.py --out "$DATA" \
    --preset opv2v --frames 4 --scenarios 2 1 1 --workers "$(nproc)" --quiet --overwrite
  step "bench.py (CUDA, OPV2V geometry)" bench.jsonl python tools/bench.py --device cuda \
    --preset opv2v --data "$DATA"
fi
tail -n 3 "$OUT/pytest_cuda.txt"
exit $failed
