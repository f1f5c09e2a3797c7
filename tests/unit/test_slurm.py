"""Slurm's host lists and tasks-per-node counts, expanded as Slurm does."""

from __future__ import annotations

import re

import pytest

from tensorfleet.cluster import block_layout, expand_hostlist, expand_tasks_per_node
from tensorfleet.errors import ClusterConfigError


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        (
            "node[01-03,07],gpu5,n[1-2]-ib",
            ["node01", "node02", "node03", "node07", "gpu5", "n1-ib", "n2-ib"],
        ),
        ("node1", ["node1"]),
        ("a,b,c", ["a", "b", "c"]),
        ("", []),
        ("  ", []),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("n[001-003]", ["n001", "n002", "n003"]),
        ("n[007]", ["n007"]),
        ("n[3,1]", ["n3", "n1"]),
        ("[1-2]", ["1", "2"]),
        ("node-[1-2].ib.example.org", ["node-1.ib.example.org", "node-2.ib.example.org"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("a[1-2], b[3]", ["a1", "a2", "b3"]),
        ("n[1 - 2]", None),  # spaces inside a range are not Slurm syntax
    ],
)
def test_expand_hostlist(hostlist, hosts):
    if hosts is None:
        with pytest.raises(ClusterConfigError):
            expand_hostlist(hostlist)
    else:
        assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    ("hostlist", "fragment"),
    [
        ("n[1-2", "has a '[' without ']'"),
        ("n1-2]", "has a ']' without '[' at position 4"),
        ("n[[1]]", "has nested brackets at position 2"),
        ("n[2-1]", "range '2-1' runs backwards"),
        ("n[a-b]", "'a-b' in [a-b] is not a number or a range 'lo-hi'"),
        ("n[]", "'' in [] is not a number"),
        ("n[1,]", "'' in [1,] is not a number"),
        ("n[1-]", "'1-' in [1-] is not a number"),
        ("a,,b", "has an empty item"),
        (",a", "has an empty item"),
        ("a,", "has an empty item"),
        ("bad!host", "'bad!host' is not a host name"),
        ("n[1-2]x!", "'x!' is not a host name"),
        ("b@d[1-2]", "'b@d' is not part of a host name"),
        ("n[0-99999999]", "expands to more than 1000000 hosts"),
        ("a[0-999]b[0-9999]", "expands to more than 1000000 hosts"),
    ],
)
def test_expand_hostlist_errors(hostlist, fragment):
    with pytest.raises(ClusterConfigError, match=re.escape(fragment)) as info:
        expand_hostlist(hostlist)
    assert repr(hostlist) in str(info.value)


def test_expand_hostlist_rejects_non_strings():
    with pytest.raises(ClusterConfigError, match="must be a str"):
        expand_hostlist(["a"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "counts"),
    [
        ("2(x3),1", [2, 2, 2, 1]),
        ("4", [4]),
        ("1,2,3", [1, 2, 3]),
        ("3(x2)", [3, 3]),
        ("1(x1),2(x2)", [1, 2, 2]),
        ("", []),
    ],
)
def test_expand_tasks_per_node(text, counts):
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("2(x)", "'2(x)' is not 'N' or 'N(xM)'"),
        ("x", "'x' is not"),
        ("2(3)", "'2(3)' is not"),
        ("2(x3", "'2(x3' is not"),
        ("-1", "'-1' is not"),
        ("2,,1", "'' is not"),
        ("1(x2000000)", "describes more than 1000000 nodes"),
    ],
)
def test_expand_tasks_per_node_errors(text, fragment):
    with pytest.raises(ClusterConfigError, match=re.escape(fragment)) as info:
        expand_tasks_per_node(text)
    assert repr(text) in str(info.value)


def test_expand_tasks_per_node_rejects_non_strings():
    with pytest.raises(ClusterConfigError, match="must be a str"):
        expand_tasks_per_node(4)  # type: ignore[arg-type]


def test_block_layout():
    assert block_layout(["a", "b", "c"], [2, 1, 3]) == [
        ("a", 0),
        ("a", 1),
        ("b", 0),
        ("c", 0),
        ("c", 1),
        ("c", 2),
    ]
    assert block_layout([], []) == []


def test_block_layout_needs_one_count_per_node():
    with pytest.raises(ClusterConfigError, match=re.escape("names 2 nodes (['a', 'b'])")):
        block_layout(["a", "b"], [1, 1, 1])
