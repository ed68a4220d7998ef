"""The run stage: how tools/train.py and tools/eval.py assemble everything.

``recipe.py`` (config and run folder, loaders, model preparation, AMP, the loss step, exact
validation, logging), ``state.py`` (``TrainState``, what a checkpoint holds, when to save, resume),
``loop.py`` (one optimizer step with accumulation and collective non-finite checks; exact
validation loss), ``optim.py`` (optimizers and lr schedules), ``hooks.py`` (callbacks at fixed
points of a run, for its callers), ``evaluator.py`` (tools/eval.py).
"""
