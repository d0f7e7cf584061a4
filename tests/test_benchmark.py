"""The benchmark end to end on CPU: model shapes, the CLI, a two-rank launch, learning, the tokenizer."""
from __future__ import annotations

import json
import re
import sys

import pytest
import torch
from composer.core import Callback

from t2ibench.train import cpu_threads
from t2ibench.callbacks.resume_threads import saved_count
from t2ibench.families import MODEL_CONFIGS
from t2ibench.train.model import DiffusionModel, count_parameters
from t2ibench.core.tokenizer import MAX_LENGTH, bundled_tokenizer, tokenize
from tests import preloaded
from tests.helpers import ROOT, TINY_2BA, TINY_SYNTH, composer_launcher, error_of, offline_env, run_cli

SD2 = MODEL_CONFIGS["sd2-base"]

TINY_RUN = [*TINY_SYNTH, "--max_duration", "4ba", "--warmup_batches", "1"]


def test_sd2_base_parameter_counts():
    parts = SD2.meta_parts("sd2-base")
    unet, vae, text_encoder = parts.denoiser, parts.vae, parts.text_encoder
    assert round(count_parameters(unet) / 1e6, 1) == 865.9
    assert round(count_parameters(vae) / 1e6, 1) == 83.7
    assert round(count_parameters(text_encoder) / 1e6) == 340
    assert next(unet.parameters()).device.type == "meta"


def test_tokenizer_offline_77_ids_with_start_and_end():
    tok = bundled_tokenizer()
    ids = tokenize(tok, ["a photo of an astronaut riding a horse", "x " * 200])
    assert ids.shape == (2, MAX_LENGTH) and ids.dtype == torch.long
    start, end = tok.bos_token_id, tok.eos_token_id
    assert (start, end) == (49406, 49407)
    # The well-known CLIP ids of these words: the vocabulary is CLIP's, not a look-alike.
    assert ids[0, :9].tolist() == [start, 320, 1125, 539, 550, 18376, 6765, 320, 4558]
    assert ids[0, 9] == end and (ids[0, 10:] == tok.pad_token_id).all()
    assert ids[1, 0] == start and ids[1, -1] == end  # truncated, still ends with the end token


@pytest.mark.parametrize("use_ema", [False, True])
@pytest.mark.slow
def test_tiny_synthetic_run_writes_results(tmp_path, use_ema):
    out = tmp_path / "results.json"
    result = run_cli(TINY_RUN + ["--results_json", str(out)] + (["--use_ema"] if use_ema else []))
    assert result.returncode == 0, result.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["images_per_sec"] > 0 and r["images_per_sec_per_device"] == r["images_per_sec"]
    assert r["world_size"] == 1 and r["device"] == "cpu" and r["precision"] == "fp32"
    assert (r["image_size"], r["global_batch_size"], r["device_train_microbatch_size"]) == (32, 4, 4)
    assert r["model_config"] == "tiny" and r["use_ema"] is use_ema
    assert r["measured_batches"] == 3 and r["flops_per_image"] > 0
    assert "throughput" in result.stdout and "images/s" in result.stdout


def test_the_cpu_thread_rule_is_the_machines_cores_per_rank_less_loader_workers():
    assert cpu_threads.rule_threads(cores=2, ranks_on_node=1, num_workers=0) == 2
    assert cpu_threads.rule_threads(cores=16, ranks_on_node=2, num_workers=3) == 5
    assert cpu_threads.rule_threads(cores=2, ranks_on_node=2, num_workers=0) == 1
    assert cpu_threads.rule_threads(cores=4, ranks_on_node=1, num_workers=8) == 1  # never below one
    idle, quiet = cpu_threads.by_rule(cores=16, busy=0, ranks_on_node=2, num_workers=3)
    assert idle == cpu_threads.CpuThreads(5, "16 cores / 2 ranks, 3 loader workers") and quiet is None
    # A busy machine: the same count, and a warning line that says what takes fewer.
    busy, warning = cpu_threads.by_rule(cores=16, busy=12, ranks_on_node=2, num_workers=3)
    assert busy == idle
    assert "\n" not in warning and "12 of this machine's 16 cores" in warning and "--cpu_threads N" in warning
    # The cores the rule leaves over (17 // 2 ranks) may be busy without a word.
    assert cpu_threads.by_rule(cores=17, busy=1, ranks_on_node=2, num_workers=3) == (
        cpu_threads.CpuThreads(5, "17 cores / 2 ranks, 3 loader workers"), None)


