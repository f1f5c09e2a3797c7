"""DeviceSpec: TensorFlow's device strings, their canonical form, merging and torch devices.

The cases marked "TF" are TensorFlow's own expectations (device_spec_test.py and
device_test.py of tensorflow/python/framework), written against our API."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensorfleet.cluster import DeviceSpec
from tensorfleet.errors import ClusterConfigError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/job:worker/task:1/device:gpu:0", DeviceSpec("worker", 1, "gpu", 0)),
        ("/job:ps/task:0/cpu:0", DeviceSpec("ps", 0, "cpu", 0)),
        ("/cpu:0", DeviceSpec(device_type="cpu", device_index=0)),
        ("/gpu:1", DeviceSpec(device_type="gpu", device_index=1)),
        ("/device:GPU:0", DeviceSpec(device_type="gpu", device_index=0)),
        ("/device:CPU:3", DeviceSpec(device_type="cpu", device_index=3)),
        ("/device:cuda:2", DeviceSpec(device_type="gpu", device_index=2)),
        ("/CPU:0", DeviceSpec(device_type="cpu", device_index=0)),
        ("/cuda:1", DeviceSpec(device_type="gpu", device_index=1)),
        ("/job:worker", DeviceSpec(job="worker")),
        ("/task:2", DeviceSpec(task=2)),
        ("", DeviceSpec()),
        ("/", DeviceSpec()),
        ("gpu:0", DeviceSpec(device_type="gpu", device_index=0)),
        ("job:worker/task:3", DeviceSpec("worker", 3)),
        ("/gpu", DeviceSpec(device_type="gpu")),
        ("/device:gpu", DeviceSpec(device_type="gpu")),
        ("/device:GPU:*", DeviceSpec(device_type="gpu")),
        ("/cpu:*", DeviceSpec(device_type="cpu")),
        (
            "/job:localhost/replica:0/task:0/device:CPU:0",
            DeviceSpec("localhost", 0, "cpu", 0, replica=0),
        ),
        ("/job:worker/replica:0/task:1/device:GPU:0", DeviceSpec("worker", 1, "GPU", 0, replica=0)),
        ("/replica:3", DeviceSpec(replica=3)),
        ("/device:CPU:*", DeviceSpec(device_type="CPU")),
        ("/gPu:2", DeviceSpec(device_type="GPU", device_index=2)),
        ("/device:gpu:0/job:worker", DeviceSpec("worker", None, "gpu", 0)),
        ("  /cpu:0 ", DeviceSpec(device_type="cpu", device_index=0)),
    ],
)
def test_parse(text, expected):
    assert DeviceSpec.parse(text) == expected


@pytest.mark.parametrize(
    ("spec", "text"),
    [
        (DeviceSpec("worker", 1, "gpu", 0), "/job:worker/task:1/device:GPU:0"),
        (DeviceSpec("ps", 0, "cpu", 0), "/job:ps/task:0/device:CPU:0"),
        (DeviceSpec(device_type="cpu", device_index=0), "/device:CPU:0"),
        (DeviceSpec(device_type="GPU"), "/device:GPU:*"),
        (DeviceSpec(job="worker"), "/job:worker"),
        (DeviceSpec(task=4), "/task:4"),
        (DeviceSpec(), ""),
    ],
)
def test_to_string_is_canonical_and_round_trips(spec, text):
    assert spec.to_string() == text
    assert str(spec) == text
    assert DeviceSpec.parse(text) == spec


def test_device_type_is_normalized():
    assert DeviceSpec(device_type="CUDA").device_type == "GPU"
    assert DeviceSpec(device_type="gpu").device_type == "GPU"
    assert DeviceSpec(device_type="Cpu").device_type == "CPU"
    assert DeviceSpec(device_type="cuda", device_index=1) == DeviceSpec.parse("/gpu:1")


def test_is_frozen_and_hashable():
    spec = DeviceSpec("worker", 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.job = "ps"  # type: ignore[misc]
    assert len({spec, DeviceSpec.parse("/job:worker/task:0")}) == 1


@pytest.mark.parametrize(
    ("outer", "inner", "merged"),
    [
        ("/job:worker/task:1", "/gpu:0", "/job:worker/task:1/device:GPU:0"),
        ("/job:worker/task:1/cpu:0", "/job:ps", "/job:ps/task:1/device:CPU:0"),
        ("/job:worker/task:1/gpu:2", "", "/job:worker/task:1/device:GPU:2"),
        ("", "/job:ps/task:0/cpu:0", "/job:ps/task:0/device:CPU:0"),
        ("/job:worker/gpu:1", "/task:3", "/job:worker/task:3/device:GPU:1"),
        # fields merge one by one, as in TensorFlow: a type without index keeps the index
        ("/gpu:1", "/cpu", "/device:CPU:1"),
    ],
)
def test_merge(outer, inner, merged):
    assert DeviceSpec.parse(outer).merge(DeviceSpec.parse(inner)).to_string() == merged
    assert DeviceSpec.parse(outer).merge(inner).to_string() == merged


@pytest.mark.parametrize(
    ("text", "device"),
    [
        ("", "cpu"),
        ("/job:worker/task:0", "cpu"),
        ("/cpu:0", "cpu"),
        ("/cpu:3", "cpu"),
        ("/gpu:0", "cuda:0"),
        ("/job:worker/task:1/device:GPU:3", "cuda:3"),
        ("/gpu", "cuda"),
        ("/job:worker/replica:0/task:1/gpu:1", "cuda:1"),
    ],
)
def test_torch_device(text, device):
    assert DeviceSpec.parse(text).torch_device() == device


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("/job:worker/foo:1", "unknown part 'foo:1'"),
        ("/tpu:0", "unknown device type 'tpu'"),
        ("/TPU:1", "unknown device type 'TPU'; use 'CPU' or 'GPU'"),
        ("/job:worker/mps", "unknown device type 'mps'"),
        ("/device:tpu:0", "unknown device type 'tpu'"),
        ("/device", "unknown part 'device'"),
        ("/device:gpu:0:1", "unknown part 'device:gpu:0:1'"),
        ("/job:worker//task:0", "unknown part ''"),
        ("/job", "unknown part 'job'"),
        ("/task:x", "task index 'x' is not a non-negative integer"),
        ("/task:-1", "task index '-1' is not a non-negative integer"),
        ("/task:*", "task index '*' is not a non-negative integer"),
        ("/job:j/replica:foo", "replica index 'foo' is not a non-negative integer"),  # TF
        ("/gpu:a", "device index 'a' is not a non-negative integer or '*'"),
        ("/device:gpu:-1", "device index '-1'"),
        ("/job:", "job is empty"),
        ("/job:1a", "job '1a' is not valid"),
        ("/job:worker/job:ps", "gives the job twice"),
        ("/task:0/task:1", "gives the task twice"),
        ("/cpu:0/gpu:0", "gives the device twice"),
        ("/device:gpu:0/cpu:0", "gives the device twice"),
        ("/job:muu/device:GPU:2/cpu:0", "gives the device twice"),  # TF
        ("/bar:muu/baz:2", "unknown part 'bar:muu'"),  # TF
        ("/device:MyFunnyDevice:2", "unknown device type 'MyFunnyDevice'"),
        ("/replica:0/replica:0", "gives the replica twice"),
    ],
)
def test_parse_errors_name_the_string(text, fragment):
    with pytest.raises(ClusterConfigError, match=re.escape(fragment)) as info:
        DeviceSpec.parse(text)
    assert repr(text) in str(info.value)


def test_parse_rejects_non_strings():
    with pytest.raises(ClusterConfigError, match="got 0 of type int"):
        DeviceSpec.parse(0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"task": -1}, "device spec: task must be a non-negative integer, got -1"),
        ({"task": "1"}, "device spec: task must be an int, got the string '1'"),
        ({"task": True}, "got True of type bool"),
        ({"device_index": 0}, "device index 0 without a device type"),
        ({"replica": -1}, "device spec: replica must be a non-negative integer, got -1"),
        ({"device_type": "tpu"}, "unknown device type 'tpu'"),
        ({"device_type": "gpu", "device_index": -2}, "device index must be a non-negative"),
        ({"job": "a/b"}, "job 'a/b' is not valid"),
        ({"job": ""}, "job is empty"),
    ],
)
def test_constructor_errors(kwargs, fragment):
    with pytest.raises(ClusterConfigError, match=re.escape(fragment)):
        DeviceSpec(**kwargs)


@given(
    st.one_of(st.none(), st.sampled_from(["worker", "ps", "chief"])),
    st.one_of(st.none(), st.integers(0, 99)),
    st.one_of(st.none(), st.sampled_from(["cpu", "gpu", "CPU", "GPU", "cuda"])),
    st.one_of(st.none(), st.integers(0, 7)),
    st.one_of(st.none(), st.integers(0, 3)),
)
def test_to_string_parse_round_trip_property(job, task, device_type, device_index, replica):
    if device_type is None:
        device_index = None
    spec = DeviceSpec(job, task, device_type, device_index, replica=replica)
    assert DeviceSpec.parse(spec.to_string()) == spec
    assert spec.merge(DeviceSpec()) == spec
    assert DeviceSpec().merge(spec) == spec


# ---------------------------------------------------------------- TensorFlow's own cases


def test_tf_construct_and_to_string():  # TF testConstructDeviceSpec
    d = DeviceSpec(job="j", replica=0, task=1, device_type="CPU", device_index=2)
    assert (d.job, d.replica, d.task, d.device_type, d.device_index) == ("j", 0, 1, "CPU", 2)
    assert d.to_string() == "/job:j/replica:0/task:1/device:CPU:2"
    assert DeviceSpec(device_type="GPU", device_index=0).to_string() == "/device:GPU:0"


def test_tf_replace():  # TF testReplace (DeviceSpecV2 is immutable: replace gives a copy)
    d = DeviceSpec().replace(job="foo")
    assert d.to_string() == "/job:foo"
    d = d.replace(task=3)
    assert d.to_string() == "/job:foo/task:3"
    d = d.replace(device_type="CPU", device_index=0)
    assert d.to_string() == "/job:foo/task:3/device:CPU:0"
    d = d.replace(task=None, replica=12)
    assert d.to_string() == "/job:foo/replica:12/device:CPU:0"
    d = d.replace(device_type="GPU", device_index=2)
    assert d.to_string() == "/job:foo/replica:12/device:GPU:2"
    d = d.replace(device_type=None, device_index=None)
    assert d.to_string() == "/job:foo/replica:12"
    wildcard = DeviceSpec(job="foo", replica=12, task=3, device_type="GPU")
    assert wildcard.to_string() == "/job:foo/replica:12/task:3/device:GPU:*"
    with pytest.raises(ClusterConfigError, match=r"no field\(s\) \['gpu'\]"):
        d.replace(gpu=1)


@pytest.mark.parametrize(
    ("text", "canonical", "parts"),
    [  # TF testParse: (replica, task, device_type, device_index)
        ("/job:foo/replica:0", "/job:foo/replica:0", ("foo", 0, None, None, None)),
        ("/replica:1/task:0/cpu:0", "/replica:1/task:0/device:CPU:0", (None, 1, 0, "CPU", 0)),
        (
            "/replica:1/task:0/device:CPU:0",
            "/replica:1/task:0/device:CPU:0",
            (None, 1, 0, "CPU", 0),
        ),
        ("/job:muu/device:GPU:2", "/job:muu/device:GPU:2", ("muu", None, None, "GPU", 2)),
    ],
)
def test_tf_parse(text, canonical, parts):
    d = DeviceSpec.from_string(text)
    assert d.to_string() == canonical
    assert (d.job, d.replica, d.task, d.device_type, d.device_index) == parts


@pytest.mark.parametrize(
    ("text", "canonical"),
    [  # TF testCanonicalName: any order in, one order out
        ("/job:foo/replica:0", "/job:foo/replica:0"),
        ("/replica:0/job:foo", "/job:foo/replica:0"),
        ("/job:foo/replica:0/task:0", "/job:foo/replica:0/task:0"),
        ("/job:foo/task:0/replica:0", "/job:foo/replica:0/task:0"),
        ("/device:CPU:0", "/device:CPU:0"),
        ("/device:GPU:2", "/device:GPU:2"),
        ("/job:foo/replica:0/task:0/device:GPU:0", "/job:foo/replica:0/task:0/device:GPU:0"),
        ("/device:GPU:0/task:0/replica:0/job:foo", "/job:foo/replica:0/task:0/device:GPU:0"),
    ],
)
def test_tf_canonical_name(text, canonical):
    assert DeviceSpec.parse(text).to_string() == canonical


def test_tf_nested_merge():  # TF device_test.testMerge: nested scopes, inner fields win
    scopes = ["/device:GPU:0", "/job:worker", "/device:CPU:0", "/job:ps"]
    expected = [
        "/device:GPU:0",
        "/job:worker/device:GPU:0",
        "/job:worker/device:CPU:0",
        "/job:ps/device:CPU:0",
    ]
    spec = DeviceSpec()
    for scope, want in zip(scopes, expected, strict=True):
        spec = spec.make_merged_spec(scope)
        assert spec.to_string() == want


def test_merge_rejects_other_types():
    with pytest.raises(ClusterConfigError, match="got 3 of type int"):
        DeviceSpec().merge(3)  # type: ignore[arg-type]


def test_device_only_and_names_task():
    spec = DeviceSpec.parse("/job:worker/replica:0/task:1/device:GPU:0")
    assert spec.names_task and not spec.device_only().names_task
    assert spec.device_only().to_string() == "/device:GPU:0"


def test_a_device_type_it_does_not_place_on_gets_one_message_in_both_forms():
    messages = []
    for text in ("/tpu:1", "/device:tpu:1"):
        with pytest.raises(ClusterConfigError) as info:
            DeviceSpec.parse(text)
        messages.append(str(info.value).replace(repr(text), "STRING"))
    assert messages[0] == messages[1], messages
    assert "unknown device type 'tpu'; use 'CPU' or 'GPU'" in messages[0]
