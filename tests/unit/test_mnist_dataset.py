"""MNIST / Fashion-MNIST: the strict idx reader, where files are found, verified downloads.

Everything runs on small idx files generated here; downloads go to an ``http.server`` on
127.0.0.1 (there is no internet on the test machines). Tests marked ``needs_data`` read the
real Fashion-MNIST files that Debian's ``dataset-fashion-mnist`` installs.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tensorfleet import environment
from tensorfleet.datasets import mnist
from tensorfleet.datasets.mnist import load_mnist, normalize, read_idx, read_split
from tensorfleet.errors import DatasetError

SYSTEM_FASHION = Path("/usr/share/datasets/fashion-mnist")
needs_fashion = pytest.mark.skipif(
    not all((SYSTEM_FASHION / n).is_file() for pair in mnist.SPLIT_FILES.values() for n in pair),
    reason="Fashion-MNIST not installed: apt-get install dataset-fashion-mnist",
)


def idx_bytes(array: np.ndarray, *, dtype_code: int = 0x08) -> bytes:
    """The idx encoding of a uint8 array, written independently of the reader under test."""
    header = bytes([0, 0, dtype_code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def make_split(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n, dtype=np.uint8)
    return images, labels


def write_dataset(directory: Path, *, gz: bool = True, n_train: int = 12, n_test: int = 5) -> dict:
    """Write all four files of a tiny data set; return {file name: (array, written bytes)}."""
    directory.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, n, seed in (("train", n_train, 1), ("test", n_test, 2)):
        images, labels = make_split(n, seed)
        for name, array in zip(mnist.SPLIT_FILES[split], (images, labels), strict=True):
            data = idx_bytes(array)
            if gz:
                data = gzip.compress(data)
                (directory / name).write_bytes(data)
            else:
                (directory / name.removesuffix(".gz")).write_bytes(data)
            written[name] = (array, data)
    return written


def md5s(written: dict) -> dict[str, str]:
    return {name: hashlib.md5(data).hexdigest() for name, (_, data) in written.items()}


# -- the idx reader ------------------------------------------------------------------------


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_raw_and_gz(tmp_path: Path, gz: bool) -> None:
    images, _ = make_split(7)
    data = idx_bytes(images)
    path = tmp_path / "x.idx"
    path.write_bytes(gzip.compress(data) if gz else data)
    got = read_idx(path, ndim=3)
    assert got.dtype == np.uint8 and got.shape == (7, 28, 28)
    np.testing.assert_array_equal(got, images)


def test_truncated_raw_file_names_file_and_sizes(tmp_path: Path) -> None:
    images, _ = make_split(4)
    data = idx_bytes(images)
    path = tmp_path / "images.idx"
    path.write_bytes(data[:-100])
    with pytest.raises(DatasetError) as info:
        read_idx(path)
    message = str(info.value)
    assert str(path) in message and "truncated" in message
    assert str(len(data)) in message and str(len(data) - 100) in message


def test_truncated_gz_payload_names_sizes(tmp_path: Path) -> None:
    """A well-formed gzip stream whose idx content is short: expected vs actual size."""
    images, _ = make_split(3)
    data = idx_bytes(images)[:-10]
    path = tmp_path / "images.gz"
    path.write_bytes(gzip.compress(data))
    with pytest.raises(DatasetError, match="truncated") as info:
        read_idx(path)
    assert str(len(data) + 10) in str(info.value) and str(len(data)) in str(info.value)


def test_cut_gzip_stream_is_dataset_error(tmp_path: Path) -> None:
    """A download cut mid-way: the gzip stream itself ends early."""
    images, _ = make_split(50)
    compressed = gzip.compress(idx_bytes(images))
    path = tmp_path / "images.gz"
    path.write_bytes(compressed[: len(compressed) // 2])
    with pytest.raises(DatasetError, match=str(path)):
        read_idx(path)


def test_trailing_data_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "labels.idx"
    path.write_bytes(idx_bytes(np.arange(5, dtype=np.uint8)) + b"\x00")
    with pytest.raises(DatasetError, match="too long"):
        read_idx(path)


@pytest.mark.parametrize(
    "head",
    [b"\x01\x00\x08\x01", b"PK\x03\x04", b"\x00\x00\x42\x01"],
    ids=["nonzero-prefix", "zip-file", "unknown-dtype"],
)
def test_bad_magic(tmp_path: Path, head: bytes) -> None:
    path = tmp_path / "bad.idx"
    path.write_bytes(head + struct.pack(">I", 3) + b"abc")
    with pytest.raises(DatasetError, match="bad magic"):
        read_idx(path)


def test_unsupported_dtype(tmp_path: Path) -> None:
    path = tmp_path / "float.idx"
    path.write_bytes(bytes([0, 0, 0x0D, 1]) + struct.pack(">I", 1) + b"\x00" * 4)
    with pytest.raises(DatasetError, match="float32"):
        read_idx(path)


def test_wrong_number_of_dims(tmp_path: Path) -> None:
    path = tmp_path / "flat.idx"
    path.write_bytes(idx_bytes(np.zeros((2, 784), dtype=np.uint8)))
    with pytest.raises(DatasetError, match="2 dims, expected 3"):
        read_idx(path, ndim=3)


def test_huge_declared_size_is_refused_before_allocating(tmp_path: Path) -> None:
    path = tmp_path / "huge.idx"
    path.write_bytes(bytes([0, 0, 8, 3]) + struct.pack(">3I", 2**31, 28, 28))
    with pytest.raises(DatasetError, match="more than"):
        read_idx(path)


def test_short_and_empty_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    with pytest.raises(DatasetError, match="not an idx file"):
        read_idx(empty)
    header_only = tmp_path / "header"
    header_only.write_bytes(bytes([0, 0, 8, 3]) + b"\x00\x00")
    with pytest.raises(DatasetError, match="truncated"):
        read_idx(header_only)
    with pytest.raises(DatasetError, match="cannot read"):
        read_idx(tmp_path / "absent")


def test_read_split_checks_consistency(tmp_path: Path) -> None:
    images, labels = make_split(4)
    (tmp_path / "i").write_bytes(idx_bytes(images))
    (tmp_path / "l3").write_bytes(idx_bytes(labels[:3]))
    (tmp_path / "bad").write_bytes(idx_bytes(np.array([1, 2, 10, 3], dtype=np.uint8)))
    (tmp_path / "small").write_bytes(idx_bytes(np.zeros((4, 14, 14), dtype=np.uint8)))
    (tmp_path / "l").write_bytes(idx_bytes(labels))
    with pytest.raises(DatasetError, match="4 images but"):
        read_split(tmp_path / "i", tmp_path / "l3")
    with pytest.raises(DatasetError, match="label 10 out of range"):
        read_split(tmp_path / "i", tmp_path / "bad")
    with pytest.raises(DatasetError, match="14x14"):
        read_split(tmp_path / "small", tmp_path / "l")
    x, y = read_split(tmp_path / "i", tmp_path / "l")
    assert x.dtype == torch.uint8 and y.dtype == torch.int64
    assert torch.equal(y, torch.from_numpy(labels.astype(np.int64)))


# -- where files are looked for ------------------------------------------------------------


@pytest.mark.parametrize("gz", [True, False])
def test_load_from_data_dir(tmp_path: Path, gz: bool) -> None:
    written = write_dataset(tmp_path / "d", gz=gz)
    for split in ("train", "test"):
        images, labels = load_mnist("mnist", tmp_path / "d", split, download=False)
        want_images, want_labels = (written[n][0] for n in mnist.SPLIT_FILES[split])
        assert images.shape == want_images.shape and images.dtype == torch.uint8
        assert torch.equal(images, torch.from_numpy(want_images))
        assert torch.equal(labels, torch.from_numpy(want_labels.astype(np.int64)))


def test_data_dir_is_the_only_place_looked(tmp_path: Path) -> None:
    write_dataset(tmp_path / "system" / "mnist")
    write_dataset(tmp_path / "cache" / "mnist")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DatasetError) as info:
        load_mnist(
            "mnist",
            empty,
            download=False,
            system_root=tmp_path / "system",
            environ={environment.DATA_DIR_VAR: str(tmp_path / "cache")},
        )
    message = str(info.value)
    assert str(empty) in message and str(tmp_path / "system") not in message
    assert "download=False" in message and "--data-dir" in message


def test_system_dir_before_cache(tmp_path: Path) -> None:
    system = write_dataset(tmp_path / "system" / "mnist", n_train=3)
    write_dataset(tmp_path / "cache" / "mnist", n_train=4)
    env = {environment.DATA_DIR_VAR: str(tmp_path / "cache")}
    images, _ = load_mnist("mnist", system_root=tmp_path / "system", environ=env, download=False)
    assert torch.equal(images, torch.from_numpy(system["train-images-idx3-ubyte.gz"][0]))
    images, _ = load_mnist("mnist", system_root=None, environ=env, download=False)
    assert len(images) == 4


def test_default_cache_dir(tmp_path: Path) -> None:
    env = {environment.DATA_DIR_VAR: str(tmp_path / "data")}
    assert mnist.default_cache_dir("mnist", env) == tmp_path / "data" / "mnist"
    home = {environment.HOME_VAR: str(tmp_path)}
    expected = tmp_path / ".cache" / "tensorfleet" / "datasets" / "fashion-mnist"
    assert mnist.default_cache_dir("fashion-mnist", home) == expected


def test_unknown_dataset_and_split(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="fashion-mnist, mnist"):
        load_mnist("cifar10", tmp_path)
    with pytest.raises(ValueError, match="train, test"):
        load_mnist("mnist", tmp_path, split="validation")


def test_not_found_message_without_download(tmp_path: Path) -> None:
    env = {environment.DATA_DIR_VAR: str(tmp_path / "cache")}
    with pytest.raises(DatasetError) as info:
        load_mnist("fashion-mnist", system_root=tmp_path / "sys", environ=env, download=False)
    message = str(info.value)
    assert "fashion-mnist" in message
    assert str(tmp_path / "sys" / "fashion-mnist") in message
    assert str(tmp_path / "cache" / "fashion-mnist") in message
    assert "apt-get install dataset-fashion-mnist" in message
    assert environment.DATA_DIR_VAR in message


# -- downloads, against a local server -----------------------------------------------------


@pytest.fixture
def mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, dict]]:
    """Serve a tiny data set over HTTP on 127.0.0.1; yield (base URL, written files)."""
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    written = write_dataset(tmp_path / "served")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(tmp_path / "served"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", written
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_download_into_cache_verified(tmp_path: Path, mirror: tuple[str, dict]) -> None:
    url, written = mirror
    cache = tmp_path / "cache"
    env = {environment.DATA_DIR_VAR: str(cache)}
    kwargs = {"system_root": None, "environ": env, "mirror": url, "checksums": md5s(written)}
    images, labels = load_mnist("mnist", split="test", timeout=5, **kwargs)
    assert torch.equal(images, torch.from_numpy(written["t10k-images-idx3-ubyte.gz"][0]))
    assert sorted(p.name for p in (cache / "mnist").iterdir()) == [
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
    ]
    # Cached now: a second load needs no server at all.
    again, _ = load_mnist("mnist", split="test", download=False, system_root=None, environ=env)
    assert torch.equal(again, images)


def test_download_into_explicit_data_dir(tmp_path: Path, mirror: tuple[str, dict]) -> None:
    url, written = mirror
    target = tmp_path / "mine"
    images, _ = load_mnist(
        "fashion-mnist", target, "train", mirror=url, checksums=md5s(written), timeout=5
    )
    assert len(images) == 12
    assert (target / "train-images-idx3-ubyte.gz").read_bytes() == (
        written["train-images-idx3-ubyte.gz"][1]
    )


def test_wrong_checksum_rejected_and_nothing_left(tmp_path: Path, mirror: tuple[str, dict]) -> None:
    url, written = mirror
    sums = md5s(written) | {"train-labels-idx1-ubyte.gz": "0" * 32}
    target = tmp_path / "mine"
    with pytest.raises(DatasetError) as info:
        load_mnist("mnist", target, mirror=url, checksums=sums, timeout=5)
    message = str(info.value)
    assert "MD5 mismatch" in message and url + "train-labels-idx1-ubyte.gz" in message
    # The verified images file may stay; the rejected file and every temporary file are gone.
    assert [p.name for p in target.iterdir()] == ["train-images-idx3-ubyte.gz"]


def test_official_checksums_are_enforced(tmp_path: Path, mirror: tuple[str, dict]) -> None:
    """Without an override, the published MD5s apply: our tiny files do not match them."""
    url, _ = mirror
    with pytest.raises(DatasetError, match="MD5 mismatch"):
        load_mnist("mnist", tmp_path / "d", mirror=url, timeout=5)
    assert list((tmp_path / "d").iterdir()) == []


def test_missing_file_on_mirror(tmp_path: Path, mirror: tuple[str, dict]) -> None:
    url, written = mirror
    with pytest.raises(DatasetError, match="HTTP 404"):
        load_mnist("mnist", tmp_path / "d", mirror=url + "nowhere/", checksums=md5s(written))


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/mnist/"


def test_offline_error_explains_everything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    url = closed_port_url()
    env = {environment.DATA_DIR_VAR: str(tmp_path / "cache")}
    with pytest.raises(DatasetError) as info:
        load_mnist(
            "fashion-mnist", system_root=tmp_path / "sys", environ=env, mirror=url, timeout=5
        )
    message = str(info.value)
    assert "fashion-mnist" in message
    assert str(tmp_path / "sys" / "fashion-mnist") in message
    assert str(tmp_path / "cache" / "fashion-mnist") in message
    assert url + "train-images-idx3-ubyte.gz" in message
    assert "refused" in message.lower()
    assert "apt-get install dataset-fashion-mnist" in message
    assert "--data-dir" in message
    assert [p.name for p in (tmp_path / "cache" / "fashion-mnist").iterdir()] == []


def test_non_http_mirror_refused(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="only http and https"):
        load_mnist("mnist", tmp_path / "d", mirror="file:///etc/")


# -- normalize -----------------------------------------------------------------------------


def test_normalize() -> None:
    images = torch.tensor([[[0, 255], [51, 102]]], dtype=torch.uint8)
    out = normalize(images)
    assert out.dtype == torch.float32 and out.shape == (1, 1, 2, 2)
    assert torch.allclose(out, torch.tensor([[[[0.0, 1.0], [0.2, 0.4]]]]))
    with pytest.raises(ValueError, match="uint8"):
        normalize(images.float())
    with pytest.raises(ValueError, match="shape"):
        normalize(images[0])


# -- the real files ------------------------------------------------------------------------


@pytest.mark.needs_data
@needs_fashion
@pytest.mark.parametrize(("split", "n"), [("train", 60000), ("test", 10000)])
def test_real_fashion_mnist(split: str, n: int) -> None:
    images, labels = load_mnist("fashion-mnist", split=split, download=False)
    assert images.shape == (n, 28, 28) and images.dtype == torch.uint8
    assert labels.shape == (n,) and labels.dtype == torch.int64
    assert torch.equal(torch.bincount(labels), torch.full((10,), n // 10))
    assert int(images.max()) == 255 and int(images.min()) == 0
