"""``tensorfleet server``'s task options: the cluster from --cluster or the classic host lists,
--job/--task checked together and against TF_CONFIG, ps tasks only, errors in the command's
own terms; and the security options it shares with the example."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from tensorfleet.cluster import ClusterSpec
from tensorfleet.errors import AuthenticationError, ClusterConfigError
from tensorfleet.launch.cli import build_parser, main
from tensorfleet.launch.task_flags import add_security_flags, resolve_server_task, task_security

CLUSTER = {"ps": ["127.0.0.1:47301"], "worker": ["127.0.0.1:47302", "127.0.0.1:47303"]}
CLUSTER_JSON = json.dumps(CLUSTER)
HOSTS = ["--ps_hosts=127.0.0.1:47301", "--worker_hosts=127.0.0.1:47302,127.0.0.1:47303"]


def server_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["server", *argv])


def tf_config(job: str, index: int) -> dict[str, str]:
    return {"TF_CONFIG": json.dumps({"cluster": CLUSTER, "task": {"type": job, "index": index}})}


def refused(*argv: str, environ: dict[str, str] | None = None, own_terms: bool = True) -> str:
    """The error resolve_server_task raises for these options; with ``own_terms``, checked
    for the terms of other programs (resolve_task's arguments, the scripts' flags)."""
    with pytest.raises(ClusterConfigError) as caught:
        resolve_server_task(server_args(*argv), environ or {})
    text = str(caught.value)
    if own_terms:
        assert "resolve_task" not in text and "job_name" not in text, text
        assert "allow_none" not in text and "task_index" not in text, text
    return text


@pytest.mark.parametrize(
    "argv",
    [
        ["--cluster", CLUSTER_JSON, "--job", "ps", "--task", "0"],
        [*HOSTS, "--job", "ps", "--task", "0"],
        ["--ps-hosts", "127.0.0.1:47301", "--worker-hosts", "127.0.0.1:47302,127.0.0.1:47303"]
        + ["--job_name", "ps", "--task_index", "0"],
    ],
    ids=["cluster", "host-lists", "classic-spellings"],
)
def test_the_cluster_from_json_or_the_classic_host_lists(argv: list[str]) -> None:
    task = resolve_server_task(server_args(*argv), {})
    assert (task.cluster, task.job, task.index) == (ClusterSpec(CLUSTER), "ps", 0)


def test_without_options_the_task_comes_from_tf_config() -> None:
    task = resolve_server_task(server_args(), tf_config("ps", 0))
    assert (task.cluster, task.job, task.index, task.source) == (
        ClusterSpec(CLUSTER),
        "ps",
        0,
        "TF_CONFIG",
    )


def test_nothing_given_names_the_commands_own_options() -> None:
    text = refused()
    assert "give --job ps --task N with --cluster" in text, text
    assert "set TF_CONFIG" in text, text


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--cluster", CLUSTER_JSON], "got --cluster but not --job, --task"),
        (["--job", "ps", "--task", "0"], "got --job, --task but not --cluster"),
        ([*HOSTS, "--task", "0"], "got --ps_hosts/--worker_hosts, --task but not --job"),
        (["--cluster", CLUSTER_JSON, *HOSTS, "--job", "ps", "--task", "0"], "both --cluster and"),
        (["--cluster", CLUSTER_JSON, "--job", "ps", "--task", "-1"], "--task must be"),
    ],
)
def test_incomplete_or_contradictory_options_are_refused(argv: list[str], fragment: str) -> None:
    text = refused(*argv)
    assert fragment in text, text


@pytest.mark.parametrize(
    ("argv", "environ"),
    [
        (["--cluster", CLUSTER_JSON, "--job", "worker", "--task", "0"], {}),
        ([*HOSTS, "--job", "worker", "--task", "1"], {}),
        ([], tf_config("worker", 1)),
    ],
    ids=["cluster", "host-lists", "tf-config"],
)
def test_a_worker_task_is_refused(argv: list[str], environ: dict[str, str]) -> None:
    text = refused(*argv, environ=environ, own_terms=False)  # it shows the script's flags
    assert re.search(r"tensorfleet server runs ps tasks, but this task is worker:\d", text), text
    assert "run your training script for worker tasks" in text, text


def test_options_that_disagree_with_tf_config_are_refused() -> None:
    text = refused(*HOSTS, "--job", "ps", "--task", "0", environ=tf_config("worker", 1))
    assert "the flags and TF_CONFIG disagree" in text, text
    assert "drop the --job/--task/--cluster (or --ps_hosts/--worker_hosts) flags" in text, text


def test_options_that_agree_with_tf_config_are_accepted() -> None:
    argv = ["--cluster", CLUSTER_JSON, "--job", "ps", "--task", "0"]
    task = resolve_server_task(server_args(*argv), tf_config("ps", 0))
    assert (task.job, task.index, task.source) == ("ps", 0, "flags")


def test_the_command_reports_a_worker_task_and_exits_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert main(["server", "--cluster", CLUSTER_JSON, "--job", "worker", "--task", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tensorfleet: error: tensorfleet server runs ps tasks"), err


def test_security_options_read_the_secret_file_and_encrypt(tmp_path, monkeypatch) -> None:
    for name in ("TENSORFLEET_SECRET", "TENSORFLEET_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    secret.chmod(0o600)
    parser = argparse.ArgumentParser()
    add_security_flags(parser)
    security = task_security(parser.parse_args(["--secret-file", str(secret), "--encrypt"]))
    assert (security.secret, security.encrypt) == (b"0123456789abcdef0123456789abcdef", True)
    assert task_security(parser.parse_args(["--secret-file", str(secret)])).encrypt is None
    with pytest.raises(AuthenticationError, match="no cluster secret"):
        task_security(parser.parse_args([]))


def test_the_idle_timeout_is_a_flag_of_the_command() -> None:
    """A ps no worker ever reached waited its 30 minutes with no way to say less from the
    command line (a new user's trial); ``--idle-timeout`` sets it."""
    from tensorfleet.launch.cli import server_config_fields
    from tensorfleet.ps.service_settings import ServiceSettings

    parser = build_parser()
    fields = server_config_fields(parser.parse_args(["server", "--idle-timeout", "90"]))
    assert fields["idle_timeout_s"] == 90.0
    default = server_config_fields(parser.parse_args(["server"]))["idle_timeout_s"]
    assert default == ServiceSettings.idle_timeout_s == 1800.0
