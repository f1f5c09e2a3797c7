"""MNIST and Fashion-MNIST: find the idx files, download them verified, read them strictly.

The examples and tests of tensorfleet train on these two data sets because they are small,
well known and (for Fashion-MNIST) packaged by Debian. Three things matter here:

* **Where the files come from.** An explicit ``data_dir`` wins and is the only place looked
  at; otherwise the system copy (``/usr/share/datasets/<name>``, where Debian's
  ``dataset-fashion-mnist`` puts it), then the user's cache (``$TENSORFLEET_DATA_DIR/<name>``
  or ``~/.cache/tensorfleet/datasets/<name>``), which is filled by a download when allowed.
* **Downloads are verified.** Each file is streamed to a temporary file beside its final
  name, checked against its published MD5, and only then renamed into place (atomically), so
  a half-written or tampered file never looks like a data set. Several workers starting on
  one machine at once can all download safely: each writes its own temporary file and the
  renames replace identical contents.
* **Reading is strict.** The idx header (magic, dtype code, number of dims, sizes) is checked
  against what the file holds before any tensor is built: a truncated download, a gzip bomb
  or a file of another kind is a :class:`~tensorfleet.errors.DatasetError` that names the
  file, never a silently short or garbled tensor.

The system copy is not checked against the published MD5s: Debian recompresses the files,
so their gzip bytes differ while their contents are the same. The strict reader checks them.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import struct
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from tensorfleet import environment
from tensorfleet.errors import ConfigError, DatasetError

#: Height and width of every image, in pixels.
IMAGE_SIZE = 28
#: Number of classes (labels are ``0 .. NUM_CLASSES - 1``).
NUM_CLASSES = 10
#: Where distribution packages put data sets (``dataset-fashion-mnist`` on Debian).
SYSTEM_DATA_ROOT = Path("/usr/share/datasets")
#: Seconds a download may stall (connect, or wait for the next bytes) before it fails.
DEFAULT_TIMEOUT_S = 60.0
#: Largest decompressed idx payload accepted: the biggest real one (60000 images) is 47 MB.
#: Guards against a header (or a gzip bomb) that claims gigabytes.
MAX_IDX_BYTES = 256 * 1024 * 1024
#: Largest download accepted; the biggest official file is about 26 MB.
MAX_DOWNLOAD_BYTES = 64 * 1024 * 1024

#: Class names of Fashion-MNIST, by label.
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
#: Class names of MNIST, by label.
MNIST_CLASSES = tuple(str(digit) for digit in range(10))

#: The idx files of each split: (images, labels).
SPLIT_FILES: Mapping[str, tuple[str, str]] = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}

# idx format: two zero bytes, a dtype code, the number of dims, then one big-endian uint32 per
# dim, then the data in C order. Only unsigned bytes occur in (Fashion-)MNIST.
_IDX_UBYTE = 0x08
_IDX_DTYPE_NAMES = {
    0x08: "uint8",
    0x09: "int8",
    0x0B: "int16",
    0x0C: "int32",
    0x0D: "float32",
    0x0E: "float64",
}
_GZIP_MAGIC = b"\x1f\x8b"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class DatasetInfo:
    """What tensorfleet knows about one downloadable data set."""

    #: Name used in ``load_mnist(dataset=...)`` and as the directory name.
    name: str
    #: Official base URL; a file's URL is this plus its name.
    mirror: str
    #: Published MD5 of each ``.gz`` file, as torchvision lists them.
    checksums: Mapping[str, str]
    #: Debian package that installs the files under ``/usr/share/datasets``, if one exists.
    debian_package: str | None
    #: Class names by label.
    classes: tuple[str, ...]


#: The data sets :func:`load_mnist` knows, by name.
DATASETS: Mapping[str, DatasetInfo] = {
    "fashion-mnist": DatasetInfo(
        name="fashion-mnist",
        mirror="http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        checksums={
            "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
            "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
            "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
            "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
        },
        debian_package="dataset-fashion-mnist",
        classes=FASHION_MNIST_CLASSES,
    ),
    "mnist": DatasetInfo(
        name="mnist",
        mirror="https://ossci-datasets.s3.amazonaws.com/mnist/",
        checksums={
            "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
            "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
            "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
            "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
        },
        # Debian packages Fashion-MNIST only; MNIST comes from the download or a copy.
        debian_package=None,
        classes=MNIST_CLASSES,
    ),
}


# ------------------------------------------------------------------------------------------
# Reading idx files


def read_idx(path: str | os.PathLike[str], *, ndim: int | None = None) -> np.ndarray:
    """Read one idx file (gzip-compressed or raw, told apart by content) into a uint8 array.

    Checks, before building the array: the magic number, that the dtype is unsigned bytes
    (the only one MNIST uses), the number of dims (when ``ndim`` is given), that the declared
    size is at most :data:`MAX_IDX_BYTES`, and that the file holds exactly the declared number
    of bytes, no fewer (truncated) and no more (trailing data). Every failure is a
    :class:`DatasetError` naming the file.
    """
    path = Path(path)
    try:
        with path.open("rb") as raw:
            compressed = raw.read(2) == _GZIP_MAGIC
            raw.seek(0)
            if compressed:
                with gzip.GzipFile(fileobj=raw, mode="rb") as stream:
                    return _read_idx_stream(stream, path, ndim, compressed=True)
            return _read_idx_stream(raw, path, ndim, compressed=False)
    except DatasetError:
        raise
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise DatasetError(
            f"{path}: corrupt gzip data ({exc}); the file is damaged or truncated. Delete it "
            "and download or copy it again."
        ) from exc
    except OSError as exc:
        raise DatasetError(f"cannot read idx file {path}: {exc}") from exc


def _read_idx_stream(
    stream: BinaryIO, path: Path, ndim: int | None, *, compressed: bool
) -> np.ndarray:
    """Parse an open idx stream; see :func:`read_idx`."""
    what = "decompressed size" if compressed else "size"
    head = _read_exactly(stream, 4)
    if len(head) < 4:
        raise DatasetError(
            f"{path} is not an idx file: {len(head)} bytes long, shorter than the 4-byte header"
        )
    zero0, zero1, dtype_code, dims = head
    if zero0 != 0 or zero1 != 0 or dtype_code not in _IDX_DTYPE_NAMES:
        raise DatasetError(
            f"{path} is not an idx file: bad magic number 0x{head.hex()} (expected 0x0000XXNN "
            "with XX a dtype code and NN the number of dims, e.g. 0x00000803 for images)"
        )
    if dtype_code != _IDX_UBYTE:
        raise DatasetError(
            f"{path}: idx dtype {_IDX_DTYPE_NAMES[dtype_code]} (code 0x{dtype_code:02x}) is not "
            "supported; (Fashion-)MNIST files hold unsigned bytes (code 0x08)"
        )
    if ndim is not None and dims != ndim:
        raise DatasetError(f"{path}: idx file has {dims} dims, expected {ndim}")
    if dims == 0:
        raise DatasetError(f"{path}: idx file declares 0 dims; expected at least 1")
    shape_bytes = _read_exactly(stream, 4 * dims)
    header_size = 4 + 4 * dims
    if len(shape_bytes) < 4 * dims:
        raise DatasetError(
            f"{path} is truncated: expected a {header_size}-byte header, {what} is "
            f"{4 + len(shape_bytes)} bytes"
        )
    shape = struct.unpack(f">{dims}I", shape_bytes)
    count = 1
    for size in shape:
        count *= size
    if count > MAX_IDX_BYTES:
        raise DatasetError(
            f"{path}: idx header declares shape {shape} ({count} bytes), more than the "
            f"{MAX_IDX_BYTES} bytes accepted; the file is corrupt or not a (Fashion-)MNIST file"
        )
    # A bytearray keeps the array writable, so torch.from_numpy needs no copy and no warning.
    data = bytearray(count)
    got = stream.readinto(data) if count else 0
    while got < count:
        more = stream.readinto(memoryview(data)[got:])
        if not more:
            break
        got += more
    trailing = len(stream.read(1)) if got == count else 0
    if got < count or trailing:
        actual = (
            f"{header_size + got} bytes"
            if got < count
            else f"more than {header_size + count} bytes (trailing data)"
        )
        raise DatasetError(
            f"{path} is {'truncated' if got < count else 'too long'}: its header declares shape "
            f"{shape}, so the {what} should be {header_size + count} bytes, but it is {actual}. "
            "Delete it and download or copy it again."
        )
    return np.frombuffer(data, dtype=np.uint8).reshape(shape)


def _read_exactly(stream: BinaryIO, size: int) -> bytes:
    """Read ``size`` bytes, fewer only at end of stream (raw files may return short reads)."""
    parts = io.BytesIO()
    while parts.tell() < size:
        chunk = stream.read(size - parts.tell())
        if not chunk:
            break
        parts.write(chunk)
    return parts.getvalue()


def read_split(
    images_path: str | os.PathLike[str], labels_path: str | os.PathLike[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read one split's images and labels files and check that they belong together.

    Returns ``(images, labels)``: uint8 ``[N, 28, 28]`` and int64 ``[N]``. Beyond
    :func:`read_idx`'s checks: images must be 28×28, both files must hold the same number of
    examples, and labels must lie in ``0 .. 9``.
    """
    images = read_idx(images_path, ndim=3)
    labels = read_idx(labels_path, ndim=1)
    if images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE):
        raise DatasetError(
            f"{images_path}: images are {images.shape[1]}x{images.shape[2]} pixels, expected "
            f"{IMAGE_SIZE}x{IMAGE_SIZE}"
        )
    if images.shape[0] != labels.shape[0]:
        raise DatasetError(
            f"{images_path} holds {images.shape[0]} images but {labels_path} holds "
            f"{labels.shape[0]} labels; the two files are not of the same split"
        )
    if labels.size and int(labels.max()) >= NUM_CLASSES:
        raise DatasetError(
            f"{labels_path}: label {int(labels.max())} out of range 0..{NUM_CLASSES - 1}"
        )
    return torch.from_numpy(images), torch.from_numpy(labels.astype(np.int64))


