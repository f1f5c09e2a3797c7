"""Clear errors for misconfigurations: each names the value it saw and the fix."""

from __future__ import annotations

import socket

import pytest

from tensorfleet.errors import ClusterConfigError
from tensorfleet.session.server import Server
from tensorfleet.wire.channel import Channel
from tensorfleet.worker.device import torch_device

SECRET = "misconfiguration-test-secret-0123"


def test_port_already_in_use_names_the_address_and_the_fix():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        cluster = {"ps": [f"127.0.0.1:{port}"], "worker": ["127.0.0.1:1"]}
        with pytest.raises(
            OSError, match=rf"cannot listen on 127.0.0.1:{port}.*another process is using that port"
        ):
            Server(cluster, "ps", 0, secret=SECRET)
    finally:
        holder.close()


def test_unresolvable_host_is_named():
    with pytest.raises(
        ClusterConfigError, match=r"cannot resolve the host of ps:0 at 'nohost\.invalid:2222'"
    ):
        Channel("nohost.invalid:2222", SECRET.encode(), "ps:0")


@pytest.mark.parametrize(
    ("spec", "count", "match"),
    [
        (
            "/gpu:0",
            0,
            r"asks for a GPU, but this machine has none.*devices present: /device:CPU:0\)",
        ),
        (
            "/job:worker/task:0/device:gpu:2",
            2,
            r"asks for GPU 2, but this machine has 2 \(devices present: /device:CPU:0, "
            r"/device:GPU:0, /device:GPU:1\).*soft_placement=True",
        ),
    ],
)
def test_a_gpu_the_machine_lacks_is_a_clear_error(spec, count, match):
    with pytest.raises(ClusterConfigError, match=match):
        torch_device(spec, cuda_device_count=lambda: count)


def test_devices_the_machine_has_resolve():
    assert torch_device("/cpu:0").type == "cpu"
    assert str(torch_device("/gpu:1", cuda_device_count=lambda: 2)) == "cuda:1"


def test_unknown_job_for_a_server_is_refused():
    with pytest.raises(ClusterConfigError, match="evaluator"):
        Server({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}, "evaluator", 0, secret=SECRET)


def test_task_index_out_of_range_for_a_server_is_refused():
    with pytest.raises(ClusterConfigError, match="3"):
        Server({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}, "worker", 3, secret=SECRET)
