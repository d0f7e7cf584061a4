"""Classes of bad input, one test (or a few) per class, each through the real command: `main([...])` in
this process (argparse and validation run before anything is built) or the command line where the
exit status, the time it takes or the environment matter.

The classes (README "Bad input"): numbers out of range, NaN and infinity in every numeric flag of
every command (walked from each command's own parser, so a new flag without a range fails here);
ranges that depend on the run; a check switched off by another flag; outputs that are, contain or
lie inside inputs or each other; recorded settings (checkpoint, precompute.json); one source named
twice; commands that caught nothing on a bad file; numbers that were a little off; waits.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import benchmark
import blocks
import convert
import cost
import export
from t2ibench.core import cli
from t2ibench.commands import flags
import index_scale
import latents
import learns
import sort_buckets
import step_ops
from tests.helpers import (REAL_2BA, ROOT, TINY_2BA, TINY_SYNTH, bench_script, error_of, free_port, jpeg,
                           write_images, write_latents)

COMMANDS = {"benchmark.py": benchmark, "convert.py": convert, "latents.py": latents, "export.py": export,
            "cost.py": cost, "sort_buckets.py": sort_buckets, "learns.py": learns, "index_scale.py": index_scale, "blocks.py": blocks,
            "step_ops.py": step_ops, **{f"{name}.py": bench_script(name) for name in (
                "memory", "value_check", "cpu_speed", "bench_data", "bench_ema", "check_step", "unet_flops",
                "gpu_report", "time_to_target")}}


def parser_of(module) -> argparse.ArgumentParser:
    return module.build_parser()


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_images(tmp_path_factory.mktemp("images") / "mds", 8)


# -----------------------------------------------------------------------------------------------
# Numbers: every numeric flag of every command has a range, and NaN and infinity are refused.
# -----------------------------------------------------------------------------------------------

# Flags whose values are not numbers (names, paths, URIs, lists, formats). A new flag must be added
# here, or declared with a cli.Range type, or be listed below with a bad value: the walk fails otherwise.
NOT_NUMBERS = {
    "benchmark.py": {"--remote", "--local", "--model_name", "--ema_export_dir", "--wandb_name", "--wandb_project",
                     "--model_config", "--precision", "--results_json", "--image_key", "--caption_key",
                     "--validate_hash", "--save_folder", "--load_path", "--run_name", "--sample_prompts",
                     "--samples_dir", "--eval_remote", "--eval_local", "--profile_dir", "--aspect_buckets",
                     "--fid_weights", "--clip_model", "--mlperf_log", "--mlperf_org", "--mlperf_platform",
                     "--fid_real_stats"},
    "convert.py": {"inputs", "--out", "--image_column", "--caption_column", "--aspect_buckets"},
    "sort_buckets.py": {"input", "--out", "--aspect_buckets", "--image_key", "--compression", "--hashes",
                        "--size_limit"},
    "latents.py": {"--remote", "--local", "--out", "--model_name", "--model_config", "--image_key", "--caption_key",
                   "--aspect_buckets"},
    "export.py": {"checkpoint", "--out", "--model_name"},
    "cost.py": {"files", "--results", "--plot", "--csv", "--markdown", "--title", "--samples_to_target",
                "--mlperf_round"},  # a round's name (6.1.0), checked against the installed RCP files
    "time_to_target.py": {"--out"},
    "learns.py": {"--captions", "--data", "--workdir", "--make_data", "--results_json"},
    "index_scale.py": {"--out", "--json", "--from_json", "--child", "--local"},
    "step_ops.py": {"--model_config"},
    "blocks.py": {"--compare_results_json", "--measured_json"},
    "gpu_report.py": {"--out", "--rows", "--results_root", "--model_name", "--predictions"},
    "memory.py": {"--model_config"},
    "value_check.py": {"--workdir"},
    "cpu_speed.py": {"--json", "--child", "--shards", "--cache"},
    "bench_data.py": {"--remote", "--local", "--num_workers", "--source_size", "--image_dtype"},  # lists, a size
    "bench_ema.py": {"--variants", "--json", "--_worker"},
    "check_step.py": {"--model_name", "--settings"},
    "unet_flops.py": {"--model_config"},
}
# Same-named flags that mean different things in different commands (and so have their own ranges).
DIFFERENT_MEANINGS = {
    "--samples": "cost.py: training samples of a run (a float, 3e7); value_check.py: samples written per repeat",
    "--max_batches": "bench_data.py: timed batches per setting, 0 for a whole epoch; time_to_target.py: a run's cap (>= 1)",
}
# Numbers written as strings (time strings, sizes, counts with units), checked by each command's
# validation: (command, flag, bad values, flags the check needs).
NUMBER_STRINGS = [
    ("benchmark.py", "--max_duration", ["nan", "0ba", "-3ba", "10tok"], []),
    ("benchmark.py", "--save_interval", ["inf", "0ba", "2dur"], []),
    ("benchmark.py", "--log_interval", ["nan", "0ba", "8sp"], []),
    ("benchmark.py", "--device_train_microbatch_size", ["nan", "0", "3"], []),
    ("benchmark.py", "--epoch_size", ["nan", "0", "-5", "3"], []),
    ("benchmark.py", "--synthetic_bucket_weights", ["64x64=nan", "64x64=inf", "64x64=-1", "64x64=0"],
     ["--aspect_buckets", "--model_config", "sdxl-tiny", "--image_size", "64"]),
    ("benchmark.py", "--cache_limit", ["nan", "0", "lots"], []),
    ("benchmark.py", "--ema_start", ["nan", "-1ba", "2dur", "10sp"], ["--use_ema"]),
    ("benchmark.py", "--ema_half_life", ["nan", "0ba", "3ep"], ["--use_ema"]),
    ("benchmark.py", "--eval_interval", ["nan", "0ba", "5sp"], []),
    ("benchmark.py", "--sample_interval", ["nan", "0ba", "-2ba", "5sp"], ["--sample_prompts", "shapes",
                                                                         "--samples_dir", "/tmp/unused-samples"]),
    ("benchmark.py", "--sample_size", ["nan", "infxinf", "0x32", "32x-8", "32x36", "64x64"],
     ["--sample_prompts", "shapes", "--samples_dir", "/tmp/unused-samples"]),
    ("convert.py", "--size_limit", ["nan", "0", "5gb"], []),
    ("convert.py", "--compression", ["lzma"], []),
    ("convert.py", "--hashes", ["sha999"], []),
    ("latents.py", "--size_limit", ["nan", "0"], []),
    ("latents.py", "--cache_limit", ["nan", "0", "lots"], []),
    ("latents.py", "--compression", ["lzma"], []),
    ("latents.py", "--hashes", ["sha999"], []),
]


def flags_of(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {max(a.option_strings, key=len) if a.option_strings else a.dest: a for a in parser._actions
            if a.dest != "help"}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_has_a_range_or_is_not_a_number(command):
    parser = parser_of(COMMANDS[command])
    checked_strings = {flag for c, flag, _, _ in NUMBER_STRINGS if c == command}
    for flag, action in flags_of(parser).items():
        assert action.type not in (int, float), f"{command} {flag}: declare its range with cli.Range"
        numeric = isinstance(action.type, cli.Range)
        kind_known = (numeric or action.choices is not None or action.nargs == 0 or flag in NOT_NUMBERS[command]
                      or flag in checked_strings)
        assert kind_known, f"{command} {flag}: give it a cli.Range type, or list it in NOT_NUMBERS / NUMBER_STRINGS"


def test_same_named_numeric_flags_share_one_range_everywhere():
    # One set of bounds: a flag that several commands take (--image_size, --batch_size, --microbatch,
    # --gpus, --repeats, --seed ...) is typed with the same cli.Range object in each, so no command
    # accepts what another refuses (blocks.py once took --image_size 1048576, which benchmark.py refuses).
    ranges: dict[str, dict[str, cli.Range]] = {}
    for command, module in COMMANDS.items():
        for flag, action in flags_of(parser_of(module)).items():
            if isinstance(action.type, cli.Range):
                ranges.setdefault(flag, {})[command] = action.type
    shared = {flag: by_command for flag, by_command in ranges.items() if len(by_command) > 1}
    assert {"--image_size", "--batch_size", "--microbatch", "--gpus", "--repeats", "--seed"} <= set(shared)
    for flag, by_command in shared.items():
        if flag in DIFFERENT_MEANINGS:
            continue
        kinds = {id(kind) for kind in by_command.values()}
        assert len(kinds) == 1, f"{flag}: {', '.join(f'{c} {k!r}' for c, k in by_command.items())}; use one cli range"


def out_of_range(kind: cli.Range) -> list[str]:
    """Texts the range must refuse: NaN, infinities, and just beyond each end."""
    values = ["nan", "inf", "-inf", "1e999"] if kind.kind is float else ["nan", "1.5", "x"]
    step = 1 if kind.kind is int else 1e-6
    if kind.low is not None:
        values.append(str(kind.low if kind.low_open else kind.low - step))
    if kind.high is not None:
        values.append(str(kind.high if kind.high_open else kind.high + step))
    return values


def ranged_flags() -> list[tuple[str, str, str]]:
    cases = []
    for command, module in COMMANDS.items():
        for flag, action in flags_of(parser_of(module)).items():
            if isinstance(action.type, cli.Range):
                cases += [(command, flag, value) for value in out_of_range(action.type)]
    return cases


@pytest.mark.parametrize("command, flag, value", ranged_flags())
def test_numbers_out_of_range_nan_and_inf_are_one_line(command, flag, value):
    message = error_of(COMMANDS[command].main, [f"{flag}={value}"], prog=command)
    assert f"{flag} {value} must be " in message


@pytest.mark.parametrize("command, flag, value, needs",
                         [(c, f, v, n) for c, f, values, n in NUMBER_STRINGS for v in values])
def test_numbers_written_as_strings_are_checked_too(tmp_path, command, flag, value, needs):
    argv = {"benchmark.py": TINY_2BA, "convert.py": [str(tmp_path / "in"), "--out", str(tmp_path / "out")],
            "latents.py": ["--local", str(write_images(tmp_path / "mds", 2)), "--out", str(tmp_path / "out"),
                           "--model_config", "tiny"]}[command]
    message = error_of(COMMANDS[command].main, argv + needs + [f"{flag}={value}"], prog=command)
    assert flag in message and not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, expect", [
    (["--lr_warmup_batches", "3"], "--lr_warmup_batches 3 does not end before the run"),
    (["--lr_warmup_batches", "2", "--lr_schedule", "cosine"], "--lr_warmup_batches 2 does not end"),
    (["--use_ema", "--ema_start", "3ba", "--ema_export_dir", "{tmp}/ema"], "--ema_start 3ba starts the average after"),
    (["--use_ema", "--ema_start", "1ep", "--ema_export_dir", "{tmp}/ema", "--num_synthetic_samples", "8",
      "--max_duration", "1ep"], "--ema_start 1ep starts the average after"),
    (["--loss_bins", "1001"], "--loss_bins 1001 must be an integer from 0 to 1000"),
    (["--sample_steps", "1001"], "--sample_steps 1001 must be"),
    (["--num_workers", str(cli.max_workers() + 1)], "worker processes per CPU core"),
])
def test_ranges_that_depend_on_the_run_or_the_machine(tmp_path, args, expect):
    assert expect in error_of(benchmark.main, TINY_2BA + [a.format(tmp=tmp_path) for a in args])
    assert not (tmp_path / "ema").exists()


@pytest.mark.slow
def test_values_at_the_edges_of_their_ranges_still_run(tmp_path):
    # The EMA may start at the run's last batch, the warm-up may take the whole constant-rate run.
    results = benchmark.main(TINY_2BA + ["--use_ema", "--ema_start", "2ba", "--ema_export_dir", str(tmp_path / "ema"),
                                     "--lr_warmup_batches", "2", "--loss_bins", "1000", "--offset_noise", "1"])
    assert results["measured_batches"] == 1 and (tmp_path / "ema" / "unet" / "config.json").is_file()


def test_warm_up_of_a_run_counted_in_samples_runs():
    # Composer 0.32.1 refuses a warm-up in batches with a run in samples (a traceback at the first step).
    results = benchmark.main(TINY_2BA + ["--max_duration", "8sp", "--lr_warmup_batches", "1", "--lr_schedule", "cosine"])
    assert results["measured_batches"] == 1 and results["final_loss"] is not None


# -----------------------------------------------------------------------------------------------
# A check switched off by another flag; an epoch that trains nothing.
# -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("duration", ["2ba", "1ep"])
def test_epoch_size_below_one_batch_is_refused_before_training(images, tmp_path, duration):
    message = error_of(benchmark.main, REAL_2BA + ["--remote", str(images), "--local", str(tmp_path / "cache"),
                                               "--epoch_size", "3", "--max_duration", duration])
    assert "--epoch_size 3 is less than one global batch" in message and not (tmp_path / "cache").exists()


class EmptyLoader(benchmark.Callback):
    """From outside: the training data yields nothing from the first epoch on (what a partition that
    leaves a rank short would do); the run must stop, not exit 0 with results."""

    def fit_start(self, state, logger) -> None:
        state.set_dataloader(torch.utils.data.DataLoader([], batch_size=4), "train")


@pytest.mark.parametrize("duration", ["1ep", "3ba"])
def test_an_epoch_that_trains_nothing_stops_the_run(tmp_path, duration):
    with pytest.raises(benchmark.EmptyEpochError, match="trained no batch"):
        benchmark.main(TINY_2BA + ["--max_duration", duration, "--results_json", str(tmp_path / "r.json")],
                       extra_callbacks=[EmptyLoader()])
    assert not (tmp_path / "r.json").exists()
    assert "trained no batch" in benchmark.user_error(benchmark.EmptyEpochError("epoch 0 trained no batch"))


# -----------------------------------------------------------------------------------------------
# Outputs: probed before work, never an input, never inside another output that is rewritten.
# -----------------------------------------------------------------------------------------------

def test_benchmark_outputs_apart_from_inputs_and_each_other(images, tmp_path):
    (tmp_path / "a_file").write_text("mine")
    cases = {
        ("--ema_export_dir", "is also --save_folder"): ["--use_ema", "--ema_export_dir", f"{tmp_path}/run",
                                                        "--save_folder", f"{tmp_path}/run"],
        ("--save_folder", "lies inside --ema_export_dir"): ["--use_ema", "--ema_export_dir", f"{tmp_path}/ema",
                                                            "--save_folder", f"{tmp_path}/ema/ckpt"],
        ("--samples_dir", "is a file"): ["--sample_prompts", "shapes", "--samples_dir", f"{tmp_path}/a_file"],
        ("--samples_dir", "cannot be written"): ["--sample_prompts", "shapes", "--samples_dir", "/proc/samples"],
        ("--results_json", "is the input"): ["--load_path", f"{tmp_path}/a_file", "--results_json",
                                             f"{tmp_path}/a_file"],
    }
    for (flag, expect), args in cases.items():
        message = error_of(benchmark.main, TINY_2BA + args)
        assert flag in message and expect in message, message
    message = error_of(benchmark.main, REAL_2BA + ["--remote", str(images), "--save_folder", str(images / "ckpt")])
    assert "lies inside the input (--remote" in message
    assert (tmp_path / "a_file").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_cost_outputs(tmp_path, capsys):
    results = tmp_path / "R.json"
    results.write_text(json.dumps({"images_per_sec": 10.0, "world_size": 1}))
    kept = results.read_text()
    assert "is the input" in error_of(cost.main, [str(results), "--csv", str(results)], prog="cost.py")
    assert "is also --markdown" in error_of(cost.main, [str(results), "--csv", f"{tmp_path}/t", "--markdown",
                                                       f"{tmp_path}/t"], prog="cost.py")
    assert "is a folder" in error_of(cost.main, [str(results), "--plot", str(tmp_path)], prog="cost.py")
    assert "cannot write .txt" in error_of(cost.main, [str(results), "--plot", f"{tmp_path}/p.txt"], prog="cost.py")
    assert results.read_text() == kept and sorted(p.name for p in tmp_path.iterdir()) == ["R.json"]
    cost.main([str(results), "--plot", f"{tmp_path}/plot"])  # no suffix: PNG, and the report says where
    assert f"wrote {tmp_path}/plot.png" in capsys.readouterr().out and (tmp_path / "plot.png").is_file()


def test_other_commands_probe_their_outputs(tmp_path):
    checkpoint = tmp_path / "ckpt.pt"
    torch.save({"state": {"model": {}}}, checkpoint)
    assert "cannot be written" in error_of(export.main, [str(checkpoint), "--out", "/proc/pipeline"], prog="export.py")
    assert "lies inside the input (--model_name" in error_of(
        export.main, [str(checkpoint), "--out", str(tmp_path / "pipeline"), "--model_name", str(tmp_path)],
        prog="export.py")
    assert "cannot be written" in error_of(learns.main, ["--results_json", "/proc/learns.json"], prog="learns.py")
    assert "is a file" in error_of(learns.main, ["--workdir", str(checkpoint)], prog="learns.py")
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps({"rows": {"index": [], "epoch": []}}))
    assert "is the input" in error_of(index_scale.main, ["--from_json", str(rows), "--json", str(rows)],
                                      prog="index_scale.py")
    assert json.loads(rows.read_text()) == {"rows": {"index": [], "epoch": []}}


# -----------------------------------------------------------------------------------------------
# Recorded settings: the checkpoint's, precompute.json's.
# -----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_export_follows_the_seed_recorded_in_the_checkpoint(tmp_path):
    save = tmp_path / "run"
    benchmark.main(TINY_2BA + ["--max_duration", "1ba", "--seed", "5", "--save_folder", str(save)])
    checkpoint = torch.load(save / "ep0-ba1-rank0.pt", map_location="cpu", weights_only=False)
    assert checkpoint["state"]["callbacks"]["RunRecord"]["encoders_seed"] == 5
    # As a run on precomputed latents saves it: no encoder weights in the model.
    checkpoint["state"]["model"] = {k: v for k, v in checkpoint["state"]["model"].items() if k.startswith("unet.")}
    torch.save(checkpoint, tmp_path / "latents-run.pt")
    message = error_of(export.main, [str(tmp_path / "latents-run.pt"), "--out", str(tmp_path / "x"), "--seed", "17"],
                       prog="export.py")
    assert "--seed 17" in message and "seed 5" in message and not (tmp_path / "x").exists()
    export.main([str(tmp_path / "latents-run.pt"), "--out", str(tmp_path / "pipeline")])
    from diffusers import AutoencoderKL
    from t2ibench.families import build_aside, family_of
    exported = AutoencoderKL.from_pretrained(tmp_path / "pipeline" / "vae").state_dict()
    expected = build_aside(family_of("tiny"), "tiny", None, 5).vae.state_dict()
    assert all(torch.equal(exported[k], v) for k, v in expected.items())


def foreign(checkpoint: Path, to: Path) -> Path:
    """`checkpoint` without RunRecord's state, as a checkpoint another Composer script wrote lacks it."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    del state["state"]["callbacks"]["RunRecord"]
    torch.save(state, to)
    return to


