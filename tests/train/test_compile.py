"""--compile (t2ibench.train.compiling): each family's blocks compiled in place, as many graphs as
bench/compile_graphs.py counts distinct blocks, none compiled after the first batch (so none per step
from the weight casts or from checkpointing's recomputation), the losses of the eager run; the seconds
spent compiling in the results, and those inside the measured window left out of it; with aspect-ratio
buckets, each block compiled once for every bucket, and compiling or a recompile limit reached inside a
bucket's batch left out of its images/s or said in the summary; two ranks under FSDP full_shard
(multirank).

Compiled runs trace with dynamo and AOT autograd but skip inductor's code generation (backend
aot_eager, as tests/fault_run.py): on two busy cores inductor compiles C++ for minutes. The bucketed run,
which counts graphs and compile seconds, runs dynamo's graphs on its eager backend, the cheapest.
"""
from __future__ import annotations

import json
import time
from collections import Counter

import pytest
import torch
from composer.core import Callback, State
from composer.loggers import Logger

import benchmark
from t2ibench.datasets.buckets import read_buckets, synthetic_bucket
from t2ibench.train.compiling import graphs_compiled
from t2ibench.memory.autocast import probe_cpu_autocast
from tests.helpers import TINY_2BA, Launch, bench_script, supervise, two_ranks

COUNT = bench_script("compile_graphs")
RUN = ["--use_synth_data", "--precomputed", "--batch_size", "4", "--image_size", "64", "--num_workers", "0",
       "--max_duration", "3ba", "--warmup_batches", "1", "--precision", "amp_bf16", "--seed", "3"]
# (extra flags, precomputed format): SDXL with checkpointing and weight casts per step (compiled
# Transformer2DModels holding one checkpointed block, like all of SD2's, compiled blocks inside
# diffusers' checkpoint, bf16 copies swapped in every step); Flux.1. SD2's text encoder compiled and
# run: tests/test_gpu_path.py.
CASES = {"sdxl-tiny": (["--activation_checkpointing", "--weight_casts", "step"], "text_states"),
         "flux1-tiny": ([], "text_states")}
# Relative loss difference allowed against the eager run: on the first batch (the same weights) the
# same ops, to rounding (FIRST_LOSS_RTOL); after a step, AOT autograd's graphs round bf16 gradients
# otherwise, and AdamW turns that into weight differences up to ~lr where a gradient is near zero
# (measured 4e-4 after one step on sdxl-tiny). A block left untrained would differ by ~7%, the
# loss's change per step.
FIRST_LOSS_RTOL = 1e-4
LOSS_RTOL = 2e-3


class Batches(Callback):
    """From outside: each batch's loss, and the graphs dynamo had compiled by its end."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.graphs: list[int] = []

    def batch_end(self, state: State, logger: Logger) -> None:
        self.losses.append(float(state.loss.detach().sum()))
        self.graphs.append(graphs_compiled())


@pytest.mark.parametrize("config", list(CASES))
@pytest.mark.slow
def test_compiled_blocks_train_as_eager_with_one_graph_per_distinct_block(config, aot_eager, one_thread, tmp_path,
                                                                          capsys):
    extra, text_format = CASES[config]
    argv = ["--model_config", config, *RUN, "--precomputed_format", text_format, *extra]
    eager, compiled = Batches(), Batches()
    benchmark.main(argv, extra_callbacks=[eager])
    results = benchmark.main([*argv, "--compile", "--results_json", str(tmp_path / "r.json")],
                             extra_callbacks=[compiled])
    assert compiled.losses[0] == pytest.approx(eager.losses[0], rel=FIRST_LOSS_RTOL)
    assert compiled.losses == pytest.approx(eager.losses, rel=LOSS_RTOL)
    counted = COUNT.count_graphs(config, 64, precomputed=True, precomputed_format=text_format, microbatch=4,
                                 policy=probe_cpu_autocast(), device_type="cpu")
    graphs = sum(part["graphs"] for part in counted.values())
    blocks = sum(part["blocks"] for part in counted.values())
    # One graph per distinct block, all compiled in the first batch; the blocks repeat.
    assert results["compiled_graphs"] == graphs < blocks and compiled.graphs[0] == compiled.graphs[-1]
    assert results["compile_seconds"] > 0 and results["compile_seconds_in_window"] == 0
    assert json.loads((tmp_path / "r.json").read_text())["compile_seconds"] == results["compile_seconds"]
    assert f"compile      {graphs} graphs in {results['compile_seconds']:.1f} s" in capsys.readouterr().out


class CompileInBatch(Callback):
    """From outside: a graph compiled inside batch `batch` (a backend that takes `seconds`), and the
    end of every batch by this callback's clock."""

    def __init__(self, batch: int, seconds: float) -> None:
        self.batch, self.seconds = batch, seconds
        self.ends: list[float] = []

    def slow_backend(self, graph: torch.fx.GraphModule, inputs: list) -> object:
        time.sleep(self.seconds)
        return graph.forward

    def after_forward(self, state: State, logger: Logger) -> None:
        if int(state.timestamp.batch) + 1 == self.batch:
            torch.compile(lambda x: x * 2 + 1, backend=self.slow_backend)(torch.ones(3))

    def batch_end(self, state: State, logger: Logger) -> None:
        self.ends.append(time.perf_counter())


