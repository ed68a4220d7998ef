"""The run stage: the training and evaluation flows and the pieces they assemble.

``trainer.py`` (the training flow, top down, and its command line: tools/train.py),
``recipe.py`` (config and run folder, loaders, model preparation, the training parts, AMP, exact
validation, logging), ``task.py`` (forward + loss), ``state.py`` (``TrainState``, what a
checkpoint holds, when to save, resume), ``loop.py`` (one optimizer step with accumulation and
collective non-finite checks; exact validation loss), ``optim.py`` (optimizers and lr
schedules), ``hooks.py`` (callbacks at fixed points of a run, for its callers),
``evaluator.py`` (the evaluation flow and its command line: tools/eval.py).
"""