@pytest.mark.slow
def test_cpu_threads_follow_the_rule_the_flag_or_the_users_count(tmp_path, monkeypatch, capsys):
    import benchmark

    def setup_line() -> str:
        return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("set-up"))

    for variable in cpu_threads.USER_THREADS_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    before = torch.get_num_threads()
    cores = cpu_threads.usable_cores()
    try:
        r = benchmark.main([*TINY_2BA, "--num_workers", "1"])
        assert r["cpu_threads_rule"] == f"{cores} cores, 1 loader workers"
        assert r["cpu_threads"] == max(1, cores - 1) == torch.get_num_threads()
        assert f"CPU threads {r['cpu_threads']} ({r['cpu_threads_rule']})" in setup_line()
        # A count the caller set in-process is theirs.
        mine = max(r["cpu_threads"], cpu_threads.THREADS_AT_IMPORT) + 1
        torch.set_num_threads(mine)
        r = benchmark.main(TINY_2BA)
        assert (r["cpu_threads"], torch.get_num_threads()) == (mine, mine)
        assert f"CPU threads {mine} (torch.set_num_threads before the run, the user's)" in setup_line()
        # The flag wins over a count set otherwise.
        r = benchmark.main([*TINY_2BA, "--cpu_threads", "1"])
        assert (r["cpu_threads"], r["cpu_threads_rule"], torch.get_num_threads()) == (1, "--cpu_threads 1, the user's", 1)
    finally:
        torch.set_num_threads(before)
    # OMP_NUM_THREADS is the user's too, in a process of its own as a user starts it.
    out = tmp_path / "results.json"
    result = run_cli([*TINY_2BA, "--num_workers", "1", "--results_json", str(out)], env=offline_env(OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    r = json.loads(out.read_text())
    assert (r["cpu_threads"], r["cpu_threads_rule"]) == (1, "OMP_NUM_THREADS=1, the user's")
    assert "CPU threads 1 (OMP_NUM_THREADS=1, the user's)" in result.stdout


@pytest.mark.parametrize("value, command", [("abc", True), ("0", False), ("", False)])
@pytest.mark.slow
def test_a_thread_variable_that_is_no_count_is_ignored_in_one_warning(tmp_path, monkeypatch, capsys, value, command):
    # libgomp and torch ignore such a value and take every core: it is no count of the user's, and the
    # run takes the machine's rule, saying why. "abc" as a user starts the command; "0" (digits, not
    # positive) and "" (set, empty) in this process.
    import benchmark

    for variable in cpu_threads.USER_THREADS_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    if command:
        out = tmp_path / "results.json"
        result = run_cli([*TINY_2BA, "--results_json", str(out)], env=offline_env(OMP_NUM_THREADS=value))
        assert result.returncode == 0, result.stderr[-3000:]
        r, err = json.loads(out.read_text()), result.stderr
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", value)
        before = torch.get_num_threads()
        try:
            r = benchmark.main(TINY_2BA)
        finally:
            torch.set_num_threads(before)
        err = capsys.readouterr().err
    assert r["cpu_threads_rule"] == f"{cpu_threads.usable_cores()} cores, 0 loader workers", r["cpu_threads_rule"]
    warnings = [line for line in err.splitlines() if line.startswith("warning: OMP_NUM_THREADS")]
    assert warnings == [f"warning: OMP_NUM_THREADS={value!r} is no thread count (a positive whole number): torch "
                        "ignores it, and so does this run, which takes the machine's rule unless another count is "
                        "set; set a count or unset it"], err


@pytest.mark.parametrize("value", ["0", "-1", "abc", "1.5", "100000"])
def test_a_bad_cpu_thread_count_is_refused_in_one_line(value):
    import benchmark

    assert "--cpu_threads" in error_of(benchmark.main, [*TINY_2BA, "--cpu_threads", value])


@pytest.mark.slow
def test_a_resumed_cpu_run_takes_the_thread_count_of_the_run_it_resumes(tmp_path, monkeypatch, capsys):
    import benchmark

    for variable in cpu_threads.USER_THREADS_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    cores = cpu_threads.usable_cores()
    if cores < 2:
        pytest.skip("needs two cores for two different counts")
    before = torch.get_num_threads()
    seen: list[int] = []

    class RecordThreads(Callback):  # the count the steps compute with, after the checkpoint's load
        def batch_start(self, state, logger) -> None:
            seen.append(torch.get_num_threads())

    flags = [*TINY_SYNTH, "--warmup_batches", "0", "--save_folder", str(tmp_path / "run"), "--save_interval", "1ba",
             "--run_name", "threads", "--autoresume"]
    try:
        first = benchmark.main([*flags, "--max_duration", "1ba", "--cpu_threads", "1"], extra_callbacks=[RecordThreads()])
        assert (first["cpu_threads"], seen) == (1, [1])
        # Resumed where the rule takes every core: the saved count, without a word.
        capsys.readouterr()
        resumed = benchmark.main([*flags, "--max_duration", "2ba"], extra_callbacks=[RecordThreads()])
        assert (resumed["cpu_threads"], seen) == (1, [1, 1])
        assert resumed["cpu_threads_rule"] == "as the run it resumes: --cpu_threads 1, the user's"
        assert "asks for" not in capsys.readouterr().err
        # Resumed with the flag asking for another count: the saved count, and one warning line.
        again = benchmark.main([*flags, "--max_duration", "3ba", "--cpu_threads", "2"], extra_callbacks=[RecordThreads()])
        assert (again["cpu_threads"], seen) == (1, [1, 1, 1])
        assert again["cpu_threads_rule"] == resumed["cpu_threads_rule"]  # not prefixed twice
        warned = [line for line in capsys.readouterr().err.splitlines() if "--cpu_threads 2 asks for 2" in line]
        assert len(warned) == 1 and "computes with 1" in warned[0], warned
        # A fresh run takes the rule's count.
        fresh = benchmark.main([*TINY_2BA], extra_callbacks=[RecordThreads()])
        assert fresh["cpu_threads"] == cores == seen[-1]
    finally:
        torch.set_num_threads(before)


def test_each_rank_resumes_with_its_own_saved_count_on_this_machine(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    by_rank = [[1, "2 cores, 0 loader workers"], [2, "--cpu_threads 2, the user's"]]
    state = {"threads": 1, "rule": by_rank[0][1], "by_rank": by_rank}
    assert saved_count(state, rank=1, world_size=2) == cpu_threads.CpuThreads(2, by_rank[1][1])
    assert saved_count(state, rank=0, world_size=2) == cpu_threads.CpuThreads(1, by_rank[0][1])
    assert saved_count(state, rank=0, world_size=4) is None  # another number of ranks: its own rule
    assert saved_count({"threads": 3, "rule": "r"}, rank=1, world_size=2) == cpu_threads.CpuThreads(3, "r")  # older
    assert saved_count({}, rank=0, world_size=1) is None  # a GPU run's
    current = cpu_threads.CpuThreads(1, "the rule")
    try:
        resumed = cpu_threads.resume(cpu_threads.CpuThreads(1, "8 cores, 0 loader workers"), current, 1)
        assert resumed == cpu_threads.CpuThreads(1, "as the run it resumes: 8 cores, 0 loader workers")
        assert torch.get_num_threads() == 1
        # A count saved on a machine with more cores than this one has for a rank: this run's count stays.
        assert cpu_threads.resume(cpu_threads.CpuThreads(cpu_threads.usable_cores() + 1, "elsewhere"), current,
                                  1) is current
    finally:
        torch.set_num_threads(before)


@pytest.mark.multirank
def test_two_ranks_through_composer_launcher(tmp_path):
    out = tmp_path / "results.json"
    result = run_cli(TINY_RUN + ["--results_json", str(out)], launcher=composer_launcher(2))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["world_size"] == 2 and r["global_batch_size"] == 4 and r["device_train_microbatch_size"] == 2
    assert r["images_per_sec_per_device"] == pytest.approx(r["images_per_sec"] / 2)


@pytest.mark.parametrize("args, flag", [
    (["--batch_size", "6", "--device_train_microbatch_size", "4"], "--device_train_microbatch_size"),
    (["--image_size", "60"], "--image_size"),
    (["--model_config", "huge"], "--model_config"),
    (["--precision", "fp8"], "--precision"),
    (["--max_duration", "ten"], "--max_duration"),
    (["--device_train_microbatch_size", "big"], "--device_train_microbatch_size"),
])
def test_bad_flags_fail_at_once_naming_the_flag(args, flag):
    import benchmark

    with pytest.raises(SystemExit) as exit_info:  # validation runs before anything is built
        benchmark.main(TINY_RUN + args)
    message = str(exit_info.value.code)
    assert flag in message and "\n" not in message


def test_remote_without_mds_dataset_names_the_flag():
    import benchmark

    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(["--model_config", "tiny", "--remote", "/nonexistent/mds", "--batch_size", "4"])
    assert "--remote" in str(exit_info.value.code) and "convert.py" in str(exit_info.value.code)


def test_real_data_without_pretrained_encoders_names_the_flag(tmp_path):
    from streaming import MDSWriter

    with MDSWriter(out=str(tmp_path / "mds"), columns={"jpg": "bytes", "caption": "str"}) as writer:
        for i in range(4):  # a real dataset of one global batch: passes the data checks
            writer.write({"jpg": b"\xff\xd8 never decoded", "caption": f"sample {i}"})
    result = run_cli(["--remote", str(tmp_path / "mds"), "--local", str(tmp_path / "cache"), "--model_name",
                      str(tmp_path / "missing"), "--max_duration", "1ba", "--batch_size", "4"], timeout=120)
    assert result.returncode != 0
    assert "--allow_random_encoders" in result.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_overfitting_one_batch_lowers_the_loss():
    from composer import Trainer

    torch.manual_seed(0)
    parts = SD2.build("tiny")
    model = DiffusionModel(SD2, parts)
    g = torch.Generator().manual_seed(0)
    batch = {"image": torch.rand(8, 3, 32, 32, generator=g) * 2 - 1,
             "captions": tokenize(parts.tokenizer, [f"a photo of a number {i}" for i in range(8)])}
    losses: list[float] = []

    from composer.core import Callback

    class RecordLoss(Callback):
        def batch_end(self, state, logger):
            losses.append(float(state.loss))

    trainer = Trainer(model=model, train_dataloader=[batch] * 40, max_duration="40ba", device_train_microbatch_size=8,
                      optimizers=torch.optim.AdamW(model.unet.parameters(), lr=2e-3),
                      callbacks=[RecordLoss()], seed=0, progress_bar=False)
    trainer.fit()
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    # A random UNet predicts noise with MSE ~1; fitting one batch must clearly beat that.
    assert last < 0.6 * first, (first, last)


def test_pretrained_parts_load_from_a_local_diffusers_folder(tmp_path):
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel

    from t2ibench.families.family import load_pretrained as _load_pretrained

    parts = SD2.build("tiny")
    parts.vae.save_pretrained(tmp_path / "vae")
    parts.text_encoder.save_pretrained(tmp_path / "text_encoder")
    vae = _load_pretrained(AutoencoderKL, str(tmp_path), "vae")
    text_encoder = _load_pretrained(CLIPTextModel, str(tmp_path), "text_encoder")
    for loaded, saved in ((vae, parts.vae), (text_encoder, parts.text_encoder)):
        assert loaded is not None
        for (name, a), (_, b) in zip(loaded.state_dict().items(), saved.state_dict().items()):
            assert torch.equal(a, b), name
    assert _load_pretrained(AutoencoderKL, str(tmp_path / "nowhere"), "vae") is None  # missing: None, no raise
    assert _load_pretrained(AutoencoderKL, None, "vae") is None


def test_fast_step_settings_match_the_fp32_step():
    # Same weights, batch, noise and timesteps: channels-last and bf16 autocast must agree with fp32.
    result = preloaded.run([sys.executable, str(ROOT / "bench" / "check_step.py"), "--settings", "fp32-cl", "bf16-cl"],
                           cwd=ROOT, env=offline_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    rows = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines()[1:]}
    assert float(rows["fp32-cl"][1]) < 1e-5  # layout alone changes nothing but rounding


def test_autoresume_refuses_to_start_over_when_latest_is_missing(tmp_path):
    import benchmark

    (tmp_path / "ep0-ba2-rank0.pt").write_bytes(b"checkpoint")  # as if killed while `latest` was relinked
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(TINY_RUN + ["--autoresume", "--save_folder", str(tmp_path), "--run_name", "r"])
    message = str(exit_info.value.code)
    assert "--load_path" in message and "ep0-ba2-rank0.pt" in message
