#!/usr/bin/env bash
# The README's first command: install, generate the `small` synthetic OPV2V data, train an
# intermediate-fusion model (F-Cooper) with torchrun, evaluate it and print the AP table.
# CPU: 2 processes (gloo). GPUs: one process per visible GPU (nccl).
# Environment knobs: CONFIG (yaml), RUN (run folder), DATA (data folder), EPOCHS.
# A camera config (input_source: [camera], e.g. hypes_yaml/synthetic/camera_small.yaml) gets the
# preset generated with --cameras (and --depth: the depth images that supervise the lift-splat
# depth, when input_source has depth), in its own folder (data/synthetic_small_cameras).
# RUN defaults to one folder per config (runs/quickstart_fcooper, runs/quickstart_attfuse, ...):
# a run folder belongs to one config, and train.py refuses another one's.
set -euo pipefail
cd "$(dirname "$0")/.."

CONFIG=${CONFIG:-hypes_yaml/synthetic/point_pillar_fcooper.yaml}
CONFIG_NAME=$(basename "$CONFIG" .yaml)
RUN=${RUN:-runs/quickstart_${CONFIG_NAME#point_pillar_}}
if [ ! -f "$CONFIG" ]; then
  echo "error: CONFIG=$CONFIG: config file not found (relative to $(pwd))" >&2
  exit 2
fi

python -m pip install -q -r requirements.txt
python -m pip install -q -e . --no-deps

SOURCES=$(python -c "import sys; from opencood.config import load_config
print(' '.join(load_config(sys.argv[1])['input_source']))" "$CONFIG")
CAMERA_FLAGS=()
case " $SOURCES " in *" camera "*) CAMERA_FLAGS+=(--cameras) ;; esac
case " $SOURCES " in *" depth "*) CAMERA_FLAGS+=(--depth) ;; esac
if [ ${#CAMERA_FLAGS[@]} -gt 0 ]; then
  DATA=${DATA:-data/synthetic_small_cameras}
else
  DATA=${DATA:-data/synthetic_small}
fi
if [ ! -f "$DATA/generation.yaml" ]; then
  python tools/generate_synthetic.py --out "$DATA" --preset small --seed 0 --workers 2 \
    "${CAMERA_FLAGS[@]}"
elif [[ " ${CAMERA_FLAGS[*]} " == *" --depth "* ]] && ! python -c "import sys, yaml
cameras = yaml.safe_load(open(sys.argv[1]))['preset_config'].get('cameras') or {}
sys.exit(0 if cameras.get('depth') else 1)" "$DATA/generation.yaml"; then
  echo "error: $DATA has no depth images, which $CONFIG trains on (input_source: depth):" \
    "remove the folder (the quick start regenerates it) or pass DATA=<a new folder>" >&2
  exit 2
fi

NPROC=$(python -c "import torch; print(torch.cuda.device_count() or 2)")
EXTRA=()
if [ -n "${EPOCHS:-}" ]; then EXTRA+=(--set "train_params.epoches=$EPOCHS"); fi
torchrun --standalone --nproc_per_node="$NPROC" tools/train.py --hypes_yaml "$CONFIG" \
  --model_dir "$RUN" --set "root_dir=$DATA/train" --set "validate_dir=$DATA/validate" \
  --set "test_dir=$DATA/test" "${EXTRA[@]}"

python tools/eval.py --model_dir "$RUN" --split test
