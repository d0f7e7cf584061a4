"""Time and cost to train Stable Diffusion 2 base (or Flux.1-schnell, MLPerf's model since v5.1), from measured throughput.

    python cost.py results/*.json --plot cost.png
    python cost.py --gpus 8 16 32 64 128 --images_per_sec 128.2 254.0 485.7 912.2 1618.4 \
        --num_gpus 8 16 32 64 128 256 --plot cost.png --csv cost.csv --markdown cost.md

Turns images/s on some GPU counts into days, GPU-hours and dollars for the whole training run, as
the 2023 MosaicML table did, and predicts the counts not measured; Flux.1 to MLPerf's target (its
reference convergence, or the samples_to_target runs measured), and a run timed to its target from its
own time_to_target_s. The arithmetic, the scaling
model and which results may be mixed are in docs/cost.md. Its parts, in t2ibench: cost_results (the
results files read), cost_scaling (the arithmetic and the scaling model), cost_table (the table and
its files); here the flags, their checks and the story the table tells.
"""
from __future__ import annotations

import argparse
import dataclasses
import os

from t2ibench.core import devices, errors
from t2ibench.core.cli import BATCH_SIZE, GPU_COUNT, POSITIVE_FLOAT, Parser
from t2ibench.costs.results import (Measurement, Targets, average_by_gpus, bucket_mix, check_consistent, describe_mix,
                                   load_results, pixel_fraction)
from t2ibench.costs.scaling import (add_precompute, cost_table, default_num_gpus, fit_scaling, mlperf_rows, model_notes,
                                   nearest_reference_batch, samples_to_target)
from t2ibench.costs.table import Row, format_table, plot, write_csv, write_markdown
from t2ibench.core.errors import fail
from t2ibench.core.files import write_error
from t2ibench.core.locations import check_output, check_outputs_apart, normalise
from t2ibench.costs.mlperf import newest_rcp_round, rcp_rounds, reference_samples_to_target, round_label
from t2ibench.costs.scale import (MLPERF_FLUX_TARGET_EVAL_LOSS,
                            MLPERF_FLUX_TRAIN_SAMPLES, PRICED_MODELS,
                            SAMPLES,  # 2023: 1.4M x 2048
                            USD_PER_GPU_HOUR)  # $2 per A100-hour