@pytest.mark.slow
def test_seconds_compiling_inside_the_window_are_left_out_of_it(one_thread):
    probe = CompileInBatch(batch=3, seconds=1.0)
    results = benchmark.main([*TINY_2BA, "--max_duration", "4ba"], extra_callbacks=[probe])
    assert results["compile_seconds"] >= results["compile_seconds_in_window"] >= 1.0
    window = probe.ends[-1] - probe.ends[0]  # after the one warm-up batch, to the end of the last
    assert results["measured_seconds"] == pytest.approx(window - results["compile_seconds_in_window"], abs=0.2)


# Three buckets of flux1-tiny at 32 px: two token counts (4 and 3), three VAE inputs.
BUCKETS = "32x32\n16x48\n48x16\n"
BUCKET_RUN = ["--use_synth_data", "--image_size", "32", "--batch_size", "2", "--num_workers", "0", "--max_duration",
              "6ba", "--warmup_batches", "1", "--precision", "amp_bf16", "--seed", "4", "--aspect_buckets"]


def first_batches(buckets_file: str, image_size: int, num_batches: int, seed: int) -> dict[str, int]:
    """The batch (1-based) in which each bucket of a one-rank synthetic run first comes (uniform weights)."""
    buckets = read_buckets(buckets_file, image_size, 16)
    weights = tuple(1 / len(buckets) for _ in buckets)
    first: dict[str, int] = {}
    for batch in range(num_batches):
        first.setdefault(buckets[synthetic_bucket(weights, seed, 0, batch)].name, batch + 1)
    return first


@pytest.mark.slow
def test_bucketed_run_compiles_each_block_once_for_every_bucket(dynamo_eager, one_thread, tmp_path, capsys, monkeypatch):
    # The run turns duck sizing off for the process (t2ibench.train.compiling): on again after this test.
    monkeypatch.setattr(torch.fx.experimental._config, "use_duck_shape", torch.fx.experimental._config.use_duck_shape)
    buckets_file = tmp_path / "buckets.txt"
    buckets_file.write_text(BUCKETS)
    first = first_batches(str(buckets_file), 32, 6, seed=4)
    assert len(first) == 3 and max(first.values()) > 1  # buckets first seen inside the window
    compiled = Batches()
    results = benchmark.main(["--model_config", "flux1-tiny", *BUCKET_RUN, str(buckets_file), "--compile"],
                             extra_callbacks=[compiled])
    assert set(results["images_per_bucket"]) == set(first)
    counted = COUNT.count_graphs("flux1-tiny", 32, precomputed=False, precomputed_format=None, microbatch=2,
                                 policy=probe_cpu_autocast(), device_type="cpu")
    # The graphs of one shape, all compiled in the first batch: the spatial sizes are dynamic, so the
    # buckets first seen later compile nothing (static graphs would compile again per bucket).
    assert results["compiled_graphs"] == sum(part["graphs"] for part in counted.values())
    assert compiled.graphs[0] == compiled.graphs[-1]
    assert results["compile_seconds"] > 0 and results["compile_seconds_in_window"] == 0
    assert results["recompile_limit_hits"] == []  # no block ran eagerly
    assert len(results["images_per_sec_per_device_by_bucket"]) == 3
    out = capsys.readouterr().out
    assert f"compile      {results['compiled_graphs']} graphs in" in out and "WARNING" not in out


