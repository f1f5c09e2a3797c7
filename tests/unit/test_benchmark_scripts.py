"""The benchmark scripts stay runnable: each one's ``--help`` works (so every import does),
the DDP baseline trains under the launcher the way ``modes.py`` runs it, short runs are refused
with the minimum instead of dividing by zero, results go where ``--out-dir`` /
``TENSORFLEET_BENCH_OUT`` say, and ``run_all.py`` tells a skip from a failure and covers every
benchmark. No benchmark is measured here."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import tensorfleet as tfl

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import results_writer  # noqa: E402
import run_all  # noqa: E402

#: Scripts with a command line (``--help`` must work), relative to benchmarks/.
RUNNABLE = {
    "big_model.py",
    "chaos.py",
    "cnn_compute.py",
    "cnn_training.py",
    "compute_rates.py",
    "ddp_baseline.py",
    "delta_checkpoints.py",
    "devices.py",
    "gpu.py",
    "host_allreduce.py",
    "modes.py",
    "overlap.py",
    "patterns.py",
    "pbt.py",
    "ps_capacity.py",
    "ps_load.py",
    "ps_update.py",
    "ps_sharding_links.py",
    "raw_id_tables.py",
    "recovery.py",
    "request_cost.py",
    "run_all.py",
    "sparse_tables.py",
    "storm_outages.py",
    "task_start.py",
    "throughput.py",
    "timeline_picture.py",
    "wire.py",
    "wire_floor.py",
    "wire_profile.py",
    "programs/big_model_worker.py",
    "programs/click_speed.py",
    "programs/gpu_transfers.py",
    "programs/overlap_worker.py",
    "programs/sparse_table_worker.py",
}
#: Modules without a command line: imported only.
HELPERS = {"results_writer.py", "silent_worker_dumps.py", "programs/fixed_trial.py"}
#: Run with TensorFlow's own venv (``make tf-reference``), never with the project's.
TENSORFLOW_ONLY = {"tf_reference/classic_example_tf.py"}


def _load_path(path: Path) -> ModuleType:
    """Import a script by its path without running its ``__main__`` block."""
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # registered first, as importlib's recipe does: a dataclass looks its module up there
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_script_is_classified() -> None:
    found = {str(p.relative_to(BENCHMARKS)) for p in BENCHMARKS.rglob("*.py")}
    assert found == RUNNABLE | HELPERS | TENSORFLOW_ONLY, (
        "a benchmark script was added or removed: list it in RUNNABLE or HELPERS"
    )


#: Runs ``--help`` of every script given, each in a child forked from one interpreter that
#: imported torch once (22 fresh interpreters took 33 s of the suite, nearly all of it
#: importing torch); each child starts with only what torch and the standard library loaded,
#: so a script's own imports are what is checked. Prints ``{script: [status, output]}``.
HELP_DRIVER = r"""
import json, os, runpy, sys, traceback
import torch  # noqa: F401
results = {}
for script in sys.argv[1:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.dup2(write, 1)
        os.dup2(write, 2)
        sys.argv = [script, "--help"]
        sys.path[0] = os.path.dirname(script)  # as `python script.py` sets it (not the cwd)
        status = 0
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    _, wait_status = os.waitpid(pid, 0)
    output = b"".join(chunks).decode(errors="replace")
    results[script] = [os.waitstatus_to_exitcode(wait_status), output[-20000:]]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def help_outputs() -> dict[str, list]:
    """``[status, output]`` of ``--help`` of every runnable script, by script."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TF_CONFIG")}
    scripts = [str(BENCHMARKS / script) for script in sorted(RUNNABLE)]
    done = subprocess.run(
        [sys.executable, "-c", HELP_DRIVER, *scripts],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("script", sorted(RUNNABLE))
def test_help_runs(script: str, help_outputs: dict[str, list]) -> None:
    """``--help`` imports everything the script imports (ddp_baseline's WARMUP_STEPS import,
    compute_rates' mnist_cnn) with only the venv's packages and no PYTHONPATH."""
    status, output = help_outputs[str(BENCHMARKS / script)]
    assert status == 0, output
    assert "usage:" in output


@pytest.mark.parametrize("helper", sorted(HELPERS))
def test_helper_imports(helper: str) -> None:
    _load_path(BENCHMARKS / helper)


def test_ddp_baseline_trains_under_the_launcher() -> None:
    """modes.py's all-reduce baseline: 2 processes, DDP over gloo, past the warm-up."""
    import modes
    from cnn_training import WARMUP_STEPS

    rate = modes.ddp_direct(WARMUP_STEPS + 2, 2, timeout=180)
    assert rate > 0


# --------------------------------------------------------------------- warm-up checks


def test_cnn_training_refuses_figures_before_the_warm_up() -> None:
    import cnn_training
    import mnist_cnn

    clocks = cnn_training.BenchmarkClocks(None)
    clocks.local_steps = cnn_training.WARMUP_STEPS  # exactly the warm-up: nothing timed
    result = mnist_cnn.Result(test_accuracy=0.5, global_step=60, workers=3)
    with pytest.raises(tfl.ConfigError) as caught:
        clocks.figures(result, "sync", 20)
    message = str(caught.value)
    assert "--steps 20" in message and "20 local steps" in message
    assert f"at least {cnn_training.WARMUP_STEPS + 1} local steps" in message


def test_overlap_worker_refuses_figures_before_the_warm_up() -> None:
    worker = _load_path(BENCHMARKS / "programs" / "overlap_worker.py")
    clock = worker.Clock()
    for step in range(1, worker.WARMUP + 1):  # exactly the warm-up: the clock starts, no time
        clock.after_step(None, tfl.StepResult(loss=0.0, global_step=step))
    with pytest.raises(tfl.ConfigError, match=rf"--steps 30 .*{worker.WARMUP} warm-up"):
        clock.figures(30)


def test_modes_refuses_samples_that_do_not_pass_the_warm_up() -> None:
    import modes

    problems = modes.too_short(3000, 24000, 30000)  # what --quick passed: 20 sync steps
    assert len(problems) == 1
    assert "--samples 3000" in problems[0] and "--samples 3150 or more" in problems[0]
    assert modes.too_short(45000, 24000, 30000) == []  # the documented run


def test_throughput_and_overlap_refuse_too_few_steps() -> None:
    import overlap
    import throughput

    problem = throughput.too_few_steps(30, list(throughput.TENSORFLEET_ROWS))
    assert problem is not None and "--steps 30" in problem and "--steps 63 or more" in problem
    assert throughput.too_few_steps(600, list(throughput.TENSORFLEET_ROWS)) is None
    problem = overlap.too_few_steps(30, 2)
    assert problem is not None and "--steps 32 or more" in problem
    assert overlap.too_few_steps(200, 2) is None


def test_quick_settings_pass_every_warm_up() -> None:
    import modes
    import overlap
    import throughput

    def value(arguments: tuple[str, ...], option: str, default: int) -> int:
        return int(arguments[arguments.index(option) + 1]) if option in arguments else default

    quick = run_all.BENCHMARKS["modes"].quick
    assert (
        modes.too_short(
            value(quick, "--samples", 45000),
            value(quick, "--straggler-samples", 24000),
            value(quick, "--pair-samples", 30000),
        )
        == []
    )
    assert value(quick, "--pairs", 3) == 1
    steps = value(run_all.BENCHMARKS["throughput"].quick, "--steps", 600)
    assert throughput.too_few_steps(steps, list(throughput.TENSORFLEET_ROWS)) is None
    for name in ("overlap", "overlap_links"):
        steps = value(run_all.BENCHMARKS[name].quick, "--steps", 300)
        assert overlap.too_few_steps(steps, 2) is None


def test_big_model_refuses_runs_without_a_timed_step() -> None:
    import big_model

    problem = big_model.too_few_steps(3, 3)
    assert problem is not None and "--steps 3" in problem and "--steps 4 or more" in problem
    assert big_model.too_few_steps(12, 3) is None
    quick = big_model.QUICK
    assert big_model.too_few_steps(quick["steps"], quick["warmup"]) is None


def test_big_model_phases_are_per_timed_step() -> None:
    """The warm-up steps are left out, spans of other threads too, and the ps's spans count
    only inside a timed step."""
    import big_model

    def span(name: str, ts: float, dur: float, tid: int = 1) -> dict:
        return {"name": name, "ts": ts, "dur": dur, "tid": tid, "ph": "X"}

    worker = [
        span("step", 0, 100),  # the warm-up step
        span("backward", 10, 50),
        span("step", 1000, 2000),
        span("backward", 1100, 1000),
        span("wait", 2200, 400),
        span("step", 4000, 4000),
        span("backward", 4100, 3000),
        span("wait", 7200, 600),
        span("wait", 7200, 9999, tid=2),  # another thread: not the stepping one
    ]
    ps = {
        "ps:0": [span("apply", 50, 10, 7), span("apply", 2300, 200, 7), span("apply", 9000, 5, 7)]
    }
    phases = big_model.phases(worker, ps, warmup=1)
    assert phases == {"step": 3.0, "backward": 2.0, "wait": 0.5, "ps:0:apply": 0.1}
    assert big_model.phases(worker, ps, warmup=3) == {}


def test_big_model_cpu_time_is_interpolated_over_the_window() -> None:
    import big_model

    samples = [(0.0, 0.0), (1.0, 0.5), (2.0, 1.5)]
    assert big_model.cpu_between(samples, 0.5, 1.5) == pytest.approx(1.0 - 0.25)
    assert big_model.cpu_between(samples, 0.5, 3.0) is None  # no sample after the window


# --------------------------------------------------------------------- where results go


def test_results_go_to_the_environment_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(results_writer.OUT_ENV, str(tmp_path))
    before = {p: p.stat().st_mtime for p in results_writer.RESULTS.glob("*")}
    path = results_writer.write_results("probe", {"x": 1}, "heading", ["| a |"])
    assert path == tmp_path / "probe.md"
    assert json.loads((tmp_path / "probe.json").read_text()) == {"x": 1}
    assert {p: p.stat().st_mtime for p in results_writer.RESULTS.glob("*")} == before


def test_out_dir_option_sets_the_directory_for_the_children(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(results_writer.OUT_ENV, raising=False)
    assert results_writer.results_dir() == results_writer.RESULTS
    parser = argparse.ArgumentParser()
    results_writer.add_out_dir_option(parser)
    parser.parse_args(["--out-dir", str(tmp_path / "out")])
    assert os.environ[results_writer.OUT_ENV] == str(tmp_path / "out")
    assert results_writer.results_dir() == tmp_path / "out"


def test_every_benchmark_takes_out_dir() -> None:
    for path in BENCHMARKS.glob("*.py"):
        text = path.read_text()
        if "write_results(" in text and path.name != "results_writer.py":
            assert "add_out_dir_option(parser)" in text, path.name


def test_chaos_names_its_results_by_seed() -> None:
    import chaos

    committed = json.loads((results_writer.RESULTS / "chaos.json").read_text())
    assert committed["seed"] == chaos.DEFAULT_SEED  # the committed chaos.md keeps its name
    assert chaos.results_name(chaos.DEFAULT_SEED) == "chaos"
    assert chaos.results_name(2) == "chaos_seed2"


def test_chaos_splits_a_worker_sigterm_recovery_into_its_phases(tmp_path: Path) -> None:
    """The storm's phases of a worker SIGTERM: the worker's own 'preempted' line, the
    launcher's restart announcement (at the exit, or once the worker left), its restart."""
    import chaos

    watch = chaos.Watch(tmp_path / "log")
    try:
        watch.events = [
            (10.0, "worker:0", "Worker: 0, Step: 5, Accuracy (batch): 0.8"),
            (10.3, "worker:1", "worker:1: preempted (SIGTERM) at global step 6; exiting"),
            (10.4, "worker:0", "worker:0: preempted (SIGTERM) at global step 7; checkpoint"),
            (10.5, "launcher", "worker:0 left the cluster (preempted: ...); restarting it"),
            (10.6, "launcher", "restarted worker:0 (restart 1 of 10) as pid 7: warm spare 1"),
            (11.2, "worker:0", "Worker: 0, Step: 9, Accuracy (batch): 0.8"),
        ]
        phases = chaos.worker_term_phases(watch, "worker:0", 10.0, 11.2)
        assert {k: round(v, 1) for k, v in phases.items()} == {
            "saved": 0.4,
            "restart scheduled": 0.5,
            "restarted": 0.6,
        }
        watch.events[3] = (10.7, "launcher", "worker:0 failed with exit code 143; restarting it")
        at_exit = chaos.worker_term_phases(watch, "worker:0", 10.0, 11.2)
        assert round(at_exit["restart scheduled"], 1) == 0.7
        assert chaos.worker_term_phases(watch, "worker:0", 10.0, 10.35) == {}  # before its lines
    finally:
        watch.close_log()


def test_chaos_times_a_replaced_ps_stop_from_the_stop(tmp_path: Path) -> None:
    """A SIGSTOP of the ps that the launcher ended by replacing the ps before the SIGCONT is
    timed as a kill (from the stop to the first step after the restart, with the steps lost);
    one that lasted to its SIGCONT is timed from the SIGCONT."""
    import chaos

    watch = chaos.Watch(tmp_path / "log")
    try:
        started = 100.0
        watch.steps = [(105.0, 0, 40), (112.5, 1, 41)]
        watch.restarts = [(112.0, "ps:0", 7, True)]  # 2 s after the stop at 110
        replaced = chaos.Fault("ps:0", "stop", 10.0, 40, resumed_at_s=25.0)
        chaos.measure_storm_recovery(replaced, started, watch)
        assert replaced.replaced and replaced.spare
        assert replaced.recovered_s == pytest.approx(2.5)
        assert replaced.steps_lost == 0
        watch.steps = [(105.0, 0, 40), (125.3, 1, 41)]
        watch.restarts = []
        waited = chaos.Fault("ps:0", "stop", 10.0, 40, resumed_at_s=25.0)
        chaos.measure_storm_recovery(waited, started, watch)
        assert not waited.replaced
        assert waited.recovered_s == pytest.approx(0.3)
    finally:
        watch.close_log()


def test_a_partial_devices_run_has_its_own_file() -> None:
    import devices

    assert devices.results_name(None) == "devices"
    assert devices.results_name("budget") == "devices_budget"


# --------------------------------------------------------------------- run_all


def test_a_benchmark_that_cannot_run_here_is_a_skip(capsys: pytest.CaptureFixture) -> None:
    status = results_writer.not_run("ps_sharding_links", "network namespaces need root")
    output = capsys.readouterr().out.splitlines()
    outcome = run_all.classify(status, output, wrote_results=False)
    assert outcome == run_all.Outcome("skipped", "network namespaces need root")
    ran = run_all.classify(0, ["| table |"], wrote_results=True)
    assert run_all.exit_status({"a": ran, "b": outcome}) == 0


def test_failures_are_failures() -> None:
    crashed = run_all.classify(1, ["Traceback", "ZeroDivisionError: float division by zero"], True)
    assert crashed.kind == "failed" and "ZeroDivisionError" in crashed.reason
    assert "exit status 1" in crashed.reason
    usage = run_all.classify(2, ["x.py: error: unrecognized arguments: --bad"], False)
    assert usage.kind == "failed"
    silent = run_all.classify(results_writer.NOT_RUN_STATUS, ["no reason"], False)
    assert silent.kind == "failed" and "without a reason" in silent.reason
    no_file = run_all.classify(0, [], wrote_results=False)
    assert no_file.kind == "failed" and "no results file" in no_file.reason
    assert run_all.exit_status({"a": run_all.Outcome("ran"), "b": crashed}) == 1


def test_make_bench_runs_every_benchmark() -> None:
    """Every script that writes results is in run_all.BENCHMARKS (the Makefile and
    benchmarks/README.md say make bench runs them all)."""
    writers = {
        p.stem
        for p in BENCHMARKS.glob("*.py")
        if "write_results(" in p.read_text() and p.stem not in ("results_writer", "run_all")
    }
    assert {b.script for b in run_all.BENCHMARKS.values()} == writers


def test_headlines_read_the_committed_results() -> None:
    """The headline rows of every benchmark whose committed JSON exists, modes included."""
    results = {}
    for name, bench in run_all.BENCHMARKS.items():
        path = results_writer.RESULTS / f"{bench.results}.json"
        results[name] = json.loads(path.read_text()) if path.exists() else None
    rows = run_all.headlines(results)
    modes = [row for row in rows if row[0] == "modes"]
    ratio = results["modes"]["rows"]["allreduce"]["ratio_vs_ddp_direct"]
    assert (
        "modes",
        "allreduce vs DDP used directly (median of pairs)",
        f"{ratio:.2f}x",
        ">= 0.97x",
    ) in modes
    covered = {row[0] for row in rows}
    assert {name for name, result in results.items() if result} <= covered


def test_tf_python_honours_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TF_PYTHON", "/opt/tf/bin/python")
    assert run_all.tf_python() == "/opt/tf/bin/python"
    monkeypatch.delenv("TF_PYTHON")
    assert run_all.tf_python() == str(ROOT / ".venv-tf" / "bin" / "python")


def test_readme_commands_name_existing_results() -> None:
    """Each excerpt note in benchmarks/README.md names a results file that exists."""
    text = (BENCHMARKS / "README.md").read_text()
    for name in re.findall(r"`benchmarks/results/([\w.]+\.md)`", text):
        assert (results_writer.RESULTS / name).exists(), name


# --------------------------------------------------------------------- gpu.py


def test_gpu_check_finds_its_test_files_and_plans_its_rows() -> None:
    import gpu

    files = gpu.gpu_test_files()
    assert "tests/cluster/test_gpu_modes.py" in files and "tests/unit/test_device.py" in files
    assert "tests/unit/test_benchmark_scripts.py" not in files  # mentions CUDA, runs on CPU
    steps = {"one": 40, "ps": 20, "ps3": 20, "allreduce": 10}
    one_gpu = [row["name"] for row in gpu.rows_to_run(1, steps)]
    assert one_gpu == [
        "one process",
        "1 ps + 1 worker, async",
        "1 ps + 1 worker, async, torch's default Adam kernel (--no-fused-optimizer)",
        "1 ps + 1 worker, async, --prefetch",
        "1 ps + 1 worker, async, --intra-op-threads 4",
        "1 ps + 1 worker, async, --prefetch --intra-op-threads 4",
        "1 ps + 1 worker, async, --intra-op-threads 1",
        "1 ps + 3 workers sharing one GPU, async",
        "all-reduce, 3 workers sharing one GPU (shared memory)",
        "all-reduce, 3 workers sharing one GPU (gloo: TENSORFLEET_SHARED_MEMORY=0)",
    ]
    over_gloo = gpu.rows_to_run(1, steps, matching=["(gloo"])[-1]
    assert over_gloo["env"] == {"TENSORFLEET_SHARED_MEMORY": "0"}  # given to the launcher
    assert gpu.rows_to_run(2, steps)[-1]["name"] == "all-reduce, 2 workers on a GPU each (nccl)"
    default_kernel = gpu.rows_to_run(1, steps, matching=["default Adam kernel"])[-1]
    assert default_kernel["program"] == ["--no-fused-optimizer"]  # passed to the example


def test_gpu_check_table_gives_ratios_in_batches_and_names_failures() -> None:
    import gpu

    def row(name: str, rate: float, workers: int, mode: str) -> dict:
        return {
            "name": name,
            "steady_global_steps_per_s": rate,
            "batches_per_s": rate * (workers if mode == "allreduce" else 1),
            "steady_local_ms_per_step": 2.5,
        }

    result = {
        "tests": {"files": ["a", "b"], "summary": "9 passed, 1 skipped in 3s"},
        "rows": [
            row("one process", 400.0, 1, "async"),
            row("all-reduce, 3 workers sharing one GPU (gloo)", 50.0, 3, "allreduce"),
            {"name": "1 ps + 1 worker, async", "error": "timed out after 100 s"},
        ],
    }
    lines = gpu.table(result)
    assert lines[2] == "| GPU tests (2 files) | 9 passed, 1 skipped in 3s | | | |"
    assert (
        lines[4] == "| all-reduce, 3 workers sharing one GPU (gloo) | 50.0 | 150.0 | 0.38 | 2.50 |"
    )
    assert lines[5] == "| 1 ps + 1 worker, async | timed out after 100 s | | | |"
    result["big_model"] = {
        "rows": {
            "torch": {"what": "one process", "s_per_step": 0.04, "vs_one_process": 1.0},
            "ps1": {"what": "1 ps + 1 worker", "s_per_step": 0.5, "vs_one_process": 0.08},
        }
    }
    lines = gpu.table(result)
    assert lines[-1] == "| BERT-base-sized model, ps1: 1 ps + 1 worker | 2.00 | 2.00 | 0.08 | 500 |"
    result["big_model"] = {"error": "exit status 1 after 12 s"}
    assert gpu.table(result)[-1] == (
        "| BERT-base-sized model (big_model.py) | exit status 1 after 12 s | | | |"
    )


def test_gpu_check_summarises_the_workers_timeline_and_tables_the_transfers() -> None:
    import gpu

    trace = {
        "traceEvents": [
            {"ph": "X", "name": "wait", "dur": 2000, "tid": 1},
            {"ph": "X", "name": "wait", "dur": 4000, "tid": 1},
            {"ph": "X", "name": "wait", "dur": 3000, "tid": 1},
            {"ph": "X", "name": "pack", "dur": 500, "tid": 2},
            {"ph": "M", "name": "thread_name", "tid": 2},
        ]
    }
    summary = gpu.timeline_summary(trace)
    assert summary == {
        "wait": {"count": 3, "median_ms": 3.0, "total_ms": 9.0},
        "pack": {"count": 1, "median_ms": 0.5, "total_ms": 0.5},
    }
    row = {"name": "1 ps + 1 worker, async, --prefetch", "steady_global_steps_per_s": 100.0,
           "batches_per_s": 100.0, "steady_local_ms_per_step": 10.0, "timeline": summary}  # fmt: skip
    result = {"rows": [row], "transfers": {"numel": 5, "host_copy_ms": 0.106}}
    lines = gpu.table(result)
    assert "| host copy | 0.106 |" in lines and not any("numel" in line for line in lines)
    assert lines[-2:] == ["| wait | 3 | 3.000 | 9.0 |", "| pack | 1 | 0.500 | 0.5 |"]
    rows = gpu.rows_to_run(1, {"one": 4, "ps": 2, "ps3": 2, "allreduce": 1})
    timed = [row["name"] for row in rows if row.get("timeline")]
    assert timed == ["1 ps + 1 worker, async, --prefetch"]  # the row whose phases are summarised


def test_gpu_transfers_without_a_gpu_measures_the_ps_adam_and_names_what_it_left_out() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "programs" / "gpu_transfers.py"), "--device", "cpu",
         "--repeats", "2"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["numel"] == 1_625_606 and figures["bytes"] == 4 * 1_625_606  # the CNN
    assert (
        figures["cpu_adam_fused_1_threads_ms"] > 0 and figures["cpu_adam_foreach_1_threads_ms"] > 0
    )
    assert "host_copy_ms" in figures["needs_cuda"] and "host_copy_ms" not in figures


def test_gpu_check_profile_gives_each_processs_top_frames() -> None:
    import gpu

    raw = (
        "process 10:python -m tensorfleet server;serve (service.py:1);poll (libc.so.6) 30\n"
        "process 10:python -m tensorfleet server;serve (service.py:1);apply (store.py:2) 10\n"
        "process 9:launch;process 11:python cnn_training.py;step (session.py:3);poll (libc.so.6) 5\n"
        "not a stack line\n"
    )
    assert gpu.top_frames(raw) == [
        "- process 10:python -m tensorfleet server: 40 samples",
        "  - 75.0% poll (libc.so.6)",
        "  - 25.0% apply (store.py:2)",
        "- process 11:python cnn_training.py: 5 samples",
        "  - 100.0% poll (libc.so.6)",
    ]
    rows = gpu.rows_to_run(1, {"one": 4, "ps": 2, "ps3": 2, "allreduce": 1}, profile=True)
    assert [r for r in rows if r.get("profile")][0]["name"] == gpu.PROFILED_ROW


def test_gpu_check_runs_the_tests_in_processes_where_xdist_and_the_cores_allow() -> None:
    import gpu

    parallel = gpu.pytest_command(["tests/a.py"], has_xdist=True, cpus=16)
    assert parallel[-3:] == ["-n", "4", "tests/a.py"] and "-v" in parallel
    assert "-n" not in gpu.pytest_command(["tests/a.py"], has_xdist=False, cpus=16)
    assert "-n" not in gpu.pytest_command(["tests/a.py"], has_xdist=True, cpus=4)
    assert gpu.SKIPPED_HERE in parallel  # the cpu cases of the modes: the suite runs them
    stealing = gpu.pytest_command(["tests/a.py"], True, 16, has_timeout=True, has_worksteal=True)
    assert stealing[-3:] == ["--dist", "worksteal", "tests/a.py"]
    assert stealing[stealing.index("--timeout") + 1] == str(gpu.TEST_TIMEOUT_S)
    assert stealing[stealing.index("--timeout-method") + 1] == "thread"  # stacks of a hang
    narrowed = gpu.pytest_command(["tests/a.py"], False, select="bn and cuda")
    assert narrowed[narrowed.index("-k") + 1] == f"({gpu.SKIPPED_HERE}) and (bn and cuda)"


def test_gpu_check_runs_the_rows_asked_for_and_always_its_baseline() -> None:
    import gpu

    steps = {"one": 4, "ps": 2, "ps3": 2, "allreduce": 1}
    rows = gpu.rows_to_run(1, steps, profile=True, matching=["under py-spy", "3 workers"])
    assert [row["name"] for row in rows] == [
        "one process",
        "1 ps + 3 workers sharing one GPU, async",
        "all-reduce, 3 workers sharing one GPU (shared memory)",
        "all-reduce, 3 workers sharing one GPU (gloo: TENSORFLEET_SHARED_MEMORY=0)",
        gpu.PROFILED_ROW,
    ]


@pytest.mark.timeout(200)
def test_gpu_check_row_plumbing_on_the_cpu() -> None:
    """The one-process row on /cpu:0 (the GPU check's own rows need a GPU): the figures of
    cnn_training's --metrics-json come back, with batches/s; a row's own program arguments
    reach the example (an unknown one would end it with status 2)."""
    import gpu

    row = {"name": "one process", "launch": None, "mode": "async", "steps": 25,
           "program": ["--no-fused-optimizer"]}  # fmt: skip
    result = gpu.run_row(row, None, "0", 180, device="/cpu:0")  # the examples' data search
    assert "error" not in result, result
    assert result["chief_local_steps"] == 25 and result["batches_per_s"] > 0


@pytest.mark.timeout(60)
def test_gpu_check_stops_a_part_past_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A part past its limit is interrupted (SIGINT, then SIGKILL to its group) and reported
    as stopped, never waited for: here a child that ignores SIGINT and sleeps."""
    import gpu

    monkeypatch.setattr(gpu, "STOP_GRACE_S", 2)
    program = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(120)"
    output, status = gpu.run_limited([sys.executable, "-c", program], dict(os.environ), 3)
    assert status is None
    assert output.endswith("(stopped after 3 s)")


def test_request_cost_refuses_a_baseline_that_is_not_a_checkouts_src(tmp_path: Path) -> None:
    request_cost = _load_path(BENCHMARKS / "request_cost.py")
    assert request_cost.baseline_problem(ROOT / "src") is None
    assert "no tensorfleet package there" in request_cost.baseline_problem(tmp_path)
    (tmp_path / "src" / "tensorfleet").mkdir(parents=True)
    (tmp_path / "src" / "tensorfleet" / "__init__.py").write_text("")
    assert "no benchmarks/wire.py" in request_cost.baseline_problem(tmp_path / "src")