# The one-time pass of a run on precomputed latents (cost.py --precompute): latents.py encodes each
# distinct image once. Its default speed comes from the encoders' FLOPs (the family's count, per
# 512x512 image: VAE encoder 1,117 GFLOP; the text encoder's 45 only with --store_text_states) on an
# A100 (312 dense bf16 TFLOP/s, t2ibench.core.devices) at an assumed 40% MFU: 312e12 x 0.4 / 1.117e12 = 111.7
# images/s per GPU. For SDXL at 1024 (VAE encoder 4,879 GFLOP, PRICED_MODELS) the same rule gives 25.6.
# With --device, that GPU's dense bf16 peak in place of the A100's.
PRECOMPUTE_IMAGES = 2_000_000_000  # distinct images behind the 2.9B samples (about LAION-2B)
VAE_ENCODER_FLOPS = PRICED_MODELS["sd2-base"][2]
PRECOMPUTE_DEVICE = "a100-80gb"
PRECOMPUTE_PEAK_FLOPS, PRECOMPUTE_MFU = devices.get(PRECOMPUTE_DEVICE).bf16_flops_per_sec, 0.40
PRECOMPUTE_IMAGES_PER_SEC = PRECOMPUTE_PEAK_FLOPS * PRECOMPUTE_MFU / VAE_ENCODER_FLOPS  # per GPU
# Flux.1-schnell at 256x256 (families/flux.py's count): VAE encoder 272.9, CLIP-L 13.3, T5-XXL
# (256 tokens) 2,396.6 GFLOP per image; its pass encodes MLPerf's training set once. Only the VAE's
# part grows with an image's pixels (a bucketed run's mix), the text encoders' is per caption.
FLUX_VAE_ENCODER_FLOPS, FLUX_TEXT_ENCODER_FLOPS = 272.9e9, (13.3 + 2_396.6) * 1e9
FLUX_PRECOMPUTE_FLOPS = FLUX_VAE_ENCODER_FLOPS + FLUX_TEXT_ENCODER_FLOPS
FLUX_PRECOMPUTE_IMAGES_PER_SEC = PRECOMPUTE_PEAK_FLOPS * PRECOMPUTE_MFU / FLUX_PRECOMPUTE_FLOPS
# Configurations with a table of their own: (name in titles, resolution MLPerf / the 2023 table use).
NAMED_MODELS = {"sd2-base": ("SD2 base", 512), "flux1-schnell": ("Flux.1-schnell (MLPerf Training v5.1's model)", 256)}
# What --model_config may name for --gpus/--images_per_sec pairs: (name, the size they are taken at).
PAIR_MODELS = {**{config: (name, size) for config, (name, size, _) in PRICED_MODELS.items()}, **NAMED_MODELS}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        "cost.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Time and cost to train SD2 base (or SDXL base, or what the results measured) from "
                    "measured images/sec, as in the 2023 "
                    "MosaicML table. days = samples / images_per_sec / 86400; GPU-hours = "
                    "days * 24 * GPUs; cost = GPU-hours * price.",
        epilog="Prediction for unmeasured GPU counts: per-GPU images/s is fitted as ln(t) linear "
               "in log2(GPUs) by least squares over the measured counts, giving a factor per "
               "doubling (clamped to [0.5, 1]). Between measured counts t is interpolated; "
               "beyond them it starts from the nearest measurement and changes by that factor "
               "per doubling. Never better than linear scaling from the nearest smaller measured "
               "count, never slower in total than a smaller measured count. "
               "With one measured count: linear scaling. Several measurements at one count are "
               "averaged.")
    p.add_argument("files", nargs="*", metavar="RESULTS.json",
                   help="results JSON files with images_per_sec (global) and world_size (GPUs)")
    p.add_argument("--results", nargs="+", action="extend", default=[], metavar="FILE",
                   help="more results JSON files")
    p.add_argument("--gpus", nargs="+", action="extend", type=GPU_COUNT, default=[],
                   metavar="N", help="measured GPU counts, paired with --images_per_sec")
    p.add_argument("--images_per_sec", nargs="+", action="extend", type=POSITIVE_FLOAT,
                   default=[], metavar="X", help="measured global images/s, one per --gpus")
    p.add_argument("--num_gpus", nargs="+", type=GPU_COUNT, metavar="N",
                   help="GPU counts for the table (default: the measured counts plus powers of "
                        "two up to 2x the largest measured, at least to 256)")
    p.add_argument("--samples", type=POSITIVE_FLOAT, default=None,
                   help=f"images seen in the whole run (default {SAMPLES:,} = 1.4M steps x 2048 for SD2; for "
                        "Flux.1-schnell, MLPerf's reference convergence to its target at the results' global batch "
                        "(--mlperf_round's RCP file); for results timed to their target, their samples_to_target)")
    p.add_argument("--mlperf_batch", type=BATCH_SIZE, default=None, metavar="B",
                   help="Flux.1: price MLPerf's reference convergence at global batch B, one its RCP file lists "
                        "(default: the results' global batch, the nearest listed, else the smallest)")
    p.add_argument("--mlperf_round", type=str, default=None, metavar="X.Y.Z",
                   help="Flux.1: the MLPerf Training round whose reference convergence points (the RCP file of the "
                        "installed mlperf-logging) price the run to the target (default: the newest with Flux.1)")
    p.add_argument("--samples_to_target", nargs="+", action="extend", default=[], metavar="RESULTS.json",
                   help="price the samples runs took to their target: the mean samples_to_target of these results "
                        "files (benchmark.py --eval_target runs of the measured model; those not converged counted)")
    p.add_argument("--model_config", default=None, choices=sorted(PAIR_MODELS),
                   help="the model of --gpus/--images_per_sec pairs, measured at its training size ("
                        + ", ".join(f"{size} for {config}" for config, (_, size) in PAIR_MODELS.items())
                        + "); default: sd2-base, the 2023 table's. Results files of another model or size are not "
                        "fitted with the pairs")
    p.add_argument("--device", default=None, choices=devices.DEVICE_CHOICES,
                   help="the GPU the figures are for (t2ibench.core.devices' table): named in the table's caption and "
                        "title, and the latents pass timed at its dense bf16 peak (default: the results' device; the "
                        "pass at an A100's). Results measured on another GPU are refused")
    p.add_argument("--usd_per_gpu_hour", type=POSITIVE_FLOAT, default=USD_PER_GPU_HOUR,
                   help=f"price of one GPU-hour in US dollars (default {USD_PER_GPU_HOUR})")
    p.add_argument("--plot", metavar="PATH.png",
                   help="save a plot of days and cost vs GPUs; the suffix picks the format (.png, .pdf, .svg...), "
                        "none writes PATH.png")
    p.add_argument("--csv", metavar="PATH", help="also write the table as CSV")
    p.add_argument("--markdown", metavar="PATH", help="also write the table as Markdown")
    p.add_argument("--title", help="plot title (default: describes samples, price and device)")
    # A run on precomputed latents: its one-time latents.py pass, so the table's cost is the total.
    p.add_argument("--precompute", action="store_true",
                   help="add the one-time latents.py pass to every row (for --precomputed throughputs)")
    p.add_argument("--precompute_images", type=POSITIVE_FLOAT, default=None,
                   help=f"distinct images the pass encodes (default {PRECOMPUTE_IMAGES:,}; Flux: "
                        f"{MLPERF_FLUX_TRAIN_SAMPLES:,})")
    p.add_argument("--precompute_images_per_sec", type=POSITIVE_FLOAT, default=None,
                   help="images/s of the pass per GPU (latents.py's images_per_sec / world_size; default: an A100 at "
                        f"40%% MFU on the measured model's encoders, {PRECOMPUTE_IMAGES_PER_SEC:.1f} for SD2 base "
                        f"at 512 (VAE encoder, 1,117 GFLOP/image), "
                        f"{PRECOMPUTE_PEAK_FLOPS * PRECOMPUTE_MFU / PRICED_MODELS['sdxl-base'][2]:.1f} for SDXL base "
                        f"at 1024 (4,879), {FLUX_PRECOMPUTE_IMAGES_PER_SEC:.1f} for Flux (T5-XXL, CLIP and the VAE, "
                        "2,683 GFLOP/image)")
    return p


