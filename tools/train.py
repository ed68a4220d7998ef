#!/usr/bin/env python
"""Train a cooperative detector: ``torchrun --nproc_per_node=N tools/train.py --hypes_yaml X.yaml``.

See ``opencood/engine/trainer.py`` for the whole flow (and ``--help``).
"""
from opencood.engine.trainer import main

if __name__ == "__main__":
    main()
