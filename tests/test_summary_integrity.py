"""Damaged and inconsistent summary files: checksums, full shapes, ranges, PSD and signs.

Each test below failed before the check it exercises existed (a flipped bit loaded and
changed the distance; a width-1 gate or reference-output tensor broadcast; a K-FAC layer
missing from the metadata dropped its term; huge finite values gave inf; a missing gate,
mixed dtypes or a coreset of the wrong width failed inside ``distance``; a covariance or
K-FAC factor with an eigenvalue of −9e-6 gave a negative distance). A hand-edited file is
simulated by rewriting its checksums (:func:`_rewrite`), so the consistency checks
themselves are what refuses it.
"""

from __future__ import annotations

import copy
import io
import json
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fsd
from conftest import DTYPE, mlp, perturbed
from fsd.validation import payload_checksums


def _rewrite(path: Path, change: Callable[[dict], None], checksums: bool = True) -> Path:
    """Apply ``change`` to the saved payload; re-checksum it (or drop the checksums)."""
    payload = torch.load(path, weights_only=True)
    change(payload)
    payload.pop("checksums", None)
    if checksums:
        payload["checksums"] = payload_checksums(payload["estimator"], payload["config"],
                                                 payload["meta"], payload["tensors"])
    else:
        payload["version"] = 1  # as a file written before checksums says of itself
    out = path.with_name("edited.fsd")
    torch.save(payload, out)
    return out


def _tensors(change: Callable[[dict], None]) -> Callable[[dict], None]:
    return lambda payload: change(payload["tensors"])


def _data(n: int = 64, d: int = 4, dtype: torch.dtype = DTYPE) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, d, generator=gen, dtype=dtype), torch.randint(3, (n,), generator=gen)


# ----- item 3: checksums ---------------------------------------------------------------