# The model the 2023 table is for: results of anything else are labeled as such.
SD2_BASE = ("sd2-base", 512)


def plot_file(path: str) -> str:
    """The file --plot writes: PATH as given when its suffix is a format matplotlib saves, PATH.png
    when it has none (what savefig does); a folder or an unknown suffix is refused, before any work."""
    if os.path.isdir(path):
        fail(f"--plot {path} is a folder; give the plot's file name, such as {os.path.join(path, 'cost.png')}")
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if not suffix:
        return path + ".png"
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    from matplotlib.backend_bases import FigureCanvasBase
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix not in formats:
        fail(f"--plot {path}: matplotlib cannot write .{suffix} files; use one of "
             + ", ".join(f".{f}" for f in sorted(formats)))
    return path


def measured_model(measurements: list[Measurement]) -> tuple[str, int]:
    """(--model_config, image size) of the measurements; what a result lacks (and --gpus /
    --images_per_sec values) is taken to be the 2023 benchmark's: SD2 base at 512x512."""
    model = next((m.model_config for m in measurements if m.model_config), SD2_BASE[0])
    return model, next((m.image_size for m in measurements if m.image_size), SD2_BASE[1])


def describe(measurements: list[Measurement]) -> tuple[str, str | None]:
    """(what was measured, a note when it is not SD2 base at 512x512 trained from images).

    The first part names the model in titles and captions: a priced model (SD2 base, SDXL base 1.0)
    by its name, anything else by its config name. SDXL base at its 1024x1024 is priced as itself,
    with a note that the sample count is the 2023 SD2 run's unless --samples says otherwise.
    """
    model = next((m.model_config for m in measurements if m.model_config), SD2_BASE[0])
    size = next((m.image_size for m in measurements if m.image_size), NAMED_MODELS.get(model, SD2_BASE)[1])
    precomputed = any(m.precomputed for m in measurements)
    name = (PRICED_MODELS[model][0] if model in PRICED_MODELS else NAMED_MODELS[model][0] if model in NAMED_MODELS
            else f"model '{model}'")
    listed = measurements[0].aspect_buckets  # one list for all (check_consistent)
    what = (f"{name} in {listed.label(size)}" if listed.bucketed else f"{name} at {size}x{size}") + (
        " from precomputed latents" if precomputed else "")
    if model == "flux1-schnell":
        return what, None if not any(m.precomputed is False for m in measurements) else (
            "these results encode images and captions in the training step (T5-XXL, CLIP, VAE); MLPerf's set-up "
            "trains from precomputed latents and text states")
    if model in PRICED_MODELS and model != SD2_BASE[0] and size == PRICED_MODELS[model][1]:
        return what, (f"the table prices {what}, trained from scratch on --samples images (by default the 2023 SD2 "
                      "run's 2.87 billion; SDXL's own schedule was not published in samples): not Stable Diffusion 2 "
                      "base")
    if (model, size) != SD2_BASE:
        return what, (f"these results are for {what}, not SD2 base at 512x512: the table is the time and cost "
                      "of training that model, not Stable Diffusion 2 base")
    if precomputed:
        return what, ("these results train from precomputed latents: encoding the images and captions "
                      "(VAE and text encoder, once per image) is not included in the table")
    return what, None


