"""bench/blocks.py's harness: what benchmark.py runs around the model (Composer's Trainer, the run's own
loader, the throughput callback), timed per step with a model of one parameter, and the benchmark.py
settings of a one-device run of the prediction's set-up, which also set the process up as the run's
runtime does.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch

from t2ibench.commands import checks


def run_settings(args: argparse.Namespace, per_device_batch: int) -> tuple[argparse.Namespace, Any]:
    """benchmark.py's flags and settings for a one-device run of this prediction's set-up and batch (what
    the harness runs, and what sets the process up as benchmark.py's runtime does). Only what the
    loader and the runtime read is resolved: benchmark.py's full validation would refuse flux1-schnell
    on one GPU, and no model is built from them."""
    import benchmark

    warmup = min(3, args.harness_batches - 1)
    argv = ["--model_config", args.model_config, "--use_synth_data", "--batch_size", str(per_device_batch),
            "--image_size", str(args.image_size), "--device_train_microbatch_size", str(args.microbatch),
            "--num_workers", str(args.num_workers), "--precision", args.precision, "--seed", str(args.seed),
            "--max_duration", f"{args.harness_batches}ba", "--warmup_batches", str(warmup),
            "--weight_casts", args.setups[args.gpus[0]].weight_casts, "--norm_precision", args.norm_precision]
    if args.precomputed:
        argv += ["--precomputed", "--precomputed_format", args.text_format]
    run_args = benchmark.parse_args(argv)
    return run_args, checks.resolve(run_args)


def harness_seconds_per_step(args: argparse.Namespace, per_device_batch: int) -> float:
    """Seconds per step of what benchmark.py runs around the model: Composer's Trainer (events,
    microbatch split, batch to device, AdamW on one parameter), the run's own loader (synthetic data of
    the run's format, --num_workers) and the throughput callback, timed over --harness_batches with a
    model of one parameter."""
    import benchmark
    from composer import Trainer
    from composer.models import ComposerModel

    from t2ibench.callbacks.throughput import Pauses, Throughput
    from t2ibench.commands.runtime import Runtime

    class OneParameter(ComposerModel):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(()))

        def forward(self, batch: dict) -> torch.Tensor:
            return self.weight * 1.0

        def loss(self, outputs: torch.Tensor, batch: dict) -> torch.Tensor:
            return outputs

    run_args, settings = run_settings(args, per_device_batch)
    run = Runtime.start(settings)
    loader = benchmark.build_data(settings, run).loader
    model = OneParameter()
    throughput = Throughput(run_args.warmup_batches, 0.0, None, Pauses(), 0.0)
    trainer = Trainer(model=model, train_dataloader=loader, optimizers=torch.optim.AdamW(model.parameters()),
                      max_duration=run_args.max_duration, device_train_microbatch_size=args.microbatch,
                      callbacks=[throughput], precision=run.trainer_precision, progress_bar=False,
                      log_to_console=False, seed=args.seed)
    trainer.fit()
    summary = throughput.summary
    trainer.close()
    return summary["measured_seconds"] / summary["measured_batches"]
