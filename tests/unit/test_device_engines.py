"""Device engines in a TrainingSession (one process): in-graph replicas and a pipeline in the
task train exactly like the plain model; bad combinations are refused; log_placement prints
the table."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tensorfleet as tfl
from tensorfleet.errors import ConfigError


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    return [(torch.randn(16, 12), torch.randint(0, 4, (16,))) for _ in range(5)]


def train(**options) -> tuple[list[float], nn.Module]:
    model = mlp()
    losses = []
    with tfl.TrainingSession(None, model, optimizer=tfl.optim.SGD(lr=0.1), **options) as sess:
        for x, y in batches():
            result = sess.step(lambda x=x, y=y: F.cross_entropy(sess.model(x), y))
            losses.append(result.loss)
    return losses, model


@pytest.mark.parametrize(
    "options",
    [
        {"replica_devices": ["/cpu:0", "/cpu:1"]},
        {"stage_devices": ["/cpu:0", "/cpu:1"], "microbatches": 4},
    ],
    ids=["replicas", "local-pipeline"],
)
def test_engines_train_like_the_plain_model(options, capsys):
    ref_losses, reference = train()
    losses, model = train(log_placement=True, **options)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < 1e-5
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert (p - q).abs().max() < 1e-5
    table = capsys.readouterr().out
    assert "placement (no ps: variables are local):" in table
    assert "module    0  " in table or "module    0 " in table
    if "replica_devices" in options:
        assert "/device:CPU:0,/device:CPU:1" in table


def test_bad_combinations_are_refused():
    with pytest.raises(ConfigError, match="one of .*replicas.*local_pipeline"):
        train(replica_devices=["/cpu:0"], stage_devices=["/cpu:0", "/cpu:1"])
    with pytest.raises(ConfigError, match=r"a batch of 16 does not split into 3|n_microbatches"):
        train(stage_devices=["/cpu:0", "/cpu:1"], microbatches=3)
    with pytest.raises(ConfigError, match="at least 2"):
        train(stage_devices=["/cpu:0"])


class _TableModel(nn.Module):
    """A tfl.EmbeddingTable under ``emb`` (the place the refusal names), then a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = tfl.EmbeddingTable(100, 4, name="user")
        self.fc = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids))


@pytest.mark.parametrize(
    ("model", "options", "engine"),
    [
        (_TableModel, {"replica_devices": ["/cpu:0", "/cpu:1"]}, "replicas"),
        (
            lambda: nn.Sequential(tfl.EmbeddingTable(100, 4, name="user"), nn.Linear(4, 2)),
            {"stage_devices": ["/cpu:0", "/cpu:1"], "microbatches": 2},
            "local_pipeline",
        ),
    ],
    ids=["replicas", "local-pipeline"],
)
def test_an_engine_refuses_a_model_with_an_embedding_table_when_the_session_starts(
    model, options, engine
):
    """The refusal comes at the start, naming the table's place, the engine and the fix;
    before, the replicas failed inside the first step (TableNotAttached in a replica)."""
    model = model()
    sess = tfl.TrainingSession(
        None, model, optimizer=tfl.optim.SGD(lr=0.1), progress_secs=None, **options
    )
    place = "'emb'" if engine == "replicas" else "'0'"
    with pytest.raises(ConfigError, match=rf"EmbeddingTable modules \({place}\).*{engine!r}") as e:
        sess.start()
    assert "nn.Embedding(..., sparse=True)" in str(e.value)
    assert "without a device engine" in str(e.value)


def test_the_task_pipeline_refuses_tables_too():
    from tensorfleet.session.device_engines import refuse_embedding_tables

    refuse_embedding_tables(mlp(), "task_pipeline")  # no table: nothing to say
    with pytest.raises(ConfigError, match=r"\('emb'\).*'task_pipeline' \(pipelines across"):
        refuse_embedding_tables(_TableModel(), "task_pipeline")