@pytest.mark.slow
def test_a_resume_from_a_checkpoint_without_its_run_record_says_what_it_cannot_compare(tmp_path, capsys):
    # Its own runs (no fixture here saves at an epoch's end and mid-epoch): epochs of 4 batches. Composer loads a
    # checkpoint without RunRecord's state with a warning; the run goes on and names what it cannot check.
    run = [*TINY_SYNTH, "--num_synthetic_samples", "8", "--batch_size", "2", "--warmup_batches", "0"]
    benchmark.main([*run, "--max_duration", "1ep", "--save_folder", str(tmp_path / "run"), "--save_interval", "1ep"])
    start = foreign(tmp_path / "run" / "ep1-ba4-rank0.pt", tmp_path / "epoch-start.pt")
    capsys.readouterr()
    # At an epoch's start the new values decide the epoch, but the seed is the checkpoint's whatever --seed says.
    benchmark.main([*run, "--seed", "9", "--load_path", str(start), "--max_duration", "5ba",
                    "--save_folder", str(tmp_path / "resumed"), "--save_interval", "1ba"])
    assert "note: the checkpoint resumed at the start of epoch 1 records no run settings (RunRecord's state: written " \
           "by another Composer script, or removed): --seed cannot be compared; the resumed run keeps the " \
           "checkpoint's values whatever they say" in capsys.readouterr().err
    # Mid-epoch, another --batch_size (refused from a recorded checkpoint): it exited 0 without a word.
    middle = foreign(tmp_path / "resumed" / "ep1-ba5-rank0.pt", tmp_path / "mid-epoch.pt")
    results = benchmark.main([*run, "--batch_size", "4", "--load_path", str(middle), "--max_duration", "6ba"])
    assert results["global_batch_size"] == 4
    assert "note: the checkpoint resumed mid-epoch records no run settings (RunRecord's state: written by another " \
           "Composer script, or removed): --use_synth_data, --precomputed, --seed, --batch_size, --aspect_buckets, " \
           "--num_synthetic_samples cannot be compared; they must be the values it was trained with, or the rest of " \
           "the epoch repeats some samples and skips others" in capsys.readouterr().err


