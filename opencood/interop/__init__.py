"""Checkpoints of other codebases (issue 24): OpenCOOD's configs and state dicts, translated.

* ``opencood_config``: OpenCOOD's run-folder ``config.yaml`` (read safely, numpy tags and all)
  -> our config.
* ``opencood_ckpt``: OpenCOOD's state dicts <-> ours, per model, strictly.
* ``importer``: a whole OpenCOOD run folder -> one of ours that ``tools/eval.py`` evaluates
  (``tools/import_checkpoint.py``).
"""