def target_phrase(targets: Targets | None, flux: bool) -> str:
    """What a run to `targets` reaches, in the caption, table, CSV and plot: MLPerf's target for Flux.1-schnell
    at MLPerf's loss alone; any other by every target the run had (a loss, FID, CLIP score)."""
    if flux and targets in (None, Targets(loss=MLPERF_FLUX_TARGET_EVAL_LOSS)):
        return f"MLPerf's target (validation loss <= {MLPERF_FLUX_TARGET_EVAL_LOSS:g})"
    return repr(targets) if targets else "the runs' target"


def timed_to_target(measurements: list[Measurement]) -> list[Measurement]:
    """The measurements with images/s replaced, where the results timed a run to its target, by the samples/s of
    MLPerf's clock (samples_to_target / time_to_target_s, evaluation included): a row at the run's GPU count
    and samples is then its time to target. Runs timed and not timed make no one curve: refused."""
    timed = [m for m in measurements if m.time_to_target_s is not None]
    if not timed:
        return measurements
    untimed = next((m for m in measurements if m.time_to_target_s is None), None)
    if untimed is not None:
        fail(f"{timed[0].source} was timed to its target (time_to_target_s, evaluation on the clock) but "
             f"{untimed.source} " + ("did not reach it" if untimed.converged is False else "was not")
             + ": their images/s are not one curve; price the runs timed to a target from their results files alone")
    try:
        check_consistent(timed, ("targets",))
    except ValueError as e:
        fail(f"{e}: runs to different targets")
    return [dataclasses.replace(m, images_per_sec=m.samples_to_target / m.time_to_target_s) for m in timed]


def convergence_runs(paths: list[str], measurements: list[Measurement]) -> list[Measurement]:
    """--samples_to_target's results files: runs to a target of the measured model at its size. Refused in one
    line: a file that is no run to a target, another model, two targets, or no run that reached it."""
    if not paths:
        return []
    runs = []
    for path in paths:
        try:
            run = load_results(path)
        except ValueError as e:
            fail(f"--samples_to_target {e}")
        if run.converged is None:
            fail(f"--samples_to_target {path}: records no 'converged': not a run to a target (benchmark.py "
                 "--eval_target writes one)")
        runs.append(run)
    for keys, why in ((("model_config", "image_size"), "the samples to a target are the measured model's"),
                      (("targets",), "runs to different targets")):
        try:
            check_consistent(measurements + runs, keys) if "model_config" in keys else check_consistent(runs, keys)
        except ValueError as e:
            fail(f"--samples_to_target: {e}: {why}")
    if not any(run.converged for run in runs):
        fail(f"--samples_to_target: none of the {len(runs)} run(s) reached its target, so none says how many samples "
             "it takes; give runs that converged, or --samples N")
    return runs


