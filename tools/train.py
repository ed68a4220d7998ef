#!/usr/bin/env python
"""Train: ``torchrun --nproc_per_node=N tools/train.py --hypes_yaml X.yaml [--model_dir RUN]
[--set k=v]`` (or plain ``python`` for one process).

The flow reads top down in ``opencood/engine/trainer.py`` (and ``--help`` lists every option).
This file stays the main script: loader workers come from a forkserver that preloads it
(docs/DESIGN.md §6.13), so it does nothing on import.
"""
from opencood.engine.trainer import main

if __name__ == "__main__":
    main()
