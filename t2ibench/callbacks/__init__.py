"""The Composer callbacks of a benchmark run, one per module, each saying what it logs and in which units:

- `progress.ConsoleProgress`: the progress line (rank 0), no metrics;
- `throughput.Throughput`: the measured figures (`benchmark/*`: images/s, seconds, bytes, MFU), and
  `throughput.Pauses`, the time sampling takes out of the measured window;
- `loss_by_timestep.LossByTimestep`: `loss/timestep_<first>-<last>`, the loss by noise level;
- `nonfinite_loss.StopOnNonFiniteLoss`: stops at a NaN/inf loss before its checkpoint, logs nothing;
- `samples.SampleImages`: sample grids (`samples` images, PNG files).
"""