def samples_priced(parsed: argparse.Namespace, target_paths: list[str], measurements: list[Measurement], flux: bool,
                   model: str) -> tuple[float, str | None, list[str]]:
    """(the samples the table prices, what they reach or None for a fixed count, notes saying why). In order:
    --samples; --samples_to_target's runs; the results' own samples_to_target (timed to their target); for
    Flux.1-schnell MLPerf's reference convergence at --mlperf_batch or the results' batch; else the 2023 run's."""
    given = [flag for flag, value in (("--samples", parsed.samples), ("--mlperf_batch", parsed.mlperf_batch),
                                      ("--samples_to_target", parsed.samples_to_target or None)) if value is not None]
    if len(given) > 1:
        fail(f"{given[0]} and {given[1]} both set the samples the table prices; give one")
    if parsed.mlperf_batch is not None and not flux:
        fail(f"--mlperf_batch {parsed.mlperf_batch}: MLPerf's reference convergence is Flux.1-schnell's, these "
             f"results are {model}'s; give --samples N")
    round_, references = rcp_references(parsed)
    smallest = min(references)  # the reference's own global batch
    if parsed.samples is not None:
        return parsed.samples, None, [
            f"{parsed.samples:,.0f} samples (--samples): not priced to MLPerf's target, which its reference reaches in "
            f"{references[smallest]:,} at global batch {smallest} (--mlperf_batch)"] if flux else []
    runs = convergence_runs(target_paths, measurements)
    timed = [m for m in measurements if m.time_to_target_s is not None]
    if (runs or timed) and parsed.mlperf_batch is None:  # --mlperf_batch: MLPerf's figure at the runs' clock
        reached = [m for m in runs or timed]
        converged = [m for m in reached if m.converged]
        counts = [m.samples_to_target for m in converged]
        samples = sum(counts) / len(counts)
        missed = len(reached) - len(converged)
        phrase = target_phrase(converged[0].targets, flux)  # one for all: convergence_runs, timed_to_target
        source = "of --samples_to_target" if runs else "timed to it"
        note = (f"{samples:,.0f} samples to {phrase}: " + (
            f"the samples_to_target of the run {source}" if len(counts) == 1 else
            f"the mean samples_to_target of {len(counts)} runs {source} ({min(counts):,} to {max(counts):,})")
                + (f"; {missed} more did not reach it" if missed else ""))
        batches = sorted({m.global_batch_size for m in converged if m.global_batch_size})
        measured_batches = sorted({m.global_batch_size for m in measurements if m.global_batch_size})
        if runs and batches and measured_batches and batches != measured_batches:
            note += (f"; they trained at global batch {', '.join(map(str, batches))}, the images/s was measured at "
                     f"{', '.join(map(str, measured_batches))} (samples to a target grow with the batch)")
        return samples, phrase, [note]
    if not flux:
        return SAMPLES, None, []
    batch, why = parsed.mlperf_batch, "--mlperf_batch's"
    if batch is None:
        batches = sorted({m.global_batch_size for m in measurements if m.global_batch_size})
        if len(batches) > 1:
            fail(f"results at global batches {', '.join(map(str, batches))}: MLPerf's reference convergence depends "
                 "on the batch; price one batch at a time, or pick a figure with --mlperf_batch "
                 f"({', '.join(map(str, references))}) or --samples")
        if not batches:
            batch, why = smallest, "the reference's own (the results record no batch)"
        else:
            batch = nearest_reference_batch(batches[0], references)
            why = "the results' own" if batch == batches[0] else f"the one nearest the results' {batches[0]}"
    samples = samples_to_target(batch, references)
    others = ", ".join(f"{n:,} at {b}" for b, n in references.items() if b != batch)
    return samples, target_phrase(None, flux), [
        f"{samples:,} samples: MLPerf Training {round_label(round_)}'s reference convergence to its target at global "
        f"batch {batch}, {why}; --mlperf_batch picks {others}, --samples_to_target runs' own (MLCommons' RCP file "
        "in mlperf-logging: published elsewhere, not measured here)"]


