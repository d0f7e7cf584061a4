"""Record the run's settings in every checkpoint, for export.py and for a run that resumes from it (its
data order, t2ibench.train.data_order); logs nothing."""
from __future__ import annotations

import sys
from typing import Any

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from t2ibench.train.data_order import RECORD_KEY, resume_problem, saved_order
from t2ibench.core.errors import fail


class RunRecord(Callback):
    """What a checkpoint's weights do not say, saved in every checkpoint: for export.py, the model
    configuration and --model_name, the seed the encoders were built from (the --seed, or the one
    precompute.json recorded for random encoders), the image size, whether it trained on latents, and
    --aspect_buckets' list ("HxW" names; empty: square), which the exported pipeline lists beside it;
    for a resumed run, the data order ({flag: value} of what decides the samples each step sees,
    `data_order.data_order`), compared with the resumed run's before its first batch."""

    def __init__(self, settings: dict[str, Any], data_order: dict[str, Any]):
        self.settings, self.data_order = settings, data_order
        self.loaded: dict[str, Any] | None = None  # the checkpoint's record, when the run resumes from one

    def state_dict(self) -> dict[str, Any]:
        return {**self.settings, RECORD_KEY: dict(self.data_order)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A resumed run records its own settings (validated against the data like the first run's); the
        # checkpoint's are compared at FIT_START, once Composer has loaded its timestamp (it loads the
        # callbacks' state first, while the Trainer is built).
        self.loaded = dict(state)

    def fit_start(self, state: State, logger: Logger) -> None:
        if self.loaded is None and int(state.timestamp.batch) == 0:
            return  # a new run (Composer calls load_state_dict only for a checkpoint that holds this state)
        # A resumed run without the state: a checkpoint another Composer script wrote (--load_path), or one
        # whose record was removed; Composer 0.32.1 loads it with a warning and nothing here is compared.
        saved, recorded = saved_order(self.loaded)
        problem, notes = resume_problem(saved, recorded, self.data_order, int(state.timestamp.epoch),
                                        int(state.timestamp.batch_in_epoch))
        if dist.get_world_size() > 1:
            # Every rank compares rank 0's record with its own flags, which agree but for what a node
            # resolves (a local source's real path): all stop with the first rank's line, or none goes
            # on into a collective the others left.
            problem = next((line for line in dist.all_gather_object(problem) if line), None)
        if problem:
            fail(problem)
        if dist.get_global_rank() == 0:
            for note in notes:
                print(f"note: {note}", file=sys.stderr, flush=True)
