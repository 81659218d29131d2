"""A quiet log: Lightning's adverts and the notes a user cannot act on are dropped (on import, once).

Dropped: the "💡 Tip: ... litlogger/litmodels" adverts, "`Trainer.fit` stopped: `max_steps=N` reached" (wanexp prints
how the run finished), "Checkpoint directory ... exists and is not empty" (a resumed run's own folder), "Using
ModelCheckpoint with manual optimization ..." (DMD: wanexp saves at the step's end, after the update, which is what a
resume continues from) and torch's ``weights_only`` FutureWarning (wanexp loads every checkpoint with ``weights_only=True``). Lightning's other lines
(devices, restored checkpoints) and every warning about the user's own settings stay.
"""
from __future__ import annotations

import logging
import re
import warnings

DROPPED = re.compile(r"^(💡 Tip:|`Trainer\.fit` stopped: `max_(steps|epochs)=\d+` reached)")


class _Drop(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not DROPPED.match(str(record.getMessage()))


def install() -> None:
    import lightning.pytorch  # noqa: F401  (its handler must exist to be filtered)

    for name in ("lightning.pytorch", "lightning.fabric", "lightning.pytorch.utilities.rank_zero",
                 "lightning.fabric.utilities.rank_zero", "lightning_utilities.core.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop())
        # records of child loggers reach the handlers through these; filter where they are emitted too
        for handler in logger.handlers:
            if not any(isinstance(f, _Drop) for f in handler.filters):
                handler.addFilter(_Drop())
    warnings.filterwarnings("ignore", message=r".*Checkpoint directory .* exists and is not empty.*")
    warnings.filterwarnings("ignore", message=r".*weights_only.*", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*Using ModelCheckpoint with manual optimization.*")


install()
