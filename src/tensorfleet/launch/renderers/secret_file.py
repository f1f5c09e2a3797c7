"""The cluster secret as a file only its owner can read, for job scripts and manifests.

A secret on a command line is visible to every user of the machine (``ps``, ``/proc``) and
lands in shell histories and job databases (``sacct``, ``scontrol show job``), so the
renderers pass a *path* instead: the tasks read it through ``TENSORFLEET_SECRET_FILE``.
:func:`ensure_secret_file` creates that file with a fresh secret when it does not exist (and
its missing directories, mode 700, so that ``--secret-file ~/.tensorfleet/secret`` works on
a fresh account), and refuses one that other users could read.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from tensorfleet.errors import AuthenticationError
from tensorfleet.wire.secret import generate_secret, load_secret

log = logging.getLogger(__name__)


def ensure_secret_file(path: str | os.PathLike[str]) -> tuple[Path, bytes]:
    """The absolute path of the secret file and the secret it holds.

    A missing file is created with a fresh random secret and mode 600 (created that way, so
    it is never readable by others, even for a moment); its missing directories are created
    first, each with mode 700 (only the owner may list or enter them), and a warning names
    them. An existing file must be a regular
    file that neither the group nor others may access (``chmod 600``) and hold a secret of at
    least 16 bytes; otherwise :class:`~tensorfleet.errors.AuthenticationError` says which and
    how to fix it.
    """
    target = Path(path).expanduser().absolute()
    if not target.exists():
        _make_directories(target)
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise AuthenticationError(
                f"cannot create the secret file {target}: {exc.strerror}; give a --secret-file "
                "in a directory you can write"
            ) from exc
        with os.fdopen(fd, "w") as file:
            file.write(generate_secret() + "\n")
    mode = target.stat().st_mode
    if not stat.S_ISREG(mode):
        raise AuthenticationError(f"the secret file {target} is not a regular file")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AuthenticationError(
            f"the secret file {target} can be accessed by other users (mode "
            f"{stat.filemode(mode)}); run `chmod 600 {target}` and try again"
        )
    return target, load_secret(secret_file=target)


def _make_directories(target: Path) -> None:
    """Create the missing directories above ``target``, each with mode 700, and say so."""
    missing = [parent for parent in target.parents if not parent.exists()]
    for directory in reversed(missing):  # outermost first
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:
            continue  # made meanwhile (another process): the file's own checks still apply
        except OSError as exc:
            raise AuthenticationError(
                f"cannot create the secret file {target}: cannot create its directory "
                f"{directory}: {exc.strerror}; create it yourself (mkdir -m 700 {directory}) "
                "or give a --secret-file in a directory you can write"
            ) from exc
        directory.chmod(0o700)  # mkdir's mode is masked by the umask; 700 is meant here
        log.warning(
            "tensorfleet: created the directory %s (mode 700) for the secret file", directory
        )