def rcp_references(parsed: argparse.Namespace) -> tuple[str, dict[int, int]]:
    """(--mlperf_round or the newest round with Flux.1 RCPs, its {global batch: samples to the target});
    --mlperf_round or --mlperf_batch that the installed RCP files do not have refused in one line."""
    rounds = rcp_rounds()
    round_ = parsed.mlperf_round or newest_rcp_round()
    if round_ not in rounds:
        fail(f"--mlperf_round {round_}: the installed mlperf-logging has Flux.1 reference convergence points for "
             f"{', '.join(rounds)}; give one of them")
    references = reference_samples_to_target(round_)
    if parsed.mlperf_batch is not None and parsed.mlperf_batch not in references:
        fail(f"--mlperf_batch {parsed.mlperf_batch}: the {round_} RCPs list global batches "
             f"{', '.join(map(str, references))}; give one of them")
    return round_, references


def main(argv: list[str] | None = None) -> list[Row]:
    parsed = build_parser().parse_intermixed_args(argv)  # files may come before or after the flags
    with errors.command("cost.py"):
        return table(validate(parsed))


def validate(parsed: argparse.Namespace) -> argparse.Namespace:
    """Check the inputs (one line naming the flag or file) and read the results files. Returns the flags
    with paths normalised and defaults resolved, plus what the table derives from them (measurements,
    flux), in a new namespace: the parsed one is left as it was parsed."""
    if len(parsed.gpus) != len(parsed.images_per_sec):
        fail(f"--gpus has {len(parsed.gpus)} value(s) but --images_per_sec has "
             f"{len(parsed.images_per_sec)}; give one --images_per_sec per --gpus")
    # file:///path is the path /path (locations.normalise); inputs and outputs are local files.
    files, results = ([normalise("RESULTS", f, ()) for f in names] for names in (parsed.files, parsed.results))
    paths = {flag: normalise(f"--{flag}", getattr(parsed, flag), ()) if getattr(parsed, flag) is not None else None
             for flag in ("plot", "csv", "markdown")}
    if paths["plot"] is not None:
        paths["plot"] = plot_file(paths["plot"])
    # Every output probed before any work (the table is cheap, but a results file overwritten by
    # --csv is lost): an existing folder, writable, not a results file, and not another output.
    outputs = [(f"--{flag}", path, "file") for flag, path in paths.items()]
    targets = [normalise("--samples_to_target", f, ()) for f in parsed.samples_to_target]
    inputs = [("RESULTS", f) for f in files + results] + [("--samples_to_target", f) for f in targets]
    for flag, path, _ in outputs:
        if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            fail(f"{flag}: directory of {path} does not exist")
        problem = check_output(flag, path, folder=False, inputs=inputs)
        if problem:
            fail(problem)
    problem = check_outputs_apart(outputs)
    if problem:
        fail(problem)
    try:
        measurements = [load_results(path) for path in files + results]
        check_consistent(measurements)
    except ValueError as e:
        fail(str(e))
    configs = {m.model_config for m in measurements if m.model_config}
    if parsed.model_config and configs and configs != {parsed.model_config}:
        fail(f"--model_config {parsed.model_config}: the results files are for {sorted(configs)}")
    # Figures given as flags are taken as --model_config's model at its training size (by default the
    # 2023 table's SD2 base at 512x512), so results of another model or size are refused rather than
    # fitted with them into one curve.
    pairs_model = parsed.model_config or SD2_BASE[0]
    pairs_name, pairs_size = PAIR_MODELS[pairs_model]
    flagged = [Measurement(n, x, f"--gpus/--images_per_sec (taken as {pairs_name} at {pairs_size}x{pairs_size})",
                           model_config=pairs_model, image_size=pairs_size)
               for n, x in zip(parsed.gpus, parsed.images_per_sec)]
    try:
        check_consistent(measurements + flagged, ("image_size", "model_config"))
    except ValueError as e:  # the pairs differ in model or size: say how to name theirs
        fail(f"{e} (--model_config sets the model of --gpus/--images_per_sec: {', '.join(sorted(PAIR_MODELS))})")
    try:
        check_consistent(measurements + flagged)
    except ValueError as e:  # ...or in the buckets: the pairs are taken as square runs' figures
        fail(f"{e}; --gpus/--images_per_sec pairs are taken as square images, so price a bucketed run from its "
             "results files alone")
    measurements += flagged
    if not measurements:
        fail("no measurements: give results JSON files or --gpus N --images_per_sec X")
    device = devices.get(parsed.device) if parsed.device else None
    for m in measurements:  # an H100's figures priced as another GPU's would be a wrong table
        seen = devices.recognise(m.device) if m.device else None
        if device and seen and seen.key != device.key:
            fail(f"--device {device.key}: {m.source} was measured on {m.device}; price it without --device, or give "
                 f"figures of the {device.label}")
    peak_flops = device.bf16_flops_per_sec if device else PRECOMPUTE_PEAK_FLOPS
    flux = measured_model(measurements)[0] == "flux1-schnell"  # the first result that names its model
    model, size = measured_model(measurements)
    # A run timed to its target is priced by its clock's samples/s; the samples, by the flags, the runs or MLPerf.
    clocked = timed_to_target(measurements)
    samples, trained_to, target_notes = samples_priced(parsed, targets, measurements, flux, model)
    target_notes += [f"{m.source}: {m.samples_to_target:,} samples to {target_phrase(m.targets, flux)} in "
                     f"{m.time_to_target_s / 3600:,.2f} h on {m.num_gpus} GPU(s), {timed.images_per_sec:,.1f} "
                     f"samples/s on MLPerf's clock (evaluation included; {m.images_per_sec:,.1f} images/s training "
                     "alone): the table's images/s is the clock's"
                     for m, timed in zip(measurements, clocked) if m.time_to_target_s is not None]
    target_notes += [f"{m.source} did not reach its target ({m.targets!r}): priced from its "
                     "images/s, training alone" for m in measurements if m.converged is False and m.targets]
    # A bucketed run's images are its mix's sizes, not size x size: the VAE encoder's part of the pass
    # scales with their pixels (the default list's hold 90% to 100% of the square's).
    fraction = pixel_fraction(bucket_mix(measurements), size) if measurements[0].aspect_buckets.bucketed else None
    precompute_images_per_sec = parsed.precompute_images_per_sec
    if precompute_images_per_sec is None and flux:
        precompute_images_per_sec = peak_flops * PRECOMPUTE_MFU / (
            FLUX_VAE_ENCODER_FLOPS * (fraction or 1.0) + FLUX_TEXT_ENCODER_FLOPS)
    if precompute_images_per_sec is None:  # a priced model's VAE encoder at its size; else SD2's at 512
        priced = PRICED_MODELS.get(model)
        vae_flops = priced[2] if priced and priced[1] == size else VAE_ENCODER_FLOPS
        precompute_images_per_sec = peak_flops * PRECOMPUTE_MFU / (vae_flops * (fraction or 1.0))
    resolved = {
        "files": files, "results": results, **paths,
        "samples": samples, "trained_to": trained_to, "target_notes": target_notes, "samples_to_target": targets,
        "precompute_images": ((MLPERF_FLUX_TRAIN_SAMPLES if flux else PRECOMPUTE_IMAGES)
                              if parsed.precompute_images is None else parsed.precompute_images),
        "precompute_images_per_sec": precompute_images_per_sec,
        "measurements": clocked, "flux": flux, "device_label": device.label if device else None,
        # The mix's pixels the pass's default speed counts (None: square images, or the speed was given).
        "precompute_pixel_fraction": fraction if parsed.precompute_images_per_sec is None else None,
    }
    return argparse.Namespace(**{**vars(parsed), **resolved})


