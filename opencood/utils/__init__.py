"""Cross-cutting helpers: process groups and collectives (``dist.py``), samplers and batch
splitting (``samplers.py``, ``batching.py``), checkpoints (``checkpoint.py``), atomic writes
(``atomic.py``), EMA (``ema.py``), weight init (``init.py``), model statistics and pictures.
"""

