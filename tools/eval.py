#!/usr/bin/env python
"""Evaluate a run: ``python tools/eval.py --model_dir RUN [--fusion_method late] [--save_vis]``.

See ``opencood/engine/evaluator.py`` (and ``--help``) for every option.
"""
from opencood.engine.evaluator import main

if __name__ == "__main__":
    main()
