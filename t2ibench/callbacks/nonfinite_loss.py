"""Stop the run at the first NaN or inf loss or gradient norm, before that batch's checkpoint is written,
and a non-finite gradient before the optimizer steps with it.

Logs nothing. It raises `NonFiniteLossError`, which benchmark.py reports in one line naming the
batch and the last good checkpoint to resume from; with --results_json, rank 0 first writes there a
record that says the run diverged (`diverged`, docs/metrics.md), in place of any earlier results.
"""
from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING

import torch
from composer.callbacks import CheckpointSaver
from composer.core import Callback, Precision, State
from composer.loggers import Logger
from composer.utils import dist

from t2ibench.core.files import write_error, write_text
from t2ibench.train.grad_norm import GradientNorm
from t2ibench.core.locations import is_remote

if TYPE_CHECKING:
    from t2ibench.train.settings import Settings


class NonFiniteLossError(FloatingPointError):
    """The loss or the gradient went NaN/inf: a property of the run (learning rate, precision, data),
    reported in one line. Not a RuntimeError: Composer 0.32.1 rewraps a RuntimeError raised inside a
    step whose message holds "cuda" or "c10" (a checkpoint path may) while it searches the microbatch."""


def tensors(loss: torch.Tensor | dict | list | tuple) -> list[torch.Tensor]:
    """The tensors of a loss as Composer holds it (a tensor, or several in a dict, list or tuple)."""
    return list(loss.values()) if isinstance(loss, dict) else list(loss) if isinstance(loss, (list, tuple)) else [loss]


class StopOnNonFiniteLoss(Callback):
    """Stop the run at the first NaN/inf gradient norm or loss, before the optimizer step of that batch
    (the gradient) and before its checkpoint (both).

    The gradient norm is read at AFTER_TRAIN_BATCH, after `GradientNorm` computed it and before the
    optimizer steps (Composer runs the event inside the optimizer's closure): a non-finite gradient
    never reaches AdamW, whose second moment would keep the inf and freeze the weight for good. The
    read is a host sync, one Composer's closure makes right after anyway (it reads the loss with
    `.item()` before AdamW steps, for every precision but amp_fp16): the device has nothing queued in
    between, so the check costs a 4-byte copy, not a drain. Under amp_fp16 the GradScaler already
    skips a step whose gradient is not finite and lowers its scale (fp16's normal start), so the norm
    is not read there. Under FSDP reading it gathers the norm's shards (one scalar all-reduce a step);
    under DDP every rank holds the same averaged gradient, so every rank stops at the same batch.

    The loss is checked at BATCH_END, which comes before Composer's checkpoint event, so no broken
    state is saved. `state.loss` is only the last microbatch's loss: a NaN in an earlier microbatch
    would poison the step and pass. Composer's `total_loss_dict` sums every microbatch's loss and is
    already all-reduced over ranks (a float, the same on every rank), so checking it catches a NaN
    in any microbatch on any rank at its own batch, with no extra collective, and every rank stops
    at the same batch instead of the healthy ones waiting in the next collective until the timeout.
    A NaN loss makes the gradient NaN too, so it is usually the gradient check that stops the run:
    the microbatches' losses (kept as references, no copy) then name the loss as the cause.
    """

    def __init__(self, load_path: str | None = None, save_folder: str | None = None,
                 grad_norm: GradientNorm | None = None, results_json: str | None = None, has_target: bool = False):
        self.load_path, self.save_folder = load_path, save_folder
        self.grad_norm, self.results_json = grad_norm, results_json
        self.has_target = has_target  # a run to a target that diverged did not converge (MLPerf's count)
        self._losses: list[torch.Tensor] = []  # this batch's microbatch losses, detached (views: no copy)

    @classmethod
    def for_run(cls, settings: Settings, grad_norm: GradientNorm) -> StopOnNonFiniteLoss:
        """benchmark.py's: its checkpoints, its results file and its gradient norm."""
        targets = (settings.eval_target, settings.fid_target, settings.clip_target)
        return cls(settings.load_path, settings.save_folder, grad_norm, settings.results_json,
                   has_target=any(target is not None for target in targets))

    def before_train_batch(self, state: State, logger: Logger) -> None:
        self._losses.clear()  # also when Composer retries a batch at a smaller microbatch

    def after_backward(self, state: State, logger: Logger) -> None:
        # After the backward, not at AFTER_LOSS: the loss that backward saw, whatever changed it since.
        if self.grad_norm is not None:
            self._losses += [loss.detach() for loss in tensors(state.loss)]

    def after_train_batch(self, state: State, logger: Logger) -> None:
        if self.grad_norm is None or state.precision == Precision.AMP_FP16:
            return
        norm = self.grad_norm.last_norm()  # every rank (a collective under FSDP)
        if norm is None or math.isfinite(norm):
            return
        # Every rank is here (the norm is the whole gradient's): which cause, agreed over the ranks.
        bad_loss = state.device.tensor_to_device(
            torch.tensor([float(any(not torch.isfinite(loss).all() for loss in self._losses))]))
        dist.all_reduce(bad_loss, reduce_operation="MAX")
        cause = "loss" if bad_loss.item() > 0 else f"gradient norm ({norm:g})"
        # The timestamp counts the batches done before this one.
        self.stop(state, int(state.timestamp.batch) + 1, cause, "before the optimizer step and before saving it")

    def batch_end(self, state: State, logger: Logger) -> None:
        total = state.total_loss_dict.get("loss/train/total")
        if total is None:  # Composer did not fill it (no loss this batch): check this rank's last loss, synced
            losses = tensors(state.loss)
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
        self.stop(state, int(state.timestamp.batch), "loss", "before saving it")

    def stop(self, state: State, batch: int, cause: str, when: str) -> None:
        """Raise the one line every rank reports (rank 0's checkpoint, broadcast), after rank 0 wrote
        the diverged record to --results_json."""
        # Only rank 0 writes (and remembers) checkpoint files: every rank reports rank 0's answer.
        box = [self.last_good_checkpoint(state) if dist.get_global_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        where = (f"last good checkpoint: {box[0]}. Resume from it (--load_path or --autoresume), perhaps with"
                 if box[0] else "no checkpoint was saved yet (see --save_folder); try")
        line = f"non-finite {cause} at batch {batch} (ba{batch}); stopped {when}; {where} a lower --lr or --precision fp32"
        if dist.get_global_rank() == 0 and self.results_json:
            line += self.write_diverged(line, batch, cause.split(" (")[0])
        raise NonFiniteLossError(line + ".")

    def write_diverged(self, line: str, batch: int, cause: str) -> str:
        """--results_json: a record that says the run diverged and where (no figures: none of them
        measured a run that trains); '' or why it could not be written, for the stop line."""
        record = {"diverged": line, "diverged_at_batch": batch, "diverged_on": cause, "images_per_sec": None,
                  "images_per_sec_per_device": None, "final_loss": None, "grad_norm": None,
                  **({"converged": False, "samples_to_target": None, "time_to_target_s": None} if self.has_target else {})}
        try:
            write_text(self.results_json, json.dumps(record, indent=2) + "\n")
        except OSError as error:
            return "; " + write_error(f"--results_json {self.results_json}", error)
        return f"; --results_json {self.results_json} says so"

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
