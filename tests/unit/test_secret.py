"""The cluster secret: where :func:`load_secret` looks and in which order, what it refuses,
and the warning (a log line) for a secret file other users can read."""

from __future__ import annotations

import logging
import os
import re
import stat
import warnings
from pathlib import Path

import pytest

from tensorfleet.environment import SECRET_FILE_VAR, SECRET_VAR
from tensorfleet.errors import AuthenticationError
from tensorfleet.wire.secret import MIN_SECRET_LENGTH, generate_secret, load_secret

ARG = "secret-from-the-argument-000"
FILE = "secret-from-the-file-0000000"
ENV = "secret-from-the-environment0"
ENV_FILE = "secret-from-the-env-file-000"


def _secret_file(directory: Path, name: str, text: str, mode: int = 0o600) -> Path:
    path = directory / name
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.fixture
def sources(tmp_path: Path) -> dict[str, object]:
    """Every source at once, each with its own secret."""
    return {
        "secret_file": _secret_file(tmp_path, "arg-file", FILE + "\n"),
        "environ": {
            SECRET_VAR: ENV,
            SECRET_FILE_VAR: str(_secret_file(tmp_path, "env-file", ENV_FILE + "\n")),
        },
    }


def test_the_argument_comes_first(sources: dict[str, object]) -> None:
    assert load_secret(ARG, **sources) == ARG.encode()


def test_then_the_secret_file_argument(sources: dict[str, object]) -> None:
    assert load_secret(None, **sources) == FILE.encode()


def test_then_the_environment_variable(sources: dict[str, object]) -> None:
    assert load_secret(None, None, environ=sources["environ"]) == ENV.encode()


def test_then_the_environment_file(sources: dict[str, object]) -> None:
    environ = dict(sources["environ"])
    del environ[SECRET_VAR]
    assert load_secret(environ=environ) == ENV_FILE.encode()
    # An empty variable counts as unset.
    assert load_secret(environ={**environ, SECRET_VAR: ""}) == ENV_FILE.encode()


def test_bytes_are_accepted_and_whitespace_is_stripped(tmp_path: Path) -> None:
    assert load_secret(ARG.encode() + b"\n", environ={}) == ARG.encode()
    assert load_secret(f"  {ARG}\t\n", environ={}) == ARG.encode()
    path = _secret_file(tmp_path, "secret", f"\n{FILE}\r\n\n")
    assert load_secret(secret_file=path, environ={}) == FILE.encode()


def test_secret_exactly_at_the_minimum_length_is_accepted() -> None:
    assert load_secret("x" * MIN_SECRET_LENGTH, environ={}) == b"x" * MIN_SECRET_LENGTH


@pytest.mark.parametrize(
    ("kwargs", "source"),
    [
        ({"secret": "x" * (MIN_SECRET_LENGTH - 1)}, "the secret argument"),
        ({"secret": "   "}, "the secret argument"),
        ({"environ": {SECRET_VAR: "short"}}, f"${SECRET_VAR}"),
    ],
)
def test_too_short_secret_names_its_source_and_length(kwargs: dict, source: str) -> None:
    kwargs.setdefault("environ", {})
    with pytest.raises(AuthenticationError) as excinfo:
        load_secret(**kwargs)
    text = str(excinfo.value)
    assert f"from {source} is" in text
    assert f"use at least {MIN_SECRET_LENGTH}" in text


def test_too_short_secret_in_a_file_names_the_file(tmp_path: Path) -> None:
    path = _secret_file(tmp_path, "secret", "short\n")
    with pytest.raises(AuthenticationError, match=re.escape(f"secret file {path} is 5 bytes")):
        load_secret(secret_file=path, environ={})


def test_missing_secret_says_how_to_set_one() -> None:
    with pytest.raises(AuthenticationError) as excinfo:
        load_secret(environ={})
    text = str(excinfo.value)
    assert text.startswith("no cluster secret")
    assert SECRET_VAR in text
    assert SECRET_FILE_VAR in text
    assert "--secret-file" in text


def test_unreadable_secret_file_is_an_authentication_error(tmp_path: Path) -> None:
    missing = tmp_path / "does-not-exist"
    with pytest.raises(
        AuthenticationError, match=re.escape(f"cannot read the secret file {missing}")
    ):
        load_secret(secret_file=missing, environ={SECRET_VAR: ENV})
    with pytest.raises(AuthenticationError, match="cannot read the secret file"):
        load_secret(environ={SECRET_FILE_VAR: str(missing)})


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o601])
def test_secret_file_readable_by_others_is_a_clean_log_warning(
    tmp_path: Path, mode: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A log line naming the file, its mode and the fix; not a Python warning, which would
    show a tensorfleet source line (load_secret is called deep inside Server and the CLI)."""
    path = _secret_file(tmp_path, "secret", FILE, mode=mode)
    caplog.set_level(logging.WARNING, logger="tensorfleet.security")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_secret(secret_file=path, environ={}) == FILE.encode()
        load_secret(environ={SECRET_FILE_VAR: str(path)})
    first, second = caplog.records
    assert first.levelno == logging.WARNING and first.name == "tensorfleet.security"
    assert first.getMessage() == (
        f"tensorfleet: the secret file {path} can be read by other users "
        f"(mode {stat.filemode(stat.S_IFREG | mode)}); run `chmod 600 {path}`"
    )
    assert second.getMessage() == first.getMessage()


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_private_secret_file_does_not_warn(
    tmp_path: Path, mode: int, caplog: pytest.LogCaptureFixture
) -> None:
    path = _secret_file(tmp_path, "secret", FILE, mode=mode)
    caplog.set_level(logging.DEBUG, logger="tensorfleet.security")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_secret(secret_file=path, environ={}) == FILE.encode()
    assert not caplog.records


def test_process_environment_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_VAR, ENV)
    monkeypatch.delenv(SECRET_FILE_VAR, raising=False)
    assert load_secret() == ENV.encode()
    assert os.environ[SECRET_VAR] == ENV


def test_generated_secrets_are_random_hex_and_long_enough() -> None:
    first, second = generate_secret(), generate_secret()
    assert first != second
    assert re.fullmatch(r"[0-9a-f]{64}", first)
    assert load_secret(first, environ={}) == first.encode()
