"""Time and cost to train Stable Diffusion 2 base (or Flux.1-schnell, MLPerf's model since v5.1), from measured throughput.

    python cost.py results/*.json --plot cost.png
    python cost.py --gpus 8 16 32 64 128 --images_per_sec 128.2 254.0 485.7 912.2 1618.4 \
        --num_gpus 8 16 32 64 128 256 --plot cost.png --csv cost.csv --markdown cost.md

Turns images/s on some GPU counts into days, GPU-hours and dollars for the whole training run, as
the 2023 MosaicML table did, and predicts the counts not measured. The arithmetic, the scaling
model and which results may be mixed are in docs/cost.md. Its parts, in t2ibench: cost_results (the
results files read), cost_scaling (the arithmetic and the scaling model), cost_table (the table and
its files); here the flags, their checks and the story the table tells.
"""
from __future__ import annotations

import argparse
import os

from t2ibench import errors
from t2ibench.cli import GPU_COUNT, POSITIVE_FLOAT, Parser
from t2ibench.cost_results import (Measurement, average_by_gpus, bucket_mix, check_consistent, describe_mix,
                                   load_results, pixel_fraction)
from t2ibench.cost_scaling import add_precompute, cost_table, default_num_gpus, fit_scaling, mlperf_rows, model_notes
from t2ibench.cost_table import Row, format_table, plot, write_csv, write_markdown
from t2ibench.errors import fail
from t2ibench.files import write_error
from t2ibench.locations import check_output, check_outputs_apart, normalise
from t2ibench.scale import (MLPERF_FLUX_TRAIN_SAMPLES, PRICED_MODELS,
                            SAMPLES,  # 2023: 1.4M x 2048
                            USD_PER_GPU_HOUR)  # $2 per A100-hour

# The one-time pass of a run on precomputed latents (cost.py --precompute): latents.py encodes each
# distinct image once. Its default speed comes from the encoders' FLOPs (the family's count, per
# 512x512 image: VAE encoder 1,117 GFLOP; the text encoder's 45 only with --store_text_states) on an
# A100 (312 dense bf16 TFLOP/s) at an assumed 40% MFU: 312e12 x 0.4 / 1.117e12 = 111.7 images/s per GPU.
# For SDXL at 1024 (VAE encoder 4,879 GFLOP, PRICED_MODELS) the same rule gives 25.6.
PRECOMPUTE_IMAGES = 2_000_000_000  # distinct images behind the 2.9B samples (about LAION-2B)
VAE_ENCODER_FLOPS = PRICED_MODELS["sd2-base"][2]
PRECOMPUTE_PEAK_FLOPS, PRECOMPUTE_MFU = 312e12, 0.40
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
                        f"Flux {MLPERF_FLUX_TRAIN_SAMPLES:,}, one pass over MLPerf's training set)")
    p.add_argument("--model_config", default=None, choices=sorted(PAIR_MODELS),
                   help="the model of --gpus/--images_per_sec pairs, measured at its training size ("
                        + ", ".join(f"{size} for {config}" for config, (_, size) in PAIR_MODELS.items())
                        + "); default: sd2-base, the 2023 table's. Results files of another model or size are not "
                        "fitted with the pairs")
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
    inputs = [("RESULTS", f) for f in files + results]
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
    flux = measured_model(measurements)[0] == "flux1-schnell"  # the first result that names its model
    model, size = measured_model(measurements)
    # A bucketed run's images are its mix's sizes, not size x size: the VAE encoder's part of the pass
    # scales with their pixels (the default list's hold 90% to 100% of the square's).
    fraction = pixel_fraction(bucket_mix(measurements), size) if measurements[0].aspect_buckets.bucketed else None
    precompute_images_per_sec = parsed.precompute_images_per_sec
    if precompute_images_per_sec is None and flux:
        precompute_images_per_sec = PRECOMPUTE_PEAK_FLOPS * PRECOMPUTE_MFU / (
            FLUX_VAE_ENCODER_FLOPS * (fraction or 1.0) + FLUX_TEXT_ENCODER_FLOPS)
    if precompute_images_per_sec is None:  # a priced model's VAE encoder at its size; else SD2's at 512
        priced = PRICED_MODELS.get(model)
        vae_flops = priced[2] if priced and priced[1] == size else VAE_ENCODER_FLOPS
        precompute_images_per_sec = PRECOMPUTE_PEAK_FLOPS * PRECOMPUTE_MFU / (vae_flops * (fraction or 1.0))
    resolved = {
        "files": files, "results": results, **paths,
        "samples": (MLPERF_FLUX_TRAIN_SAMPLES if flux else SAMPLES) if parsed.samples is None else parsed.samples,
        "precompute_images": ((MLPERF_FLUX_TRAIN_SAMPLES if flux else PRECOMPUTE_IMAGES)
                              if parsed.precompute_images is None else parsed.precompute_images),
        "precompute_images_per_sec": precompute_images_per_sec,
        "measurements": measurements, "flux": flux,
        # The mix's pixels the pass's default speed counts (None: square images, or the speed was given).
        "precompute_pixel_fraction": fraction if parsed.precompute_images_per_sec is None else None,
    }
    return argparse.Namespace(**{**vars(parsed), **resolved})


def table(args: argparse.Namespace) -> list[Row]:
    """Print the table of `validate`'s settings and write the files asked for."""
    measurements, flux = args.measurements, args.flux
    what, warning = describe(measurements)
    measured, notes = average_by_gpus(measurements)
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
        if args.samples == MLPERF_FLUX_TRAIN_SAMPLES:
            notes.append(f"{args.samples:,.0f} samples: one pass over MLPerf's training set; a run to its quality "
                         "target takes more (pass --samples)")
        rows = rows + mlperf_rows(sorted(measured), args.samples, args.usd_per_gpu_hour)
        notes.append("MLPerf v5.1 rows: per-GPU samples/s of the published Flux.1 results times the GPU count "
                     "(MXFP8, CUDA graphs; published elsewhere, not measured here)"
                     + ("; they train square 256x256 images, these results aspect-ratio buckets" if mix else ""))

    device = next((m.device for m in measurements if m.device), None)
    caption = (f"{what}: {args.samples:,.0f} images at ${args.usd_per_gpu_hour:,.2f} per GPU-hour"
               + (f" ({device})" if device else "")
               + "; days = samples / images/s / 86400, GPU-hours = days x 24 x GPUs.")
    title = args.title or (f"Time and cost to train {what}: {args.samples / 1e9:.2f}B images, "
                           f"${args.usd_per_gpu_hour:,.2f}/GPU-hour" + (f", {device}" if device else ""))
    print(caption)
    if warning:
        print(f"WARNING: {warning}")
    for note in notes:
        print(f"note: {note}")
    print()
    print(format_table(rows))

    # Each file is replaced whole or left as it was (files.atomic_file); a full disk is one line.
    writes = [("--csv", args.csv, lambda: write_csv(rows, args.csv, repr(listed), largest_share)),
              ("--markdown", args.markdown, lambda: write_markdown(
                  rows, args.markdown, caption + (f" {mix[0].upper()}{mix[1:]}." if mix else ""))),
              ("--plot", args.plot, lambda: plot([r for r in rows if r.source in ("measured", "predicted")],
                                                  args.plot, title))]  # not the references
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
