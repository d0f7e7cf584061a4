"""Stop the run at the first NaN or inf loss, before that batch's checkpoint is written.

Logs nothing. It raises `NonFiniteLossError`, which benchmark.py reports in one line naming the
batch and the last good checkpoint to resume from.
"""
from __future__ import annotations

import math
import os

import torch
from composer.callbacks import CheckpointSaver
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from t2ibench.locations import is_remote


class NonFiniteLossError(RuntimeError):
    """The loss went NaN/inf: a property of the run (learning rate, precision, data), reported in one line."""


class StopOnNonFiniteLoss(Callback):
    """Stop the run at the first NaN/inf loss, before the checkpoint of that batch is written.

    Checked at BATCH_END, which comes before Composer's checkpoint event, so no broken state is
    saved. `state.loss` is only the last microbatch's loss: a NaN in an earlier microbatch would
    poison the step and pass. Composer's `total_loss_dict` sums every microbatch's loss and is
    already all-reduced over ranks (a float, the same on every rank), so checking it catches a NaN
    in any microbatch on any rank at its own batch, with no extra collective, and every rank stops
    at the same batch instead of the healthy ones waiting in the next collective until the timeout.
    """

    def __init__(self, load_path: str | None = None, save_folder: str | None = None):
        self.load_path, self.save_folder = load_path, save_folder

    def batch_end(self, state: State, logger: Logger) -> None:
        total = state.total_loss_dict.get("loss/train/total")
        if total is None:  # Composer did not fill it (no loss this batch): check this rank's last loss, synced
            losses = state.loss if isinstance(state.loss, (list, tuple)) else [state.loss]
            bad = torch.zeros(1, device=losses[0].device)
            for loss in losses:
                bad += (~torch.isfinite(loss.detach())).any().float()
            dist.all_reduce(bad, reduce_operation="MAX")
            if bad.item() == 0:
                return
        elif math.isfinite(total):
            return
        # The timestamp already counts this batch: it is the N of the console's [batch=N/...] and of
        # the ep*-baN checkpoint this batch would have written.
        batch = int(state.timestamp.batch)
        # Only rank 0 writes (and remembers) checkpoint files: every rank reports rank 0's answer.
        box = [self.last_good_checkpoint(state) if dist.get_global_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        where = f"last good checkpoint: {box[0]}" if box[0] else "no checkpoint was saved yet (see --save_folder)"
        raise NonFiniteLossError(
            f"non-finite loss at batch {batch} (ba{batch}); stopped before saving it; {where}. "
            "Resume from it (--load_path or --autoresume), perhaps with a lower --lr or --precision fp32.")

    def last_good_checkpoint(self, state: State) -> str | None:
        saver = next((cb for cb in state.callbacks if isinstance(cb, CheckpointSaver)), None)
        if saver is not None and saver.saved_checkpoints:  # written by this process
            path = saver.saved_checkpoints[-1]
        elif self.load_path:  # started from --load_path, nothing saved since
            return self.load_path
        elif saver is not None and saver.all_saved_checkpoints_to_timestamp:
            # --autoresume: the saver's history came back with the checkpoint it loaded.
            path = max(saver.all_saved_checkpoints_to_timestamp.items(), key=lambda item: int(item[1].batch))[0]
        else:
            return None
        if self.save_folder and is_remote(self.save_folder):  # locally there was only a temporary copy
            return f"{self.save_folder.rstrip('/')}/{os.path.basename(path)}"
        return path
