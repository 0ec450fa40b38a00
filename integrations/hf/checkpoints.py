"""The HF Trainer's checkpoint folders as the adapter reads them."""

from __future__ import annotations

import logging
import os
import re

from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

logger = logging.getLogger("aniso_plugins.hf")


def newest_complete_checkpoint(output_dir: str) -> str | None:
    """The highest-step ``checkpoint-N`` folder of `output_dir` that the Trainer finished saving
    (it holds ``trainer_state.json``, written after the model and optimizer), or None. A newer
    folder without it is a save that was interrupted; resuming from it would fail, so it is
    skipped with a warning (transformers' ``get_last_checkpoint`` takes the highest number)."""
    if not os.path.isdir(output_dir):
        return None
    newest = get_last_checkpoint(output_dir)
    complete = [
        os.path.join(output_dir, name)
        for name in os.listdir(output_dir)
        if re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-\d+", name)
        and os.path.exists(os.path.join(output_dir, name, TRAINER_STATE_NAME))
    ]
    best = max(complete, key=lambda path: int(path.rsplit("-", 1)[1]), default=None)
    if newest is not None and best != newest:
        logger.warning(
            "%s is incomplete (no %s: its save was interrupted); resuming from %s", newest, TRAINER_STATE_NAME, best
        )
    return best


__all__ = ["newest_complete_checkpoint"]
