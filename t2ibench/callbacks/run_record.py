"""Record the run's settings in every checkpoint, for export.py; logs nothing."""
from __future__ import annotations

from composer.core import Callback


class RunRecord(Callback):
    """What a checkpoint's weights do not say, saved in every checkpoint for export.py: the model
    configuration and --model_name, the seed the encoders were built from (the --seed, or the one
    precompute.json recorded for random encoders), the image size, whether it trained on latents, and
    --aspect_buckets' list ("HxW" names; empty: square), which the exported pipeline lists beside it."""

    def __init__(self, settings: dict):
        self.settings = settings

    def state_dict(self) -> dict:
        return dict(self.settings)

    def load_state_dict(self, state: dict) -> None:
        pass  # a resumed run records its own settings (validated against the data like the first run's)
