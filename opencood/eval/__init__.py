"""Evaluation stage: boxes -> AP.

``inference.py`` runs a model over a loader and turns its output into per-sample detections (via
the postprocessor); ``ap.py`` accumulates AP@0.3/0.5/0.7, distance bins and visibility groups;
``protocols.py`` selects the AP protocol (ours, OpenCOOD's, CoAlign's); ``records.py`` writes and
reads evaluation records; ``report.py`` holds the arithmetic and text of the reports (mean ± std,
spreads, table cells) that tools/eval.py and the results and robustness tables share;
``vis.py`` draws BEV pictures.
"""