def write_recorded_latents(out: Path, record: dict | None) -> Path:
    """Precomputed shards with `record` as their precompute.json (None: none)."""
    write_latents(out)
    if record is not None:
        (out / "precompute.json").write_text(json.dumps(record))
    return out


def test_precompute_record_is_compared_with_the_run(tmp_path):
    base = REAL_2BA + ["--precomputed", "--local", str(tmp_path / "cache")]
    tiny = {"model_config": "tiny", "image_size": 32, "model_name": None, "random_encoders": ["vae", "text_encoder"],
            "seed": 5}
    other = write_recorded_latents(tmp_path / "other", {**tiny, "image_size": 64})
    assert "--image_size 32: the latents were computed with --image_size 64" in error_of(
        benchmark.main, base + ["--remote", str(other)])
    sd2 = write_recorded_latents(tmp_path / "sd2", {**tiny, "model_config": "sd2-base"})
    assert "--model_config sd2-base" in error_of(benchmark.main, base + ["--remote", str(sd2)])
    broken = write_recorded_latents(tmp_path / "broken", None)
    (broken / "precompute.json").write_text("{half")
    assert "precompute.json is not readable" in error_of(benchmark.main, base + ["--remote", str(broken)])
    seeded = write_recorded_latents(tmp_path / "seeded", tiny)
    args = benchmark.parse_args(base + ["--remote", str(seeded), "--seed", "17"])
    assert benchmark.validate(args, 1).encoders_seed == 5  # followed: the encoders aside are the ones that made the latents
    second = write_recorded_latents(tmp_path / "seeded7", {**tiny, "seed": 7})
    message = error_of(benchmark.main, base + ["--remote", f"{seeded},{second}"])
    assert "different seeds (5 and 7" in message


