"""The cluster secret: where it comes from, and how it is checked before use.

Every message between tasks is authenticated with keys derived from one secret shared by
the whole cluster. The launcher generates a fresh one per local cluster; on several machines
users give it by ``TENSORFLEET_SECRET`` or a file (``--secret-file`` /
``TENSORFLEET_SECRET_FILE``) that only its owner can read.

A secret file that other users can read is used, and said in a WARNING line on the
``tensorfleet.security`` logger (as the service's security events are), not with
``warnings.warn``: the secret is loaded deep inside ``Server``, ``tensorfleet server`` and
the launcher, so a warning would point at a tensorfleet source line, not at anything the
user wrote; the line names the file, its mode and the ``chmod`` that fixes it.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from tensorfleet import environment
from tensorfleet.errors import AuthenticationError

log = logging.getLogger("tensorfleet.security")

#: Shortest secret accepted; shorter ones are too easy to guess offline.
MIN_SECRET_LENGTH = 16


class ClusterSecret(bytes):
    """The secret's bytes, and where they came from (``source``: ``$TENSORFLEET_SECRET``,
    ``secret file PATH`` ...), so that a peer's refusal ("secret mismatch") can say which
    secret this task used; everything else takes it as the ``bytes`` it is."""

    source: str

    def __new__(cls, value: bytes, source: str) -> ClusterSecret:
        secret = super().__new__(cls, value)
        secret.source = source
        return secret

    def __repr__(self) -> str:  # never the bytes themselves, in a log or a traceback
        return f"ClusterSecret(<{len(self)} bytes from {self.source}>)"

    __str__ = __repr__  # nor in a message that formats it by mistake


def generate_secret() -> str:
    """A fresh random secret (64 hex characters, 256 bits), as the launcher hands out."""
    return secrets.token_hex(32)


def load_secret(
    secret: str | bytes | None = None,
    secret_file: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> ClusterSecret:
    """Return the cluster secret from, in order: ``secret``, ``secret_file``,
    ``TENSORFLEET_SECRET``, ``TENSORFLEET_SECRET_FILE``.

    Raises :class:`AuthenticationError` naming every place looked at when none has one, or
    when the secret is shorter than :data:`MIN_SECRET_LENGTH`. Logs a warning when a secret
    file can be read by other users (and uses it). The bytes come as a :class:`ClusterSecret`,
    which says where they came from.
    """
    env = environment.environ() if environ is None else environ
    source = secret.source if isinstance(secret, ClusterSecret) else "the secret argument"
    value: str | bytes | None = secret
    if value is None and secret_file is not None:
        value, source = _read_secret_file(Path(secret_file)), f"secret file {secret_file}"
    if value is None and env.get(environment.SECRET_VAR):
        value, source = env[environment.SECRET_VAR], f"${environment.SECRET_VAR}"
    if value is None and env.get(environment.SECRET_FILE_VAR):
        path = Path(env[environment.SECRET_FILE_VAR])
        value, source = (
            _read_secret_file(path),
            f"secret file {path} (${environment.SECRET_FILE_VAR})",
        )
    if value is None:
        raise AuthenticationError(
            "no cluster secret: every tensorfleet task needs the same secret to authenticate its "
            f"messages. Set ${environment.SECRET_VAR} (e.g. to the output of "
            "`python -c 'import secrets; print(secrets.token_hex(32))'`), or set "
            f"${environment.SECRET_FILE_VAR} to a file holding it (--secret-file of `tensorfleet "
            "server`, `launch` and the examples); `tensorfleet launch` sets one for local clusters."
        )
    raw = value.encode() if isinstance(value, str) else bytes(value)
    raw = raw.strip()
    if len(raw) < MIN_SECRET_LENGTH:
        raise AuthenticationError(
            f"the cluster secret from {source} is {len(raw)} bytes long; use at least "
            f"{MIN_SECRET_LENGTH} (a random 64-character hex string is best)"
        )
    return ClusterSecret(raw, source)


def _read_secret_file(path: Path) -> str:
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as exc:
        raise AuthenticationError(f"cannot read the secret file {path}: {exc.strerror}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning(
            "tensorfleet: the secret file %s can be read by other users (mode %s); run "
            "`chmod 600 %s`",
            path,
            stat.filemode(mode),
            path,
        )
    return text