def test_the_settings_take_a_count_of_cpu_replicas():
    from tensorfleet.session.update_modes import UpdateSettings

    assert UpdateSettings(replica_devices=2).replica_devices == ("/cpu:0", "/cpu:1")
    assert UpdateSettings(replica_devices=["/cpu:0"]).replica_devices == ("/cpu:0",)
    assert UpdateSettings(stage_devices=("/cpu:0", "/cpu:1")).stage_devices == ("/cpu:0", "/cpu:1")


def test_a_session_with_replica_devices_2_trains_like_two_cpu_replicas():
    """replica_devices=2 is /cpu:0 and /cpu:1, as tfl.InGraphReplicas(model, 2); before, the
    session failed with a raw TypeError ('int' object is not iterable)."""
    ref_losses, reference = train(replica_devices=["/cpu:0", "/cpu:1"])
    losses, model = train(replica_devices=2)
    assert losses == ref_losses
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    ("option", "value", "error", "message"),
    [
        (
            "replica_devices",
            0,
            ConfigError,
            r"replica_devices=0: a count of CPU replicas must be >= 1",
        ),
        ("replica_devices", True, tfl.ConfigTypeError, r"got bool True"),
        ("replica_devices", "/cpu:0", ConfigError, r"is one string.*\['/cpu:0', '/cpu:1'\]"),
        ("stage_devices", 2, tfl.ConfigTypeError, r"stage_devices takes a list .*got int 2"),
    ],
)
def test_bad_device_options_are_named(option, value, error, message):
    from tensorfleet.session.update_modes import UpdateSettings

    with pytest.raises(error, match=message):
        UpdateSettings(**{option: value})


def test_an_engine_says_it_turns_the_overlap_off(caplog):
    """async with a ps: the engine's backward fires no hooks, so buckets and prefetch are
    off; the session says so (a warning when prefetch was asked for), and still trains."""
    from tensorfleet.ps.service import ServiceConfig
    from tensorfleet.wire.secret import load_secret

    from .service_harness import serve_in_thread, stop_services

    secret = "device-engines-unit-test-secret-0000001"
    running = serve_in_thread(
        ServiceConfig(shard_index=0, worker_tasks=("worker:0",)), load_secret(secret)
    )
    try:
        server = tfl.Server(
            {"ps": [running.address], "worker": ["127.0.0.1:1"]}, "worker", 0, secret=secret
        )
        model = mlp()
        with caplog.at_level(logging.INFO, logger="tensorfleet.session"):
            with tfl.TrainingSession(
                server,
                model,
                optimizer=tfl.optim.SGD(lr=0.1),
                replica_devices=["/cpu:0", "/cpu:1"],
                overlap=tfl.Overlap(prefetch=True),
                progress_secs=None,
            ) as sess:
                for x, y in batches()[:2]:
                    result = sess.step(lambda x=x, y=y: F.cross_entropy(sess.model(x), y))
        assert result.global_step == 2  # no prefetch: the step reports its own update
    finally:
        stop_services([running])
    said = [r for r in caplog.records if "is off with the device engine" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "buckets (bucket_bytes=1048576) and prefetch" in said[0].getMessage()
    assert "'replicas' (replica_devices=)" in said[0].getMessage()


def test_a_session_with_a_pipeline_puts_the_stages_and_the_bubble_in_its_timeline(tmp_path):
    """``stage_devices`` with ``timeline=``: the stages' forwards and backwards on their
    threads, and a ``pipeline step`` span per step with each stage's idle share."""
    import json

    model = mlp()
    with tfl.TrainingSession(
        None,
        model,
        optimizer=tfl.optim.SGD(lr=0.1),
        stage_devices=["/cpu:0", "/cpu:1"],
        microbatches=4,
        timeline=tmp_path / "trace.json",
    ) as sess:
        for x, y in batches():
            sess.step(lambda x=x, y=y: F.cross_entropy(sess.model(x), y))
        path = sess.timeline_path
    events = json.loads(path.read_text())["traceEvents"]
    names = [event["name"] for event in events]
    assert names.count("stage 0 forward") == names.count("stage 1 backward") == 5 * 4
    steps = [event for event in events if event["name"] == "pipeline step"]
    assert len(steps) == 5
    assert all(len(event["args"]["idle_shares"]) == 2 for event in steps)
    assert steps[0]["args"]["schedule_bubble"] == 0.2
