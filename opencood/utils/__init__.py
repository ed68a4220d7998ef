"""Cross-cutting helpers: collectives (``collectives.py``), process-group launch (``launch.py``)
and per-rank logging (``run_logging.py``), importable as one from ``dist.py``; samplers and
batch splitting (``samplers.py``, ``batching.py``), checkpoints (``checkpoint.py``), atomic
writes (``atomic.py``), EMA (``ema.py``), weight init (``init.py``), model statistics and pictures.
"""
