"""ClusterSpec, TaskId and addresses: TensorFlow's semantics, and clear errors for bad input."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensorfleet.cluster import Address, ClusterSpec, TaskId, parse_address
from tensorfleet.errors import ClusterConfigError

DENSE = {"worker": ["w0:2222", "w1:2222", "w2:2222"], "ps": ["ps0:2222", "ps1:2222"]}


# --- TaskId -------------------------------------------------------------------------------


def test_task_id_str_and_parse():
    assert str(TaskId("worker", 1)) == "worker:1"
    assert TaskId.parse("worker:1") == TaskId("worker", 1)
    assert TaskId.parse("ps:0").job == "ps"
    assert TaskId.parse("chief:10").index == 10
    assert TaskId.parse(str(TaskId("evaluator", 3))) == TaskId("evaluator", 3)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("worker", "'job:index'"),
        ("", "'job:index'"),
        (5, "'job:index'"),
        ("worker:", "task index must be a non-negative integer, got ''"),
        ("worker:x", "got 'x'"),
        ("worker:-1", "got '-1'"),
        (":1", "job name is empty"),
        ("a/b:1", "job name 'a/b' is not valid"),
    ],
)
def test_task_id_parse_errors(text, fragment):
    with pytest.raises(ClusterConfigError, match=re.escape(fragment)):
        TaskId.parse(text)


# --- construction and queries ---------------------------------------------------------------


def test_dense_spec_queries():
    spec = ClusterSpec(DENSE)
    assert spec.jobs == ["ps", "worker"]
    assert spec.num_tasks("worker") == 3
    assert spec.num_tasks("ps") == 2
    assert spec.task_indices("worker") == [0, 1, 2]
    assert spec.task_address("worker", 2) == "w2:2222"
    assert spec.task_address("ps", 0) == "ps0:2222"
    assert spec.job_tasks("worker") == ["w0:2222", "w1:2222", "w2:2222"]
    assert spec.as_dict() == {
        "ps": ["ps0:2222", "ps1:2222"],
        "worker": ["w0:2222", "w1:2222", "w2:2222"],
    }
    assert list(spec.as_dict()) == ["ps", "worker"]
    assert list(spec.tasks()) == [
        TaskId("ps", 0),
        TaskId("ps", 1),
        TaskId("worker", 0),
        TaskId("worker", 1),
        TaskId("worker", 2),
    ]


def test_tuple_of_addresses_is_a_dense_job():
    assert ClusterSpec({"worker": ("a:1", "b:2")}).as_dict() == {"worker": ["a:1", "b:2"]}


@pytest.mark.parametrize(
    "worker",
    [
        {1: "w1:2222", 3: "w3:2222"},
        {"1": "w1:2222", "3": "w3:2222"},
        {3: "w3:2222", "1": "w1:2222"},
    ],
)
def test_sparse_spec_like_tensorflow(worker):
    spec = ClusterSpec({"ps": ["ps0:2222"], "worker": worker})
    assert spec.num_tasks("worker") == 2
    assert spec.task_indices("worker") == [1, 3]
    assert spec.task_address("worker", 3) == "w3:2222"
    assert spec.job_tasks("worker") == [None, "w1:2222", None, "w3:2222"]
    assert spec.as_dict() == {"ps": ["ps0:2222"], "worker": {1: "w1:2222", 3: "w3:2222"}}
    assert list(spec.tasks()) == [TaskId("ps", 0), TaskId("worker", 1), TaskId("worker", 3)]


def test_sparse_dict_that_is_dense_becomes_a_list_in_as_dict():
    # TensorFlow returns a list whenever the indices are exactly 0..n-1.
    spec = ClusterSpec({"worker": {1: "b:1", 0: "a:1"}})
    assert spec.as_dict() == {"worker": ["a:1", "b:1"]}
    assert spec == ClusterSpec({"worker": ["a:1", "b:1"]})


def test_job_without_tasks():
    spec = ClusterSpec({"ps": [], "worker": ["a:1"]})
    assert spec.as_dict() == {"ps": {}, "worker": ["a:1"]}
    assert spec.num_tasks("ps") == 0
    assert spec.task_indices("ps") == []
    assert spec.job_tasks("ps") == []
    assert spec.jobs == ["ps", "worker"]


def test_empty_spec_is_falsy():
    assert not ClusterSpec({})
    assert ClusterSpec({}).jobs == []
    assert list(ClusterSpec({}).tasks()) == []
    assert ClusterSpec({"worker": ["a:1"]})


def test_copy_from_spec_and_equality():
    spec = ClusterSpec(DENSE)
    copy = ClusterSpec(spec)
    assert copy == spec
    assert copy is not spec
    assert hash(copy) == hash(spec)
    assert spec == DENSE
    assert spec != {"worker": ["w0:2222"]}
    assert spec != {"bad": "not a spec"}
    assert spec != ClusterSpec({"worker": ["w0:2222"]})
    assert spec != 5
    assert len({spec, copy}) == 1


def test_as_dict_is_a_copy():
    spec = ClusterSpec(DENSE)
    spec.as_dict()["worker"].append("x:1")  # type: ignore[union-attr]
    spec.jobs.append("x")
    assert spec.num_tasks("worker") == 3
    assert spec.jobs == ["ps", "worker"]


def test_input_mutation_does_not_leak():
    tasks = {"worker": ["a:1"]}
    spec = ClusterSpec(tasks)
    tasks["worker"].append("b:1")
    assert spec.num_tasks("worker") == 1


def test_repr():
    spec = ClusterSpec({"ps": ["a:1"], "worker": {2: "b:1"}})
    assert repr(spec) == "ClusterSpec({'ps': ['a:1'], 'worker': {2: 'b:1'}})"


@pytest.mark.parametrize(
    "cluster",
    [
        DENSE,
        {"ps": ["ps0:2222"], "worker": {1: "w1:2222", 5: "w5:2222"}},
        {"worker": ["[::1]:2222", "[fe80::1]:2223", "10.0.0.1:1"], "ps": {}},
        {},
    ],
)
def test_json_round_trip(cluster):
    spec = ClusterSpec(cluster)
    text = spec.to_json()
    assert ClusterSpec.from_json(text) == spec
    assert ClusterSpec.from_json(spec.to_json(indent=2)) == spec


def test_to_json_exact():
    spec = ClusterSpec({"worker": {1: "b:1"}, "ps": ["a:1"]})
    assert spec.to_json() == '{"ps": ["a:1"], "worker": {"1": "b:1"}}'


# --- addresses -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("worker0:2222", Address("worker0", 2222)),
        ("node-1.example.org:1", Address("node-1.example.org", 1)),
        ("my_host:65535", Address("my_host", 65535)),
        ("10.0.0.1:2222", Address("10.0.0.1", 2222)),
        ("[::1]:2222", Address("::1", 2222)),
        ("[2001:db8::7]:80", Address("2001:db8::7", 80)),
    ],
)
def test_parse_address(text, expected):
    assert parse_address(text) == expected
    assert str(parse_address(text)) == text


# --- malformed input -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cluster", "fragment"),
    [
        # not a dict
        (["a:1"], "must be a dict mapping job names"),
        ("a:1", "got 'a:1' of type str"),
        (None, "got None of type NoneType"),
        (5, "got 5 of type int"),
        # job names
        ({"": ["a:1"]}, "job name is empty"),
        ({1: ["a:1"]}, "job name must be a string such as 'worker' or 'ps', got 1 of type int"),
        ({"bad:name": ["a:1"]}, "job name 'bad:name' is not valid"),
        ({"1worker": ["a:1"]}, "job name '1worker' is not valid"),
        ({"wor ker": ["a:1"]}, "job name 'wor ker' is not valid"),
        # job values
        ({"worker": "a:1"}, "job 'worker' must map to a list of 'host:port' addresses"),
        ({"worker": 5}, "got 5"),
        ({"worker": None}, "got None"),
        ({"worker": ["a:1", None]}, "task worker:1 has no address (None)"),
        # addresses
        ({"worker": ["host"]}, "'host' has no port"),
        ({"worker": ["host:"]}, "port '' is not an integer"),
        ({"worker": ["host:abc"]}, "port 'abc' is not an integer"),
        ({"worker": ["host:-1"]}, "port '-1' is not an integer"),
        ({"worker": ["host:2222 "]}, "port '2222 ' is not an integer"),
        ({"worker": ["host:0"]}, "port 0 is out of range; use 1..65535"),
        ({"worker": ["host:65536"]}, "port 65536 is out of range; use 1..65535"),
        ({"worker": [":2222"]}, "':2222' has an empty host"),
        ({"worker": ["::1:2222"]}, "IPv6 addresses must be in brackets"),
        ({"worker": ["[::1]2222"]}, "is not '[ipv6]:port'"),
        ({"worker": ["[::1:2222"]}, "is not '[ipv6]:port'"),
        ({"worker": ["[host]:2222"]}, "'host' inside the brackets is not an IPv6 address"),
        ({"worker": ["tcp://h:2222"]}, "has a URL scheme"),
        ({"worker": ["h h:2222"]}, "host 'h h' may only hold"),
        ({"worker": [2222]}, "address of task worker:0 must be a 'host:port' string, got 2222"),
        ({"worker": {0: b"a:1"}}, "got b'a:1' of type bytes"),
        # duplicate addresses
        ({"worker": ["a:1", "a:1"]}, "tasks worker:0 and worker:1 both have address 'a:1'"),
        ({"ps": ["a:1"], "worker": ["a:1"]}, "tasks ps:0 and worker:0 both have address 'a:1'"),
        ({"worker": ["A:1", "a:1"]}, "both have address 'a:1'"),
        ({"worker": ["[::1]:1", "[0::1]:1"]}, "both have address '[0::1]:1'"),
        # task indices
        ({"worker": {-1: "a:1"}}, "task index must be a non-negative integer, got -1"),
        ({"worker": {"-1": "a:1"}}, "got '-1' of type str"),
        ({"worker": {"x": "a:1"}}, "got 'x' of type str"),
        ({"worker": {1.0: "a:1"}}, "got 1.0 of type float"),
        ({"worker": {True: "a:1"}}, "got True of type bool"),
        ({"worker": {1: "a:1", "1": "b:1"}}, "job 'worker' lists task 1 twice"),
    ],
)
def test_malformed_cluster(cluster, fragment):
    with pytest.raises(ClusterConfigError, match=re.escape(fragment)):
        ClusterSpec(cluster)


def test_errors_are_value_errors():
    with pytest.raises(ValueError):
        ClusterSpec({"worker": ["nope"]})


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (
            lambda s: s.num_tasks("chief"),
            "no job 'chief' in the cluster; its jobs are ['ps', 'worker']",
        ),
        (lambda s: s.task_indices("chief"), "no job 'chief'"),
        (lambda s: s.job_tasks("chief"), "no job 'chief'"),
        (lambda s: s.task_address("chief", 0), "no job 'chief'"),
        (lambda s: s.num_tasks(["worker"]), "no job ['worker']"),
        (lambda s: s.task_address("ps", 1), "job 'ps' has no task 1; its task indices are [0]"),
        (
            lambda s: s.task_address("worker", 0),
            "job 'worker' has no task 0; its task indices are [1, 3]",
        ),
        (lambda s: s.task_address("worker", 2), "job 'worker' has no task 2"),
        (lambda s: s.task_address("worker", -1), "must be a non-negative integer, got -1"),
        (lambda s: s.task_address("worker", "x"), "got 'x' of type str"),
    ],
)
def test_lookup_errors(call, fragment):
    spec = ClusterSpec({"ps": ["ps0:1"], "worker": {1: "w1:1", 3: "w3:1"}})
    with pytest.raises(ClusterConfigError, match=re.escape(fragment)):
        call(spec)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("{", "cluster spec JSON is not valid JSON"),
        ("", "cluster spec JSON is not valid JSON"),
        ('["a:1"]', "must be a dict mapping job names"),
        ('{"worker": ["a:1"], "worker": ["b:1"]}', "key 'worker' appears twice"),
        ('{"worker": {"1": "a:1", "1": "b:1"}}', "key '1' appears twice"),
        ('{"worker": ["a"]}', "'a' has no port"),
        (5, "cluster spec JSON must be JSON text, got int"),
    ],
)
def test_from_json_errors(text, fragment):
    with pytest.raises(ClusterConfigError, match=re.escape(fragment)):
        ClusterSpec.from_json(text)


# --- properties ----------------------------------------------------------------------------

_job_names = st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,8}", fullmatch=True)
_clusters = st.dictionaries(
    _job_names,
    st.one_of(
        st.integers(0, 4).map(lambda n: list(range(n))),
        st.sets(st.integers(0, 50), max_size=5).map(sorted),
    ),
    max_size=4,
)


@given(_clusters, st.booleans())
def test_json_round_trip_property(layout, sparse):
    # Give every task a distinct address; write jobs sparse or dense.
    ports = iter(range(1, 10_000))
    cluster = {
        job: {i: f"h{i}:{next(ports)}" for i in indices}
        if sparse
        else [f"h{i}:{next(ports)}" for i in range(len(indices))]
        for job, indices in layout.items()
    }
    spec = ClusterSpec(cluster)
    assert ClusterSpec.from_json(spec.to_json()) == spec
    assert ClusterSpec(spec.as_dict()) == spec
    assert [str(t) for t in spec.tasks()] == [
        f"{job}:{i}" for job in sorted(cluster) for i in spec.task_indices(job)
    ]
    for job in spec.jobs:
        tasks = spec.job_tasks(job)
        assert [i for i, a in enumerate(tasks) if a is not None] == spec.task_indices(job)