# ------------------------------------------------------------------------------------------
# Finding and downloading


def default_cache_dir(dataset: str, environ: Mapping[str, str] | None = None) -> Path:
    """The cache directory of ``dataset``: ``$TENSORFLEET_DATA_DIR/<dataset>``, else
    ``~/.cache/tensorfleet/datasets/<dataset>``."""
    env = environment.environ() if environ is None else environ
    root = env.get(environment.DATA_DIR_VAR)
    if root:
        return Path(root).expanduser() / dataset
    home = env.get(environment.HOME_VAR)
    base = Path(home) if home else Path.home()
    return base / ".cache" / "tensorfleet" / "datasets" / dataset


def dataset_info(dataset: str) -> DatasetInfo:
    """The :class:`DatasetInfo` of ``dataset``; a :class:`DatasetError` listing the known names
    when it is not one."""
    try:
        return DATASETS[dataset]
    except KeyError:
        raise DatasetError(
            f"unknown dataset {dataset!r}; known datasets: {', '.join(sorted(DATASETS))}"
        ) from None


def load_mnist(
    dataset: str = "fashion-mnist",
    data_dir: str | os.PathLike[str] | None = None,
    split: str = "train",
    download: bool = True,
    *,
    mirror: str | None = None,
    checksums: Mapping[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    system_root: str | os.PathLike[str] | None = SYSTEM_DATA_ROOT,
    environ: Mapping[str, str] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Load one split of MNIST or Fashion-MNIST as ``(images, labels)``.

    ``images`` is a uint8 tensor ``[N, 28, 28]`` (see :func:`normalize` for float input),
    ``labels`` an int64 tensor ``[N]``; N is 60000 for ``split="train"`` and 10000 for
    ``"test"``.

    Where the files are looked for, in order (each file also accepted uncompressed, without
    ``.gz``):

    1. ``data_dir`` when given, and only there. Missing files are downloaded into it when
       ``download`` is true, else it is an error.
    2. ``<system_root>/<dataset>`` (``/usr/share/datasets/fashion-mnist`` after
       ``apt-get install dataset-fashion-mnist``); ``system_root=None`` skips it.
    3. The cache, :func:`default_cache_dir`; downloaded into when ``download`` is true.

    ``mirror`` replaces the official base URL and ``checksums`` (file name → MD5) overrides
    published checksums, for private mirrors and tests. ``timeout`` bounds each network wait.
    Raises :class:`DatasetError` saying where it looked, what failed and how to get the files.
    """
    info = dataset_info(dataset)
    if split not in SPLIT_FILES:
        raise ConfigError(f"unknown split {split!r}; expected one of {', '.join(SPLIT_FILES)}")
    names = SPLIT_FILES[split]
    if data_dir is not None:
        candidates = [Path(data_dir).expanduser()]
    else:
        candidates = [] if system_root is None else [Path(system_root) / info.name]
        candidates.append(default_cache_dir(info.name, environ))
    # Downloads go to the last place looked at: data_dir when given, else the cache.
    target = candidates[-1]

    def missing(failure: _DownloadFailed | None) -> DatasetError:
        return DatasetError(
            _missing_message(
                info, split, candidates, target, failure, explicit=data_dir is not None
            )
        )

    for directory in candidates:
        found = _find_files(directory, names)
        if found is not None:
            return read_split(*found)
    if not download:
        raise missing(None)
    try:
        for name in names:
            if _find_file(target, name) is None:
                _download(info, name, target, mirror=mirror, checksums=checksums, timeout=timeout)
    except _DownloadFailed as exc:
        raise missing(exc) from exc
    found = _find_files(target, names)
    if found is None:  # pragma: no cover - the downloads just put them there
        raise missing(None)
    return read_split(*found)


def normalize(images: torch.Tensor) -> torch.Tensor:
    """Turn uint8 images ``[N, 28, 28]`` into the float32 ``[N, 1, 28, 28]`` a CNN takes,
    scaled to ``[0, 1]``.

    Works on a mini-batch as well as on the whole set; normalizing per batch (e.g. as
    :class:`~tensorfleet.datasets.BatchStream`'s ``transform``) saves holding a float copy.
    """
    if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8:
        kind = images.dtype if isinstance(images, torch.Tensor) else type(images).__name__
        raise ConfigError(f"normalize expects a torch.uint8 tensor of images, got {kind}")
    if images.dim() != 3:
        raise ConfigError(
            f"normalize expects images of shape [N, H, W], got shape {tuple(images.shape)}"
        )
    return images.to(torch.float32).div_(255.0).unsqueeze(1)


def _find_file(directory: Path, name: str) -> Path | None:
    """``directory/name`` if it is a file, else its uncompressed twin, else None."""
    for candidate in (directory / name, directory / name.removesuffix(".gz")):
        if candidate.is_file():
            return candidate
    return None


def _find_files(directory: Path, names: Sequence[str]) -> tuple[Path, Path] | None:
    """The split's (images, labels) paths in ``directory`` when both are there."""
    images, labels = (_find_file(directory, name) for name in names)
    if images is None or labels is None:
        return None
    return images, labels


class _DownloadFailed(Exception):
    """One file could not be downloaded; carries the URL and the reason."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason


def _download(
    info: DatasetInfo,
    name: str,
    directory: Path,
    *,
    mirror: str | None,
    checksums: Mapping[str, str] | None,
    timeout: float,
) -> Path:
    """Download ``name`` into ``directory``, verify its MD5, rename it into place atomically."""
    base = mirror if mirror is not None else info.mirror
    url = urllib.parse.urljoin(base if base.endswith("/") else base + "/", name)
    expected = {**info.checksums, **(checksums or {})}.get(name)
    if expected is None:
        raise _DownloadFailed(url, "no checksum known for this file; refusing to use it")
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        raise _DownloadFailed(url, "only http and https URLs are downloaded")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _DownloadFailed(url, f"cannot create {directory}: {exc}") from exc
    final = directory / name
    fd, tmp_name = tempfile.mkstemp(prefix=f".{name}.", suffix=".part", dir=directory)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.md5(usedforsecurity=False)
        size = 0
        with os.fdopen(fd, "wb") as out:
            try:
                with urllib.request.urlopen(url, timeout=timeout) as response:
                    while chunk := response.read(_CHUNK):
                        size += len(chunk)
                        if size > MAX_DOWNLOAD_BYTES:
                            raise _DownloadFailed(
                                url, f"larger than {MAX_DOWNLOAD_BYTES} bytes; not this file"
                            )
                        digest.update(chunk)
                        out.write(chunk)
            except urllib.error.HTTPError as exc:
                raise _DownloadFailed(url, f"HTTP {exc.code} {exc.reason}") from exc
            except urllib.error.URLError as exc:
                raise _DownloadFailed(url, str(exc.reason)) from exc
            except (OSError, ValueError) as exc:  # timeouts, resets, malformed responses
                raise _DownloadFailed(url, f"{type(exc).__name__}: {exc}") from exc
            out.flush()
            os.fsync(out.fileno())
        actual = digest.hexdigest()
        if actual != expected.lower():
            raise _DownloadFailed(
                url,
                f"MD5 mismatch: expected {expected}, got {actual} ({size} bytes); the download "
                "was corrupted or the mirror serves another file. Nothing was kept",
            )
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final


def _missing_message(
    info: DatasetInfo,
    split: str,
    looked: Sequence[Path],
    target: Path,
    failure: _DownloadFailed | None,
    *,
    explicit: bool,
) -> str:
    """Explain that a split cannot be had: where we looked, what failed, how to fix it."""
    files = ", ".join(SPLIT_FILES[split])
    lines = [f"{info.name} ({split} split) not found: need {files}."]
    lines.append("Looked in: " + ", ".join(str(p) for p in looked) + ".")
    if failure is not None:
        lines.append(f"Download failed: {failure.url}: {failure.reason}.")
    else:
        lines.append("Downloading was not allowed (download=False).")
    lines.append("To get the files, any of:")
    if info.debian_package is not None:
        lines.append(
            f"  - apt-get install {info.debian_package}  (puts them in "
            f"{SYSTEM_DATA_ROOT / info.name})"
        )
    all_files = ", ".join(sorted({n for pair in SPLIT_FILES.values() for n in pair}))
    lines.append(f"  - copy the four idx.gz files ({all_files}) into {target}")
    if not explicit:  # the cache root can be moved
        lines.append(f"    (or into ${environment.DATA_DIR_VAR}/{info.name})")
    lines.append("  - pass --data-dir (data_dir=) pointing at a directory that holds them")
    lines.append(f"  - allow the download from {info.mirror} (needs network access)")
    return "\n".join(lines)
