"""The payload stream between hosts: a ps and a worker on two network namespaces (each its own
address on a shared bridge) train the same sync model twice, with
``TENSORFLEET_PAYLOAD_STREAM=1`` and without (shared memory off: the namespaces share one
kernel). Expected: the worker opens its stream to the ps's address on the other host, the
ps's replies and the worker's pushes of 2 MiB and more travel on it (the ps counts them),
and both runs end with the same parameters, bit for bit. The streamed run fixes the stream's
port (``TENSORFLEET_PAYLOAD_STREAM_PORT``, as ``tensorfleet k8s render`` does): the ps
listens there and the worker finds it from the ps's ``hello`` answer."""

from __future__ import annotations

import json
import secrets
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from .hosts import Children, free_port, task_env
from .netns import NetworkNamespaces

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(240)]

WORKER_PROGRAM = Path(__file__).parents[1] / "cluster" / "programs" / "exact_worker.py"
#: Global steps of each run; the hidden layer makes every payload about 2.9 MB.
STEPS = 20
HIDDEN = 60000
#: Seconds a run may take from its start to every task's exit.
RUN_DEADLINE_S = 100.0


def run_cluster(net: NetworkNamespaces, stream: str, out: Path) -> dict:
    """One ps on the first namespace, one worker (the chief) on the second; the chief's
    report (parameters, global step, the ps's stats)."""
    hosts = {"ps:0": 0, "worker:0": 1}
    address = {name: f"{net.address(ns)}:{free_port(net, ns)}" for name, ns in hosts.items()}
    cluster = {"ps": [address["ps:0"]], "worker": [address["worker:0"]]}
    secret = secrets.token_hex(32)
    # The namespaces share one kernel, so the tasks would find each other on one host and use
    # shared memory: off, as between machines.
    settings = {"TENSORFLEET_PAYLOAD_STREAM": stream, "TENSORFLEET_SHARED_MEMORY": "0"}
    stream_port = free_port(net, hosts["ps:0"])
    ps_settings = {**settings, "TENSORFLEET_PAYLOAD_STREAM_PORT": str(stream_port)}
    children = Children()
    try:
        children.start(
            "ps:0",
            net.exec_argv(hosts["ps:0"], [sys.executable, "-m", "tensorfleet", "server"]),
            {**task_env(cluster, "ps", 0, secret), **ps_settings},
        )
        argv = [sys.executable, str(WORKER_PROGRAM), str(out), "sync", "adam", str(STEPS),
                "--hidden", str(HIDDEN)]  # fmt: skip
        children.start(
            "worker:0",
            net.exec_argv(hosts["worker:0"], argv),
            {**task_env(cluster, "worker", 0, secret), **settings},
        )
        codes = children.wait_all(RUN_DEADLINE_S)
        transcript = f"cluster {cluster}, stream {stream}:\n{children.transcript()}"
        assert codes == {"ps:0": 0, "worker:0": 0}, transcript
        assert out.exists(), transcript
        if stream == "1":  # the ps named its stream's port; the worker's opening was not refused
            ps_host = net.address(hosts["ps:0"])
            assert f"payload streams on {ps_host}:{stream_port} " in transcript, transcript
            assert "cannot open the payload stream" not in transcript, transcript
        return json.loads(out.read_text())
    finally:
        children.kill_all()


def test_the_payload_stream_carries_both_ways_between_hosts_to_the_same_parameters(
    network_namespaces: Callable[[int], NetworkNamespaces], tmp_path: Path
) -> None:
    net = network_namespaces(2)
    streamed = run_cluster(net, "1", tmp_path / "streamed.json")
    plain = run_cluster(net, "0", tmp_path / "plain.json")
    (stats,) = streamed["stats"]
    assert stats["streamed_replies"] >= STEPS and stats["streamed_requests"] >= STEPS, stats
    assert plain["stats"][0]["streamed_replies"] == 0 == plain["stats"][0]["streamed_requests"]
    assert streamed["global_step"] == plain["global_step"] == STEPS
    assert streamed["params"] == plain["params"]
