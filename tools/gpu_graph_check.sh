#!/usr/bin/env bash
# performance.cuda_graph on a GPU, in one short run (about 3 minutes on an H100):
#   1. the cuda-marked tests of tests/test_cuda_graph.py: the step's work run eagerly under
#      CaptureHazards on CUDA (every op a capture refuses, with its opencood file:line; none
#      expected), then the capture (2 eager warm-ups, capture, 3 replays with a changing lr and
#      the EMA = 5 eager steps on the same batches);
#   2. tools/bench.py's step figures at the OPV2V geometry (static pillars 16,000 + sync-free
#      step) without and with the CUDA graph, then both again with --compile (last: the
#      compile takes the longest; each run is bounded by `timeout`).
# Prints one line per figure: ms (median of 10 after 5 warm-ups), peak MiB, and the switches;
# the raw JSON lines and logs go to $OUT (default runs/gpu_graph_check).
#
#   PYTHONPATH=. OUT=$OUT bash tools/gpu_graph_check.sh
#   QUICK=1 bash tools/gpu_graph_check.sh      # a rehearsal on CPU (the graph falls back there)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-runs/gpu_graph_check}
PY=${PYTHON:-python}
mkdir -p "$OUT"
failed=0

echo "== cuda-marked capture tests"
# The whole output in $OUT/test.txt (a failure's sites and reasons), its short summary here.
timeout 120 "$PY" -m pytest -q -m cuda tests/test_cuda_graph.py -rs --tb=short \
  > "$OUT/test.txt" 2>&1 || failed=1
grep -E "^(E  |FAILED|SKIPPED|[0-9]+ (passed|failed|skipped))" "$OUT/test.txt" | tail -20

if [ -n "${QUICK:-}" ]; then
  SIZES=(--device cpu --preset quick --steps 1 --warmup 3 --static_pillars 400)
else
  SIZES=(--device cuda --preset opv2v --steps 10 --warmup 5 --static_pillars 16000)
fi

bench() {  # bench SECONDS NAME EXTRA_FLAGS...
  local limit=$1 name=$2
  shift 2
  echo "== bench: $name"
  timeout "$limit" "$PY" tools/bench.py "${SIZES[@]}" --sync_free \
    --figures train_step_model_only,train_step_no_pillarise,peak_gpu_memory \
    "$@" > "$OUT/$name.jsonl" 2> "$OUT/$name.log" \
    || { echo "FAILED $name: see $OUT/$name.log"; tail -5 "$OUT/$name.log"; failed=1; }
  grep -h "cuda_graph" "$OUT/$name.log" | head -3
  "$PY" - "$OUT/$name.jsonl" <<'PYEOF'
import json, sys
for line in open(sys.argv[1]):
    if not line.startswith("{"):
        continue
    row = json.loads(line)
    print(f"  {row['figure']:<26} ms {row.get('ms', '-'):>9}  mib {row.get('mib', '-'):>9}  "
          f"graph {row.get('cuda_graph')} compile {row.get('compile')} "
          f"loss {row.get('last_loss', '-')} {row.get('device_name', '')}")
PYEOF
}

bench 90 eager_static
bench 90 cuda_graph --cuda_graph
[ -n "${QUICK:-}" ] && exit $failed          # the rehearsal skips the compiles
bench 120 compile --compile
bench 120 compile_cuda_graph --compile --cuda_graph
exit $failed
