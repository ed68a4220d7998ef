#!/usr/bin/env bash
# performance.cuda_graph on a GPU, in one short run (about 3 minutes on an H100):
#   1. the cuda-marked capture test (tests/test_cuda_graph.py: 2 eager warm-ups, capture,
#      3 replays with a changing lr and the EMA = 5 eager steps on the same batches);
#   2. tools/bench.py's step figures at the OPV2V geometry (static pillars 16,000 + sync-free
#      step) without and with the CUDA graph, then both again with --compile (last: the
#      compile takes the longest; each run is bounded by `timeout`).
# Prints one line per figure: ms (median of 10 after 5 warm-ups), peak MiB, and the switches;
# the raw JSON lines and logs go to $OUT (default runs/gpu_graph_check).
#
#   PYTHONPATH=. OUT=$OUT bash tools/gpu_graph_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-runs/gpu_graph_check}
PY=${PYTHON:-python}
mkdir -p "$OUT"
failed=0

echo "== cuda-marked capture test"
timeout 120 "$PY" -m pytest -q -m cuda tests/test_cuda_graph.py -rs 2>&1 | tail -15 \
  | tee "$OUT/test.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=1

bench() {  # bench NAME EXTRA_FLAGS...
  local name=$1
  shift
  echo "== bench: $name"
  timeout 150 "$PY" tools/bench.py --device cuda --preset opv2v --steps 10 --warmup 5 \
    --figures train_step_model_only,train_step_no_pillarise,peak_gpu_memory \
    --static_pillars 16000 --sync_free "$@" > "$OUT/$name.jsonl" 2> "$OUT/$name.log" \
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

bench eager_static
bench cuda_graph --cuda_graph
bench compile --compile
bench compile_cuda_graph --compile --cuda_graph
exit $failed