def short_count(samples: float) -> str:
    """A sample count in a title: '2.87B', '7.24M', '640'."""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if samples >= size:
            return f"{samples / size:.2f}{unit}"
    return f"{samples:,.0f}"


def table(args: argparse.Namespace) -> list[Row]:
    """Print the table of `validate`'s settings and write the files asked for."""
    measurements, flux = args.measurements, args.flux
    what, warning = describe(measurements)
    measured, notes = average_by_gpus(measurements)
    notes = args.target_notes + notes
    model = fit_scaling(measured)
    notes += model_notes(model)
    listed = measurements[0].aspect_buckets
    mix, largest_share = describe_mix(measurements, measured_model(measurements)[1]) if listed.bucketed else (None, None)
    if mix:
        notes.append(mix)
    num_gpus = args.num_gpus or default_num_gpus(measured)
    rows = cost_table(measured, num_gpus, args.samples, args.usd_per_gpu_hour)
    if args.precompute:
        rows = add_precompute(rows, args.precompute_images, args.precompute_images_per_sec, args.usd_per_gpu_hour)
        pass_hours = args.precompute_images / args.precompute_images_per_sec / 3600
        notes.append(f"includes the one-time latents.py pass: {args.precompute_images:,.0f} images at "
                     f"{args.precompute_images_per_sec:,.1f} images/s per GPU = {pass_hours:,.0f} GPU-hours "
                     f"(${pass_hours * args.usd_per_gpu_hour:,.0f})")
        if args.precompute_pixel_fraction is not None:
            notes.append(f"the pass's images/s counts the VAE encoder at the mix's {args.precompute_pixel_fraction:.1%} "
                         "of the square's pixels an image, each image encoded in its bucket")
    if flux:
        rows = rows + mlperf_rows(sorted(measured), args.samples, args.usd_per_gpu_hour)
        notes.append("MLPerf v5.1 rows: per-GPU samples/s of the published Flux.1 results times the GPU count "
                     "(MXFP8, CUDA graphs; published elsewhere, not measured here)"
                     + ("; they train square 256x256 images, these results aspect-ratio buckets" if mix else ""))

    device = args.device_label or next((m.device for m in measurements if m.device), None)
    to = f" to {args.trained_to}" if args.trained_to else ""
    caption = (f"{what}: {args.samples:,.0f} " + ("samples" if to else "images") + f"{to} at "
               f"${args.usd_per_gpu_hour:,.2f} per GPU-hour" + (f" ({device})" if device else "")
               + "; days = samples / images/s / 86400, GPU-hours = days x 24 x GPUs.")
    title = args.title or (f"Time and cost to train {what}{to}: {short_count(args.samples)} "
                           + ("samples" if to else "images") + f", ${args.usd_per_gpu_hour:,.2f}/GPU-hour"
                           + (f", {device}" if device else ""))
    # The Markdown says where its samples come from, as the terminal's first note does.
    below = "".join(f" {line[0].upper()}{line[1:]}." for line in ([args.target_notes[0]] if to else []) + [mix] if line)
    print(caption)
    if warning:
        print(f"WARNING: {warning}")
    for note in notes:
        print(f"note: {note}")
    print()
    print(format_table(rows, to_target=bool(to)))

    # Each file is replaced whole or left as it was (files.atomic_file); a full disk is one line.
    writes = [("--csv", args.csv, lambda: write_csv(rows, args.csv, repr(listed), largest_share, args.samples,
                                                    args.trained_to or "")),
              ("--markdown", args.markdown, lambda: write_markdown(rows, args.markdown, caption + below, bool(to))),
              ("--plot", args.plot, lambda: plot([r for r in rows if r.source in ("measured", "predicted")],
                                                  args.plot, title, bool(to)))]  # not the references
    for flag, path, write in writes:
        if path:
            try:
                write()
            except OSError as error:
                fail(write_error(f"{flag} {path}", error))
            print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