# -----------------------------------------------------------------------------------------------
# Sources: one source named twice; file:// everywhere.
# -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("remote", ["{d},{d}", "{d},{d}/", "{d},file://{d}", "0.5={d},0.5={d}//", "s3://b/x,S3://b/x/"])
def test_a_source_named_twice_is_refused(images, tmp_path, remote):
    message = error_of(benchmark.main, REAL_2BA + ["--remote", remote.format(d=images), "--local", str(tmp_path / "c")])
    assert "is given" in message and "give each source once" in message


def test_file_uris_are_paths_in_every_command(tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    for i in range(2):
        (photos / f"p{i}.jpg").write_bytes(jpeg(i))
        (photos / f"p{i}.txt").write_text(f"photo {i}")
    report = convert.main([f"file://{photos}", "--out", f"file://{tmp_path}/mds", "--workers", "1", "--no_progress"])
    assert report.written == 2 and (tmp_path / "mds" / "index.json").is_file()
    assert "write file:///path" in error_of(latents.main, ["--local", f"file://host{tmp_path}/mds", "--out",
                                                           str(tmp_path / "l")], prog="latents.py")


# -----------------------------------------------------------------------------------------------
# Commands that caught nothing: bad files in one line, naming them.
# -----------------------------------------------------------------------------------------------

def test_export_on_files_that_are_not_checkpoints(tmp_path):
    torch.save(torch.zeros(3), tmp_path / "tensor.pt")
    (tmp_path / "text.pt").write_text("not a checkpoint")
    torch.save({"state": {"model": {"unet.x": torch.zeros(1)}}, "pad": torch.zeros(4096)}, tmp_path / "whole.pt")
    (tmp_path / "truncated.pt").write_bytes((tmp_path / "whole.pt").read_bytes()[:2000])
    for name, expect in (("tensor.pt", "not a Composer checkpoint"), ("text.pt", "cannot be read"),
                         ("truncated.pt", "cannot be read")):
        message = error_of(export.main, [str(tmp_path / name), "--out", str(tmp_path / "out")], prog="export.py")
        assert name in message and expect in message
    assert not (tmp_path / "out").exists()


def test_bench_scripts_on_bad_files(tmp_path):
    (tmp_path / "junk.json").write_text("{oops")
    assert "--from_json" in error_of(index_scale.main, ["--from_json", str(tmp_path / "junk.json")],
                                     prog="index_scale.py")
    (tmp_path / "mds").mkdir()
    (tmp_path / "mds" / "index.json").write_text("{oops")
    message = error_of(learns.main, ["--data", str(tmp_path / "mds"), "--workdir", str(tmp_path / "w")], prog="learns.py")
    assert "--data" in message and "JSONDecodeError" in message


# Every file flag of every command, read or written: what the user named is a regular file (or, for an output, absent)
# or it is refused in one line saying what it is, before anything opens it (locations.file_problem). A FIFO was
# opened and waited for a writer forever (@FIFO, --aspect_buckets, --results_json), /dev/zero was read without
# end, and a folder or a FIFO was "no such file". Folder flags given a FIFO say so too.
SDXL_SYNTH = ["--model_config", "sdxl-tiny", "--use_synth_data", "--max_duration", "1ba", "--image_size", "64"]
FILE_FLAGS = [
    ("benchmark.py", lambda path, tmp: [f"@{path}"], "flag file @{path}"),
    ("latents.py", lambda path, tmp: [f"@{path}"], "flag file @{path}"),
    ("benchmark.py", lambda path, tmp: [*SDXL_SYNTH, "--aspect_buckets", path], "--aspect_buckets {path}"),
    ("latents.py", lambda path, tmp: ["--model_config", "sdxl-tiny", "--image_size", "64", "--aspect_buckets", path,
                                      "--remote", str(tmp), "--out", str(tmp / "latents")], "--aspect_buckets {path}"),
    ("benchmark.py", lambda path, tmp: [*SDXL_SYNTH, "--sample_prompts", path, "--samples_dir", str(tmp / "s")],
     "--sample_prompts {path}"),
    ("benchmark.py", lambda path, tmp: [*SDXL_SYNTH, "--load_path", path], "--load_path {path}"),
    ("benchmark.py", lambda path, tmp: [*SDXL_SYNTH, "--results_json", path], "--results_json {path}"),
    ("export.py", lambda path, tmp: [path, "--out", str(tmp / "export")], "CHECKPOINT {path}"),
    ("cost.py", lambda path, tmp: [path], "{path}"),
    ("cost.py", lambda path, tmp: ["--gpus", "8", "--images_per_sec", "100", "--csv", path], "--csv {path}"),
    ("convert.py", lambda path, tmp: [path, "--out", str(tmp / "mds")], "input {path}"),
    ("blocks.py", lambda path, tmp: ["--measured_json", path], "--measured_json {path}"),
    ("blocks.py", lambda path, tmp: ["--compare_results_json", path], "--compare_results_json {path}"),
    ("index_scale.py", lambda path, tmp: ["--from_json", path], "--from_json {path}"),
    ("index_scale.py", lambda path, tmp: ["--json", path], "--json {path}"),
    ("learns.py", lambda path, tmp: ["--results_json", path], "--results_json {path}"),
    ("cpu_speed.py", lambda path, tmp: ["--json", path], "--json {path}"),
    ("bench_ema.py", lambda path, tmp: ["--json", path], "--json {path}"),
]


@pytest.mark.parametrize("command, argv, named", FILE_FLAGS, ids=[f"{c}-{named.split()[0]}" for c, _, named in FILE_FLAGS])
def test_every_file_flag_takes_a_regular_file_or_says_what_it_was_given(tmp_path, command, argv, named):
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "folder").mkdir()
    for given, kind in ((tmp_path / "pipe", "a FIFO (named pipe)"), ("/dev/zero", "a character device"),
                        (tmp_path / "folder", "a folder")):
        message = error_of(COMMANDS[command].main, argv(str(given), tmp_path), prog=command)
        if kind == "a folder" and command == "convert.py":
            continue  # a folder is what convert.py reads images from
        assert f"{named.format(path=given)} is {kind}" in message, message
        assert "no such file" not in message


