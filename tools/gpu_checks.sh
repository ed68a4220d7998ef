#!/usr/bin/env bash
# Every check that needs CUDA, in one go, for a GPU machine lent for a short time:
#   1. the cuda-marked tests (nccl, SyncBN over gloo on one GPU, bf16/fp16 AMP, CUDA pillars,
#      fused optimizers, the prefetcher's stream order);
#   2. the prefetcher's stream tests again on copies of DevicePrefetcher without
#      `wait_stream` and without `record_stream`: there they must FAIL (issue 40, point 4);
#   3. tools/bench.py on CUDA at the OPV2V geometry (every figure: training step ms, operators
#      per step by phase, EMA share of the step, peak memory, evaluation, the kernels against
#      their references), end to end on a small `opv2v`-preset data set;
#   4. the step figures again on the fast path (static pillars + sync-free step, then + channels
#      last, then + compile), in the same run, so they compare with 3.
# Each step's output goes to $OUT (default runs/gpu_checks); a failing step is reported and the
# others still run; summary.txt holds the headline figures, and everything is packed into
# $OUT/gpu_checks.tar.gz at the end. The exit status is 1 if any step failed. OpenCOOD's own
# step is not timed here (its code cannot be fetched on the lent machine): compare with issue
# 40's 40.99 ms (fp32) / 36.71 ms (fp16) on an H100. Written without a GPU: the first GPU
# session should confirm it runs in a few minutes.
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
# The prefetcher's stream tests on a copy of the library with one line removed: the test that
# guards that line must fail there, and fail as a test (pytest's exit status 1), not as a
# broken copy or a collection error.
must_fail() {  # must_fail NAME OUTFILE TEST COMMAND...: ok when TEST fails
  local name=$1 file=$2 test=$3
  shift 3
  "$@" > "$OUT/$file" 2>&1
  local code=$?
  if [ $code -eq 1 ] && grep -q "FAILED .*::$test" "$OUT/$file"; then
    echo "ok      $name: $test fails as it must -> $OUT/$file"
  else
    echo "FAILED  $name: $test did not fail (exit $code; see $OUT/$file)"
    failed=1
  fi
}
prefetch_without() {  # prefetch_without LINE DIR [PYTEST ARGS]: the stream tests, run from a
  # copy (in DIR) of the library and those tests, with LINE removed from data/collate.py
  local line=$1 dir=$2
  shift 2
  rm -rf "$dir" && mkdir -p "$dir/tests" && cp -r opencood pytest.ini "$dir/" \
    && cp tests/conftest.py tests/test_device_prefetcher.py "$dir/tests/" \
    && sed -i "/$line/d" "$dir/opencood/data/collate.py" || return 2
  if grep -q "$line" "$dir/opencood/data/collate.py"; then
    echo "could not remove $line"; return 2
  fi
  (cd "$dir" && PYTHONPATH=. python -m pytest -q -m cuda -p no:cacheprovider \
    tests/test_device_prefetcher.py -k "slow_copy or not_reused" "$@")
}
BROKEN=${TMPDIR:-/tmp}/opencood_broken_prefetcher
GUARDED_LINES=("consumer.wait_stream(copy_stream)" "_record_stream(batch, consumer)")
STEP_FIGURES=train_step_model_only,train_step_no_pillarise,operators_per_step,host_syncs_per_step,ema_update

if [ -n "$QUICK" ]; then
  step "cuda-marked tests (collection only)" pytest_cuda.txt python -m pytest -q -m cuda --co
  step "synthetic opv2v data (tiny)" generate.txt python tools/generate_synthetic.py \
    --out "$DATA" --preset tiny --frames 2 --scenarios 1 1 1 --workers 2 --quiet --overwrite
  step "bench.py --quick" bench.jsonl python tools/bench.py --quick --data "$DATA"
  step "bench.py --quick, fast path" bench_fast.jsonl python tools/bench.py --quick \
    --figures "$STEP_FIGURES" --static_pillars 320 --sync_free
  step "prefetcher copies without the guarded lines (collection only)" prefetch_copies.txt \
    prefetch_without "${GUARDED_LINES[0]}" "$BROKEN/wait" --co
else
  step "cuda-marked tests" pytest_cuda.txt python -m pytest -q -m cuda -rA
  must_fail "prefetcher tests without wait_stream" prefetch_without_wait_stream.txt \
    test_on_cuda_a_batch_is_read_only_after_its_slow_copy prefetch_without "${GUARDED_LINES[0]}" "$BROKEN/wait"
  must_fail "prefetcher tests without record_stream" prefetch_without_record_stream.txt \
    test_on_cuda_a_batch_memory_is_not_reused_while_the_step_still_reads_it prefetch_without "${GUARDED_LINES[1]}" "$BROKEN/record"
  step "synthetic opv2v data" generate.txt python tools/generate_synthetic.py --out "$DATA" \
    --preset opv2v --frames 4 --scenarios 2 1 1 --workers "$(nproc)" --quiet --overwrite
  step "bench.py (CUDA, OPV2V geometry)" bench.jsonl python tools/bench.py --device cuda \
    --preset opv2v --data "$DATA"
  FAST=(--device cuda --preset opv2v --figures "$STEP_FIGURES" --static_pillars 16000 --sync_free)
  step "bench.py fast path: static pillars + sync-free" bench_fast.jsonl \
    python tools/bench.py "${FAST[@]}"
  step "bench.py fast path + channels last" bench_fast_cl.jsonl \
    python tools/bench.py "${FAST[@]}" --set performance.channels_last=true
  step "bench.py fast path + channels last + compile" bench_fast_cl_compile.jsonl \
    python tools/bench.py "${FAST[@]}" --set performance.channels_last=true --compile
fi
# The headline figures of every bench run, one line each (a figure that did not run says so).
python - "$OUT" > "$OUT/summary.txt" 2>&1 <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for path in sorted(out.glob("bench*.jsonl")):
    rows = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        rows[record.get("figure")] = record
    def get(figure, key):
        return rows.get(figure, {}).get(key, rows.get(figure, {}).get("skipped", "-"))
    print(f"{path.name}: step {get('train_step_model_only', 'ms')} ms "
          f"(no pillarise {get('train_step_no_pillarise', 'ms')} ms), "
          f"kernels/step {get('operators_per_step', 'kernels')} "
          f"{get('operators_per_step', 'by_phase')}, "
          f"EMA {get('ema_update', 'ms')} ms = {get('ema_update', 'share_of_step_pct')} %, "
          f"host syncs {get('host_syncs_per_step', 'syncs')}, "
          f"peak {get('peak_gpu_memory', 'mib')} MiB, "
          f"end to end {get('train_step_end_to_end', 'ms')} ms")
PY
cat "$OUT/summary.txt"
tail -n 3 "$OUT/pytest_cuda.txt"
tar -czf "$OUT/gpu_checks.tar.gz" --exclude=gpu_checks.tar.gz -C "$OUT" . \
  && echo "all outputs: $OUT/gpu_checks.tar.gz"
exit $failed
