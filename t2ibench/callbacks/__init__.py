"""The Composer callbacks of a benchmark run, one per module, each saying what it logs and in which units:

- `progress.ConsoleProgress`: the progress line (rank 0), no metrics;
- `throughput.Throughput`: the measured figures (`benchmark/*`: images/s, seconds, bytes, MFU), and
  `throughput.Pauses`, the time sampling takes out of the measured window;
- `loss_by_timestep.LossByTimestep`: `loss/timestep_<first>-<last>`, the loss by noise level;
- `nonfinite_loss.StopOnNonFiniteLoss`: stops at a NaN/inf loss before its checkpoint, logs nothing;
- `empty_epoch.StopOnEmptyEpoch`: stops at an epoch that trained no batch, before its checkpoint, logs nothing;
- `run_record.RunRecord`: the run's settings (model, seeds, image size) in every checkpoint, for export.py;
- `samples.SampleImages`: sample grids (`samples` images, PNG files);
- `resume_rng.RestoreRngOnStreamingResume`: the checkpoint's RNG state after a mid-epoch resume on
  streamed data (which Composer 0.32.1 leaves unrestored), logs nothing.
"""