class CompileAndLimitInBatch(CompileInBatch):
    """From outside: besides the slow compile in batch `batch`, a function compiled for two shapes under
    a recompile limit of 1 in the same batch, which dynamo then runs eagerly; and each batch's bucket."""

    def __init__(self, batch: int, seconds: float) -> None:
        super().__init__(batch, seconds)
        self.buckets: list[str] = []

    def after_dataloader(self, state: State, logger: Logger) -> None:
        self.buckets.append("x".join(str(side) for side in state.batch["image"].shape[-2:]))

    def after_forward(self, state: State, logger: Logger) -> None:
        super().after_forward(state, logger)
        if int(state.timestamp.batch) + 1 == self.batch:
            torch._dynamo.config.recompile_limit = 1
            double = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
            double(torch.ones(3))
            double(torch.ones(4))


@pytest.mark.slow
def test_a_buckets_images_per_sec_leave_compiling_out_and_a_limit_reached_is_said(one_thread, tmp_path, monkeypatch,
                                                                                   capsys):
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", torch._dynamo.config.recompile_limit)
    buckets_file = tmp_path / "buckets.txt"
    buckets_file.write_text(BUCKETS)
    probe = CompileAndLimitInBatch(batch=3, seconds=2.0)
    # In fp32: the subject is the window, not the precision, and sdxl-tiny's 16x48 bucket under CPU bf16
    # autocast reached a non-finite loss at batch 3 in one full run of four (the same seed and flags).
    results = benchmark.main(["--model_config", "sdxl-tiny", *BUCKET_RUN, str(buckets_file), "--precision", "fp32"],
                             extra_callbacks=[probe])
    assert results["compile_seconds_in_window"] >= 2.0
    # Each bucket's seconds are those of its batches inside the window (the warm-up batch is not): with
    # the 2 s of compiling left out, as the window leaves them out, they add up to no more than it.
    rates = results["images_per_sec_per_device_by_bucket"]
    measured = Counter(probe.buckets[results["warmup_batches"]:])
    assert set(rates) == set(measured)
    bucket_seconds = sum(2 * batches / rates[name] for name, batches in measured.items())
    assert bucket_seconds <= results["measured_seconds"]
    assert any("<lambda>" in hit and "recompile_limit (1)" in hit for hit in results["recompile_limit_hits"])
    assert "compile      WARNING: 1 compiled functions reached dynamo's recompile limit" in capsys.readouterr().out


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """flux1-tiny on two ranks under full_shard with checkpointing and amp_bf16, compiled (aot_eager) and
    eager, side by side (the checkpointed blocks are FSDP units: t2ibench.train.parallel.checkpoint_block)."""
    tmp = tmp_path_factory.mktemp("compile-fsdp")
    flags = ["--model_config", "flux1-tiny", *RUN, "--image_size", "32", "--fsdp", "full_shard",
             "--activation_checkpointing"]
    launches = {name: Launch(two_ranks("tests/fault_run.py", "--report", str(tmp / f"{name}-report"), *flags, *extra,
                                       "--results_json", str(tmp / f"{name}.json")), tmp / f"{name}.log")
                for name, extra in (("compiled", ["--compile", "--compile_backend", "aot_eager"]), ("eager", []))}
    supervise(list(launches.values()))
    return tmp, launches


@pytest.mark.multirank
def test_compiled_blocks_under_fsdp_full_shard_train_as_eager(fsdp_runs):
    tmp, launches = fsdp_runs
    for launch in launches.values():
        assert launch.proc.returncode == 0, launch.tail()
    losses = {name: json.loads((tmp / f"{name}-report" / "rank0.json").read_text())["losses"] for name in launches}
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=LOSS_RTOL)
    results = json.loads((tmp / "compiled.json").read_text())
    # The double-stream block, the first single-stream block and the others (whose input is a slice).
    assert results["fsdp"] == "full_shard" and results["compiled_graphs"] == 3
