"""Data stages: files -> index -> sample -> batch.

* files: ``opv2v.py`` (OPV2V folder layout, yaml), ``pcd.py`` (PCD reader and cache),
  ``check.py`` (pre-flight check of a whole folder);
* index: ``opv2v.OPV2VSplit`` (scenarios x timestamps x CAVs);
* sample: ``datasets.py`` (one dataset per fusion strategy), ``augment.py``, ``wild.py`` (pose
  noise, latency);
* batch: ``collate.py``; ``pipeline.py`` (``BatchPreparer``) turns a batch into model inputs and
  targets on the device (pillarisation, anchors and targets through the postprocessor).
"""