def _flip_in_file(path: Path, tensor: torch.Tensor, bit: int) -> None:
    """Flip ``bit`` of the first byte of ``tensor``'s stored bytes, in the file itself."""
    raw = bytearray(path.read_bytes())
    at = bytes(raw).find(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    assert at >= 0  # torch.save stores tensor bytes uncompressed
    raw[at + 7] ^= 1 << bit  # the top byte of the first float64: sign and exponent
    path.write_bytes(bytes(raw))


def test_a_flipped_bit_in_a_stored_tensor_is_refused_naming_the_field(tmp_path):
    model = mlp([4, 8, 3])
    est = fsd.BGLN(deterministic=True, covariance="full").fit(model, _data()[0])
    path = tmp_path / "s.fsd"
    est.save(path)
    _flip_in_file(path, est._stored["theta0.2.weight"], 4)
    with pytest.raises(fsd.SummaryFormatError, match=r"'theta0\.2\.weight'.*checksum"):
        fsd.load(path)


def test_a_changed_configuration_is_refused(tmp_path):
    est = fsd.BGLN(num_samples=16).fit(mlp([4, 8, 3]), _data()[0])
    est.save(tmp_path / "s.fsd")
    payload = torch.load(tmp_path / "s.fsd", weights_only=True)
    payload["config"] = payload["config"].replace('"seed": 0', '"seed": 1')
    torch.save(payload, tmp_path / "bad.fsd")
    with pytest.raises(fsd.SummaryFormatError, match="config: checksum mismatch"):
        fsd.load(tmp_path / "bad.fsd")


def test_summaries_saved_without_checksums_still_load(tmp_path):
    model = mlp([4, 8, 3])
    moved = perturbed(model)
    est = fsd.KFAC().fit(model, _data()[0])
    est.save(tmp_path / "s.fsd")
    old = _rewrite(tmp_path / "s.fsd", lambda p: None, checksums=False)
    assert "checksums" not in torch.load(old, weights_only=True)
    torch.testing.assert_close(fsd.load(old).distance(moved), est.distance(moved),
                               rtol=0, atol=0)


def test_an_unknown_entry_is_refused(tmp_path):
    # a damaged "checksums" key would otherwise pass the file off as an older one
    est = fsd.EWC().fit(mlp([4, 8, 3]), _data()[0])
    est.save(tmp_path / "s.fsd")
    payload = torch.load(tmp_path / "s.fsd", weights_only=True)
    payload["checksumr"] = payload.pop("checksums")
    torch.save(payload, tmp_path / "bad.fsd")
    with pytest.raises(fsd.SummaryFormatError, match="unexpected entries 'checksumr'"):
        fsd.load(tmp_path / "bad.fsd")


def test_a_private_estimator_class_is_refused(tmp_path):
    # the shared base of LAFTR and BGLN is not an estimator a summary can name
    est = fsd.LAFTR().fit(mlp([4, 8, 3]), _data()[0])
    est.save(tmp_path / "s.fsd")
    payload = torch.load(tmp_path / "s.fsd", weights_only=True)
    payload["estimator"] = "_LinearizedEstimator"
    torch.save(payload, tmp_path / "bad.fsd")
    with pytest.raises(fsd.SummaryFormatError, match="unknown estimator '_LinearizedEstimator'"):
        fsd.load(tmp_path / "bad.fsd")


# ----- item 5: what fsd.load (or the first distance) checks -----------------------------

def test_a_gate_frequency_of_width_one_is_refused(tmp_path):
    model = mlp([4, 8, 3])
    est = fsd.BGLN(deterministic=True, covariance="full").fit(model, _data()[0])
    est.save(tmp_path / "s.fsd")
    path = _rewrite(tmp_path / "s.fsd", _tensors(lambda t: t.update(
        {"gate.1": t["gate.1"][:, :1].contiguous()})))
    with pytest.raises(fsd.SummaryFormatError, match=r"'gate\.1': shape \(1, 1\)"):
        fsd.load(path).distance(perturbed(model))


def test_a_missing_gate_is_refused(tmp_path):
    model = mlp([4, 8, 3])
    est = fsd.BGLN(deterministic=True, covariance="full").fit(model, _data()[0])
    est.save(tmp_path / "s.fsd")
    path = _rewrite(tmp_path / "s.fsd", _tensors(lambda t: t.pop("gate.1")))
    with pytest.raises(fsd.SummaryFormatError, match=r"'gate\.1' is missing"):
        fsd.load(path).distance(perturbed(model))


def test_reference_outputs_of_width_one_are_refused(tmp_path):
    model = mlp([4, 8, 3])
    est = fsd.ExactFSD().fit(model, _data()[0])
    est.save(tmp_path / "s.fsd")
    path = _rewrite(tmp_path / "s.fsd", _tensors(lambda t: t.update(
        {"data.f0": t["data.f0"][:, :1].contiguous()})))
    with pytest.raises(fsd.SummaryFormatError, match=r"'data\.f0'"):
        fsd.load(path).distance(perturbed(model))


def test_a_kfac_layer_missing_from_the_metadata_is_refused(tmp_path):
    est = fsd.KFAC().fit(mlp([4, 8, 3]), _data()[0])
    est.save(tmp_path / "s.fsd")

    def drop_layer(payload: dict) -> None:
        meta = json.loads(payload["meta"])
        meta["layers"] = meta["layers"][:1]
        payload["meta"] = json.dumps(meta)
        for f in "AG":
            payload["tensors"].pop(f"kfac.2.{f}")

    with pytest.raises(fsd.SummaryFormatError, match="meta 'layers'"):
        fsd.load(_rewrite(tmp_path / "s.fsd", drop_layer))


@pytest.mark.parametrize("dtype,value", [(torch.float32, 1e37), (torch.float64, 1e300)])
def test_finite_values_whose_squares_overflow_are_refused(tmp_path, dtype, value):
    model = mlp([4, 8, 3], dtype=dtype)
    est = fsd.EWC().fit(model, _data(dtype=dtype)[0])
    est.save(tmp_path / "s.fsd")
    path = _rewrite(tmp_path / "s.fsd", _tensors(
        lambda t: t["fisher.0.weight"].view(-1).__setitem__(0, value)))
    with pytest.raises(fsd.SummaryFormatError, match=r"'fisher\.0\.weight': values up to"):
        fsd.load(path)


def test_a_float64_value_beyond_float32_is_refused_with_a_float32_model(tmp_path):
    model = mlp([4, 8, 3])
    est = fsd.EWC().fit(model, _data()[0])
    est.save(tmp_path / "s.fsd")
    path = _rewrite(tmp_path / "s.fsd", _tensors(
        lambda t: t["fisher.0.weight"].view(-1).__setitem__(0, 1e30)))
    loaded = fsd.load(path)  # fine in float64
    assert torch.isfinite(loaded.distance(perturbed(model)))
    with pytest.raises(fsd.SummaryFormatError, match=r"'fisher\.0\.weight'.*float32"):
        loaded.distance(perturbed(model).float())


def test_statistics_of_another_dtype_are_refused(tmp_path):
    est = fsd.BGLN(deterministic=True, covariance="full").fit(mlp([4, 8, 3]), _data()[0])
    est.save(tmp_path / "s.fsd")
    path = _rewrite(tmp_path / "s.fsd", _tensors(
        lambda t: t.update({"input.cov": t["input.cov"].float()})))
    with pytest.raises(fsd.SummaryFormatError, match=r"'input\.cov': dtype torch\.float32"):
        fsd.load(path)


def test_a_coreset_of_the_wrong_width_is_refused(tmp_path):
    est = fsd.LAFTR(inputs="coreset", coreset_size=10).fit(mlp([4, 8, 3]), _data()[0])
    est.save(tmp_path / "s.fsd")
    path = _rewrite(tmp_path / "s.fsd", _tensors(
        lambda t: t.update({"coreset.x": t["coreset.x"][:, :3].contiguous()})))
    with pytest.raises(fsd.SummaryFormatError, match=r"'coreset\.x': shape \(10, 3\)"):
        fsd.load(path)


def test_a_gaussian_mean_of_another_width_than_the_inputs_is_refused(tmp_path):
    est = fsd.BGLN(deterministic=True, covariance="diag").fit(mlp([4, 8, 3]), _data()[0])
    est.save(tmp_path / "s.fsd")

    def narrower(payload: dict) -> None:
        t = payload["tensors"]
        t["input.mean"], t["input.cov"] = t["input.mean"][:, :3], t["input.cov"][:, :3]

    with pytest.raises(fsd.SummaryFormatError, match=r"'input\.mean': shape \(1, 3\)"):
        fsd.load(_rewrite(tmp_path / "s.fsd", narrower))


# ----- item 6: slightly indefinite matrices never give a negative distance ---------------

def _with_negative_eigenvalue(matrix: torch.Tensor, relative: float
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``matrix`` with its smallest eigenvalue set to −relative · its largest entry."""
    values, vectors = torch.linalg.eigh(matrix.to(torch.float64))
    values[0] = -relative * float(matrix.abs().max())
    out = (vectors * values) @ vectors.T
    return ((out + out.T) / 2).to(matrix.dtype), vectors[:, 0].to(matrix.dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_kfac_factor_with_a_small_negative_eigenvalue_gives_no_negative_distance(
        tmp_path, dtype):
    model = mlp([4, 8, 3], dtype=dtype)
    est = fsd.KFAC().fit(model, _data(dtype=dtype)[0])
    est.save(tmp_path / "s.fsd")
    direction = {}

    def indefinite(payload: dict) -> None:
        t = payload["tensors"]
        t["kfac.0.A"], direction["v"] = _with_negative_eigenvalue(t["kfac.0.A"], 9e-6)

    path = _rewrite(tmp_path / "s.fsd", indefinite)
    moved = copy.deepcopy(model)
    with torch.no_grad():  # ΔW̄ = u vᵀ along the negative eigenvector of A
        step = 10.0 * torch.ones(8, 1, dtype=dtype) * direction["v"]
        moved[0].weight += step[:, :4]
        moved[0].bias += step[:, 4]
    if dtype == torch.float64:  # beyond float64 round-off: refused
        with pytest.raises(fsd.SummaryFormatError, match="positive semi-definite"):
            fsd.load(path)
    else:  # within float32 round-off: loads, and the quadratic form is clamped at 0
        assert float(fsd.load(path).distance(moved)) >= 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_an_input_covariance_with_a_small_negative_eigenvalue_gives_no_negative_distance(
        tmp_path, dtype):
    model = mlp([4, 8, 3], dtype=dtype)
    est = fsd.BGLN(deterministic=True, covariance="full").fit(model, _data(dtype=dtype)[0])
    est.save(tmp_path / "s.fsd")
    direction = {}

    def indefinite(payload: dict) -> None:
        t = payload["tensors"]
        cov, direction["v"] = _with_negative_eigenvalue(t["input.cov"][0], 9e-6)
        t["input.cov"] = cov.unsqueeze(0)
        t["input.mean"] = torch.zeros_like(t["input.mean"])  # no mean term: the trace alone

    path = _rewrite(tmp_path / "s.fsd", indefinite)
    moved = copy.deepcopy(model)
    with torch.no_grad():
        moved[0].weight += 10.0 * torch.ones(8, 1, dtype=dtype) * direction["v"]
    if dtype == torch.float64:
        with pytest.raises(fsd.SummaryFormatError, match="positive semi-definite"):
            fsd.load(path)
    else:
        assert float(fsd.load(path).distance(moved)) >= 0


# ----- property: every flipped bit is refused or harmless -------------------------------

def _estimators() -> dict[str, Callable[[], fsd.Estimator]]:
    return {
        "ExactFSD": fsd.ExactFSD,
        "LAFTR": lambda: fsd.LAFTR(inputs="coreset", coreset_size=8),
        "BGLN-S": lambda: fsd.BGLN(num_samples=8, covariance="full"),
        "BGLN-D-paper": lambda: fsd.BGLN(deterministic=True, covariance="full"),
        "BGLN-D-exact": lambda: fsd.BGLN(deterministic=True, moments="exact", rank=2),
        "NTK": lambda: fsd.NTK(coreset_size=8),
        "EWC": fsd.EWC,
        "KFAC": fsd.KFAC,
    }


_MODEL = mlp([3, 4, 2])
_MOVED = perturbed(_MODEL, 0.3)
_SAVED: dict[str, tuple[bytes, list[tuple[int, int]], torch.Tensor]] = {}


def _saved(name: str) -> tuple[bytes, list[tuple[int, int]], torch.Tensor]:
    """The saved file, the byte ranges of its tensors' data, and its distance to _MOVED."""
    if name not in _SAVED:
        x, y = _data(24, 3)
        est = _estimators()[name]().fit(_MODEL, [(x, y)])
        buffer = io.BytesIO()
        torch.save(est.to_payload(), buffer)
        raw = buffer.getvalue()
        ranges = []
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            for info in archive.infolist():
                if "/data/" in info.filename and info.file_size:
                    # local header: 30 bytes, then the name and the extra field
                    name_len = int.from_bytes(raw[info.header_offset + 26:][:2], "little")
                    extra_len = int.from_bytes(raw[info.header_offset + 28:][:2], "little")
                    start = info.header_offset + 30 + name_len + extra_len
                    ranges.append((start, start + info.file_size))
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "clean.fsd"
            path.write_bytes(raw)
            distance = fsd.load(path).distance(_MOVED)  # a fresh load: BGLN-S's first draw
        _SAVED[name] = raw, ranges, distance
    return _SAVED[name]


@pytest.mark.parametrize("name", sorted(_estimators()))
@settings(max_examples=30, deadline=None)
@given(choice=st.data())
def test_every_flipped_bit_is_refused_or_harmless(name, choice):
    raw, ranges, expected = _saved(name)
    # half the flips anywhere in the file, half in the tensors' bytes (a small part of it)
    if choice.draw(st.booleans()):
        start, stop = choice.draw(st.sampled_from(ranges))
        position = choice.draw(st.integers(start * 8, stop * 8 - 1))
    else:
        position = choice.draw(st.integers(0, len(raw) * 8 - 1))
    damaged = bytearray(raw)
    damaged[position // 8] ^= 1 << (position % 8)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "damaged.fsd"
        path.write_bytes(bytes(damaged))
        try:
            loaded = fsd.load(path)
        except fsd.SummaryFormatError:
            return
    torch.testing.assert_close(loaded.distance(_MOVED), expected, rtol=0, atol=0)


def test_the_property_test_covers_the_estimators_of_the_readme():
    kinds = {type(make()).__name__ for make in _estimators().values()}
    assert kinds == {"ExactFSD", "LAFTR", "BGLN", "NTK", "EWC", "KFAC"}
    assert isinstance(_MODEL, nn.Sequential)