def test_folder_flags_given_a_fifo_say_so(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    message = error_of(benchmark.main, [*TINY_2BA, "--save_folder", str(tmp_path / "pipe")])
    assert f"--save_folder {tmp_path / 'pipe'} is a FIFO (named pipe), not a folder" in message
    message = error_of(convert.main, [str(tmp_path), "--out", str(tmp_path / "pipe")], prog="convert.py")
    assert f"--out {tmp_path / 'pipe'} is a FIFO (named pipe), not a folder" in message


# A file a user names is read by cli.read_text in every command: at most MAX_TEXT_FILE_BYTES, past a
# byte-order mark. Each command's flag file, with a number its range refuses (read past the mark, the
# flag is named; unskipped, '\ufeff--seed' was no flag).
@pytest.mark.parametrize("command, flag", [("benchmark.py", "--seed"), ("latents.py", "--seed"), ("export.py", "--seed"),
                                           ("convert.py", "--quality"), ("cost.py", "--gpus")])
def test_every_commands_flag_file_is_read_bounded_and_past_a_byte_order_mark(tmp_path, command, flag):
    message = error_of(COMMANDS[command].main, ["@/dev/zero"], prog=command)  # was read until killed
    assert "flag file @/dev/zero is a character device, not a regular file" in message
    (tmp_path / "large.args").write_bytes(b"#" * (cli.MAX_TEXT_FILE_BYTES + 1))
    message = error_of(COMMANDS[command].main, [f"@{tmp_path}/large.args"], prog=command)
    assert f"flag file @{tmp_path}/large.args holds more than {cli.MAX_TEXT_FILE_BYTES:,} bytes" in message
    (tmp_path / "flags.args").write_bytes(f"\ufeff{flag} -1\n".encode())
    message = error_of(COMMANDS[command].main, [f"@{tmp_path}/flags.args"], prog=command)
    assert f"{flag} -1 must be " in message, message


@pytest.mark.parametrize("content, expect", [
    (b"\0" * (2**20 + 1), "holds more than 1,048,576 bytes"),
    (b"[" * 100_000, "JSON nested too deeply"),  # a RecursionError traceback
    (b'{"images_per_sec": 10.0, "world_size": 1, "bucket_list": ["\xc2\xb2x64"], "aspect_buckets": "b.txt"}',
     "'bucket_list' must be a list of \"HxW\" buckets"),  # a Unicode digit, refused by parse_bucket
    (b'{"images_per_sec": 10.0, "world_size": 1, "bucket_list": ["8x99999992"], "aspect_buckets": "b.txt"}',
     "'bucket_list' must be a list of \"HxW\" buckets"),  # beyond --image_size's bound
])
def test_cost_reads_results_files_bounded_and_sizes_in_ascii(tmp_path, content, expect):
    (tmp_path / "R.json").write_bytes(content)
    assert expect in error_of(cost.main, [str(tmp_path / "R.json")], prog="cost.py")
    (tmp_path / "R.json").write_bytes(b"\xef\xbb\xbf" + json.dumps({"images_per_sec": 10.0, "world_size": 1}).encode())
    assert [row.num_gpus for row in cost.main([str(tmp_path / "R.json"), "--num_gpus", "1"])] == [1]  # a BOM: read


@pytest.mark.parametrize("damage", ["truncated", "corrupted"])
def test_a_damaged_local_shard_is_named_before_training(tmp_path, damage):
    local = write_images(tmp_path / "mds", 8, compression="zstd")
    shard = next(local.glob("shard.*.zstd"))
    content = bytearray(shard.read_bytes())
    if damage == "truncated":
        shard.write_bytes(bytes(content[: len(content) // 2]))
        message = error_of(benchmark.main, REAL_2BA + ["--local", str(local)])
        assert shard.name in message and "truncated" in message
    else:  # same size, other bytes: only a hash tells; --validate_hash now checks local files too
        content[100:140] = bytes(40)
        shard.write_bytes(bytes(content))
        message = error_of(benchmark.main, REAL_2BA + ["--local", str(local), "--validate_hash", "xxh64"])
        assert shard.name in message and "--validate_hash xxh64" in message


def test_a_shard_that_fails_while_training_is_named_in_one_line(tmp_path):
    local = write_images(tmp_path / "mds", 8, compression="zstd")
    shard = next(local.glob("shard.*.zstd"))
    content = bytearray(shard.read_bytes())
    content[20:60] = bytes(b ^ 0xFF for b in content[20:60])  # same size: passes the pre-check
    shard.write_bytes(bytes(content))
    message = error_of(benchmark.cli, REAL_2BA + ["--local", str(local)])  # the command line's own error handling
    assert shard.name in message and "truncated or corrupted" in message


@pytest.mark.slow
def test_unwritable_home_still_builds_the_tokenizer(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XDG_CACHE_HOME"}
    result = subprocess.run([sys.executable, "-c", "from t2ibench.core.tokenizer import bundled_tokenizer, tokenize; "
                             "print(tokenize(bundled_tokenizer(), ['a red square'])[0, :4].tolist())"],
                            cwd=ROOT, env={**env, "HOME": "/proc/no-home", "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])[0] == 49406  # the start token, then the caption


# -----------------------------------------------------------------------------------------------
# Numbers that were a little off.
# -----------------------------------------------------------------------------------------------

def test_loss_bin_labels_are_the_timesteps_each_bin_holds():
    results = benchmark.main(TINY_2BA + ["--max_duration", "1ba", "--loss_bins", "3"])
    labels = [tuple(b["timesteps"]) for b in results["loss_by_timestep_bin"]]
    timesteps = torch.arange(1000)
    bins = (timesteps * 3) // 1000  # what the model does with each timestep
    assert labels == [(int(timesteps[bins == i].min()), int(timesteps[bins == i].max())) for i in range(3)]


def test_cost_does_not_fit_another_model_with_the_2023_figures(tmp_path):
    tiny = tmp_path / "tiny.json"
    tiny.write_text(json.dumps({"images_per_sec": 40.0, "world_size": 1, "model_config": "tiny", "image_size": 64,
                                "device": "cpu"}))
    message = error_of(cost.main, [str(tiny), "--gpus", "8", "--images_per_sec", "128.2"], prog="cost.py")
    assert "taken as SD2 base at 512x512" in message and str(tiny) in message


# -----------------------------------------------------------------------------------------------
# Waits: an unreachable hub; sampling many prompts.
# -----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_unreachable_hub_without_hf_hub_offline_fails_in_one_line(images, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(PYTHONPATH=str(ROOT), HF_ENDPOINT=f"http://127.0.0.1:{free_port()}", HF_HOME=str(tmp_path / "hf"))
    argv = ["--model_config", "sd2-base", "--batch_size", "4", "--image_size", "64", "--max_duration", "1ba",
            "--num_workers", "0", "--remote", str(images), "--local", str(tmp_path / "cache")]
    result = subprocess.run([sys.executable, str(ROOT / "benchmark.py"), *argv], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 1 and "Retrying" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "the hub could not be reached" in last and "--allow_random_encoders" in last


class UNetBatches(benchmark.Callback):
    """From outside: the batch size of every UNet call (training and sampling)."""

    def __init__(self):
        self.sizes: list[int] = []

    def fit_start(self, state, logger) -> None:
        state.model.unet.register_forward_pre_hook(lambda module, args: self.sizes.append(args[0].shape[0]))


def test_samples_go_through_the_unet_no_more_than_a_microbatch_at_a_time(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"a red square number {i}" for i in range(7)))
    seen = UNetBatches()
    benchmark.main(TINY_2BA + ["--max_duration", "1ba", "--device_train_microbatch_size", "2", "--sample_prompts",
                           str(prompts), "--samples_dir", str(tmp_path / "samples"), "--sample_steps", "2",
                           "--guidance_scale", "3"], extra_callbacks=[seen])
    assert max(seen.sizes) == 2 and len(seen.sizes) > 2 + 2  # 2 training microbatches, then sampling
    assert (tmp_path / "samples" / "1.png").is_file()
