"""The summary benchmark.py prints at the end of a run, from its results (what --results_json holds):
the set-up, throughput, MFU, data wait, checkpoints, memory, loss, gradient norm, validation loss and
time to target, float8 (`--fp8`) and the profile (`--profile_batches`)."""
from __future__ import annotations

from t2ibench.train import fp8
from t2ibench.train.allocator import AllocatorSetting
from t2ibench.callbacks.profile import format_profile
from t2ibench.callbacks.validation import describe as describe_validation


def print_summary(r: dict) -> None:
    if r.get("already_complete"):
        print("\n=== Stable Diffusion benchmark ===\n"
              f"model {r['model_config']} at {r['image_size']}x{r['image_size']}: the run was already complete "
              f"({r['trained_batches']} batches, checkpoint in {r['save_folder']}); nothing trained or measured "
              "in this run (its figures are those of the run that trained)\n", flush=True)
        return

    def percent(value: float | None) -> str:
        return f"{100 * value:.1f}%" if value is not None else "n/a"

    wait, wait_mean = percent(r["data_wait_fraction"]), percent(r["data_wait_fraction_mean"])
    # Which rule chose checkpointing: the flag, or auto with its figures (results before it: none).
    checkpointing_why = f" ({r['activation_checkpointing_reason']})" if r.get("activation_checkpointing_reason") else ""
    after = f"{r['seconds_after_window']:.1f} s" if r.get("seconds_after_window") is not None else "n/a"
    reserved = (f", {r['peak_memory_reserved_bytes'] / 2**30:.2f} GiB reserved"
                if r.get("peak_memory_reserved_bytes") else "")
    since = " after warm-up" if r["peak_memory_kind"].startswith("cuda") else ", whole run"
    grad_norm = f"{r['grad_norm']:.6g}" if r.get("grad_norm") is not None else "n/a"
    mfu = (f"{100 * r['mfu']:.1f}% of {r['peak_flops_per_device'] / 1e12:.0f} TFLOP/s peak per device" if r.get("mfu")
           else "n/a (unknown device peak; pass --peak_tflops)")
    # A bucketed run's FLOPs per image: the mean over the images of the window, bucket by bucket.
    buckets = r.get("flops_per_image_by_bucket")
    mean = (f" (the mean over the window's images, each at its bucket's: {len(buckets)} buckets of "
            f"{min(buckets.values()) / 1e9:.1f} to {max(buckets.values()) / 1e9:.1f})" if buckets else "")
    trained = (f"; trained network alone (denoiser forward + backward, "
               f"{r['flops_per_image_trained_network'] / 1e9:.1f} GFLOP/image): {100 * r['mfu_trained_network']:.1f}%"
               if r.get("mfu_trained_network") else "")
    compiled = ""
    if r["compile"]:  # t2ibench.train.compiling: seconds None where torch keeps no compile timers
        spent = f"{r['compile_seconds']:.1f} s" if r["compile_seconds"] is not None else "unknown seconds"
        inside = r["compile_seconds_in_window"]
        # `inside` is the most any rank compiled in each measured batch, summed (it can exceed rank 0's own).
        compiled = (f"compile      {r['compiled_graphs']} graphs in {spent} on rank 0, before the measured window"
                    + (f"; {inside:.1f} s of compiling on the ranks inside it, left out of it" if inside else "")
                    + "\n")
    hits = r.get("recompile_limit_hits") or []  # results before it: none
    if hits:  # dynamo ran those functions eagerly from then on, for every shape they had no graph for
        compiled += (f"compile      WARNING: {len(hits)} compiled functions reached dynamo's recompile limit and ran "
                     f"eagerly for new shapes from then on ({'; '.join(hits[:3])}{'; ...' if len(hits) > 3 else ''}): "
                     "the figures above are partly eager\n")
    print(
        "\n=== Stable Diffusion benchmark ===\n"
        f"model {r['model_config']} at {r['image_size']}x{r['image_size']}, {r['precision']}, "
        f"{r['world_size']} x {r['device']}, global batch {r['global_batch_size']}, "
        f"microbatch {r['device_train_microbatch_size']}\n"
        f"set-up       weight casts per {r['weight_casts']}, activation checkpointing "
        f"{'on' if r['activation_checkpointing'] else 'off'}{checkpointing_why}, "
        f"compile {'on' if r['compile'] else 'off'}, fused AdamW "
        f"{'on' if r['fused_adamw'] else 'off'}, norms {r['norm_precision'] or 'fp32'}"
        f"{', fp8 ' + r['fp8'] if r.get('fp8', 'off') != 'off' else ''}"
        f"{', channels-last' if r['channels_last'] else ''}{', xFormers' if r['xformers'] else ''}"
        f"{cpu_threads(r)}{allocator(r)}\n"
        f"throughput   {r['images_per_sec']:.2f} images/s ({r['images_per_sec_per_device']:.2f} per device) "
        f"over {r['measured_batches']} batches after {r['warmup_batches']} warm-up\n"
        f"MFU          {mfu} at {r['flops_per_image'] / 1e9:.1f} GFLOP/image{mean}{trained}\n"
        f"{compiled}"
        f"data wait    {wait} of measured time in the loader's next() (max over ranks; mean {wait_mean})\n"
        f"checkpoints  {r['checkpoint_seconds_in_window']:.1f} s saving inside the measured "
        f"{r['measured_seconds']:.1f} s, {r['checkpoint_seconds_after_window']:.1f} s after it; "
        f"{after} from the last batch to the end of fit\n"
        f"peak memory  {r['peak_memory_bytes'] / 2**30:.2f} GiB ({r['peak_memory_kind']}){reserved}{since}\n"
        f"final loss   {r['final_loss']}\n"
        f"grad norm    {grad_norm} (the last step's gradients, global L2 norm before clipping)\n"
        + (f"float8       {fp8.describe(r['fp8_conversion'])}; "
           f"{r['flops_per_image_breakdown']['fp8_fwd_bwd'] / r['flops_per_image']:.0%} of the step's FLOPs\n"
           if r.get("fp8_conversion") else "")
        + describe_validation(r)
        + format_profile(r),
        flush=True,
    )


def cpu_threads(r: dict) -> str:
    """The set-up line's words on a CPU run's intra-op threads (t2ibench.train.cpu_threads); results written
    before they were recorded have none."""
    return f", CPU threads {r['cpu_threads']} ({r['cpu_threads_rule']})" if r.get("cpu_threads") else ""


def allocator(r: dict) -> str:
    """The set-up line's words on a GPU run's CUDA allocator setting (t2ibench.train.allocator); CPU runs and
    results written before it was recorded have none."""
    if r.get("cuda_allocator_conf") is None:
        return ""
    return f", allocator {AllocatorSetting(r['cuda_allocator_conf'], r['cuda_allocator_conf_source']).describe()}"
