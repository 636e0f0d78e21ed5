"""What ``save`` writes, ``load`` reads; what ``load`` would refuse is refused at ``fit``.

Each test failed before the change it exercises: a float32 EWC or K-FAC summary of a
feature of 1.7e12 (a Unix time in ms) fitted and saved, then ``fsd.load`` and
``ContinualRegularizer.load`` refused the file, every task of a regularizer lost with it;
a full disk gave torch's RuntimeError without the path or the reason; loading a FIFO with
no writer hung and saving over one replaced it; a regularizer file with a task dropped,
duplicated or reordered loaded, as did a summary whose checksums were deleted; a summary of
a later format version was refused without saying to upgrade.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

import fsd
from conftest import mlp, perturbed
from fsd.estimators import base

F32 = torch.float32
TIMESTAMP_FEATURE = 3


def _inputs(kind: str, n: int = 48, seed: int = 0) -> torch.Tensor:
    """Float32 inputs of 4 features: standard normal, or one of the raw forms of the issue."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen)
    if kind == "timestamp":  # a Unix time in milliseconds, over a few days
        x[:, TIMESTAMP_FEATURE] = 1.7e12 + 3e8 * torch.rand(n, generator=gen)
    elif kind != "standard":
        x = x * float(kind)
    return x


ESTIMATORS: dict[str, Callable[[], fsd.Estimator]] = {
    "EWC": lambda: fsd.EWC(),
    "KFAC": lambda: fsd.KFAC(),
    "LAFTR-gaussian": lambda: fsd.LAFTR(inputs="gaussian"),
    "LAFTR": lambda: fsd.LAFTR(coreset_size=8),
    "BGLN-D": lambda: fsd.BGLN(deterministic=True),
    "BGLN-S": lambda: fsd.BGLN(num_samples=8),
    "NTK": lambda: fsd.NTK(coreset_size=8),
    "ExactFSD": lambda: fsd.ExactFSD(),
}


# ----- 3: fit refuses what load would refuse; everything else loads ----------------------

@pytest.mark.parametrize("kind", ["timestamp", "1e10", "1e15", "1e20"])
@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_a_summary_either_refuses_at_fit_in_one_line_or_loads(name, kind, tmp_path):
    model = mlp([4, 6, 3], dtype=F32)
    x = _inputs(kind)
    try:
        est = ESTIMATORS[name]().fit(model, x)
    except ValueError as error:
        message = str(error)
        assert "\n" not in message and message.startswith(f"{type(ESTIMATORS[name]()).__name__}"
                                                          f".fit: ")
        assert "standardise the inputs" in message and "fsd.load would refuse" in message
        # the feature named is the one that is that large
        feature = int(x.abs().amax(0).argmax())
        assert f"feature {feature} of the inputs reaches " \
               f"{float(x.abs().amax(0)[feature]):.3g}" in message
        return
    moved = perturbed(model, 1e-3)
    est.save(tmp_path / "s.fsd")
    loaded = fsd.load(tmp_path / "s.fsd")
    torch.testing.assert_close(loaded.distance(moved), est.distance(moved), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["EWC", "KFAC"])
def test_a_unix_time_feature_names_that_feature(name):
    # the case: both store x²-scaled statistics (EWC's Fisher of the first layer's
    # weights, K-FAC's A factor), 2.9e24 for a feature of 1.7e12, beyond float32's 1.8e19
    with pytest.raises(ValueError, match=rf"feature {TIMESTAMP_FEATURE} of the inputs reaches "
                                         r"1\.7e\+12: standardise the inputs"):
        ESTIMATORS[name]().fit(mlp([4, 6, 3], dtype=F32), _inputs("timestamp"))


def test_the_limit_fit_applies_is_the_one_load_applies(tmp_path):
    # the same inputs in float64 give a summary in range, which loads; their float32 summary
    # carries the same values, beyond float32's limit, and fsd.load refuses that file
    x = _inputs("timestamp")
    model = mlp([4, 6, 3], dtype=torch.float64)
    est = fsd.EWC().fit(model, x.double())
    est.save(tmp_path / "f64.fsd")
    fsd.load(tmp_path / "f64.fsd")
    payload = est.to_payload()
    payload["tensors"] = {k: v.float() for k, v in payload["tensors"].items()}
    payload.pop("checksums")
    payload["version"] = 1  # consistency checks alone, as for a file before checksums
    with pytest.raises(fsd.SummaryFormatError, match=r"'fisher\.0\.weight'.*exceed 1\.84e\+19"):
        fsd.from_payload(payload)
    with pytest.raises(ValueError, match=r"'fisher\.0\.weight' reaches .* beyond 1\.84e\+19"):
        fsd.EWC().fit(mlp([4, 6, 3], dtype=F32), x)


def test_a_refused_fit_keeps_the_summary_fitted_before():
    model = mlp([4, 6, 3], dtype=F32)
    est = fsd.KFAC().fit(model, _inputs("standard"))
    moved = perturbed(model, 1e-2)
    before = est.distance(moved).item()
    with pytest.raises(ValueError, match="standardise the inputs"):
        est.fit(model, _inputs("1e10"))
    assert est.distance(moved).item() == before


def test_image_inputs_name_the_pixel_and_one_shot_data_the_remedy():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(12, 3))
    x = torch.randn(16, 2, 4, 4)
    x[:, 1, 2, 3] = 1e12
    with pytest.raises(ValueError, match=r"feature \(1, 2, 3\) of the inputs reaches 1e\+12"):
        fsd.EWC().fit(model, x)
    # a generator is read once: no feature to name, the remedy all the same
    with pytest.raises(ValueError, match=r"fsd\.load would refuse it; standardise the inputs"):
        fsd.EWC().fit(model, (b for b in [x]))


def test_a_huge_parameter_is_refused_at_fit_naming_it():
    model = mlp([4, 6, 3], dtype=F32)
    with torch.no_grad():
        model[2].weight[0, 0] = 1e20
    with pytest.raises(ValueError, match=r"'theta0\.2\.weight' reaches 1e\+20.*the parameter "
                                         r"'2\.weight' is that large: fit a float64 model"):
        fsd.ExactFSD().fit(model, _inputs("standard"))


def test_save_refuses_a_summary_changed_in_memory_and_keeps_the_old_file(tmp_path):
    model = mlp([4, 6, 3])
    est = fsd.EWC().fit(model, _inputs("standard").double())
    path = tmp_path / "s.fsd"
    est.save(path)
    old = path.read_bytes()
    est._stored["fisher.0.weight"] = -est._stored["fisher.0.weight"]
    with pytest.raises(fsd.SummaryFormatError,
                       match=rf"cannot save to {path}: .*'fisher\.0\.weight': has negative"):
        est.save(path)
    assert path.read_bytes() == old


def test_a_regularizer_refuses_a_task_that_would_not_load_and_keeps_the_others(tmp_path):
    model = mlp([4, 6, 3], dtype=F32)
    reg = fsd.ContinualRegularizer(fsd.EWC)
    reg.end_task(model, _inputs("standard"))
    with pytest.raises(ValueError, match=r"feature 3 of the inputs reaches 1\.7e\+12"):
        reg.end_task(perturbed(model, 0.1), _inputs("timestamp"))
    assert len(reg) == 1
    reg.save(tmp_path / "reg.fsd")
    moved = perturbed(model, 1e-2)
    loaded = fsd.ContinualRegularizer.load(tmp_path / "reg.fsd")
    assert len(loaded) == 1
    torch.testing.assert_close(loaded.penalty(moved), reg.penalty(moved), rtol=0, atol=0)


def test_a_regularizer_refuses_to_save_a_task_that_would_not_load(tmp_path):
    model = mlp([4, 6, 3])
    reg = fsd.ContinualRegularizer(fsd.EWC)
    for seed in range(2):
        reg.end_task(model, _inputs("standard", seed=seed).double())
    reg.save(tmp_path / "reg.fsd")
    old = (tmp_path / "reg.fsd").read_bytes()
    reg.summaries[1]._stored["theta0.0.bias"] = reg.summaries[1]._stored["theta0.0.bias"][:2]
    with pytest.raises(fsd.SummaryFormatError, match=r"\(task 1\).*'theta0\.0\.bias'"):
        reg.save(tmp_path / "reg.fsd")
    assert (tmp_path / "reg.fsd").read_bytes() == old


# ----- 4: a failed write names the target and the reason; nothing half-written ----------

def _saved(tmp_path: Path) -> tuple[fsd.Estimator, Path]:
    est = fsd.ExactFSD().fit(mlp([4, 6, 3]), _inputs("standard", n=2000).double())
    path = tmp_path / "s.fsd"
    fsd.EWC().fit(mlp([4, 6, 3]), _inputs("standard").double()).save(path)
    return est, path


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


@pytest.mark.parametrize("what", ["summary", "regularizer"])
def test_a_full_disk_names_the_target_and_leaves_the_old_file(what, tmp_path, monkeypatch):
    est, path = _saved(tmp_path)
    old = path.read_bytes()
    real_save = torch.save

    def on_a_full_disk(obj, f, *args, **kwargs):
        # some bytes reach the temporary file, then the disk is full
        if isinstance(f, (str, os.PathLike)):
            with open(f, "ab") as handle:
                handle.write(b"partial")
        else:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", on_a_full_disk)
    target = est if what == "summary" else fsd.ContinualRegularizer.from_summaries([est])
    with pytest.raises(OSError) as info:
        target.save(path)
    monkeypatch.setattr(torch, "save", real_save)
    message = str(info.value)
    assert f"cannot save to {path}: No space left on device" in message
    assert "\n" not in message and ".tmp" not in message
    assert info.value.errno == errno.ENOSPC
    assert path.read_bytes() == old and _leftovers(tmp_path) == []


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_a_file_size_limit_names_the_target_and_leaves_the_old_file(tmp_path):
    # the kernel refuses the write itself (ulimit -f): torch.save reports its writer's
    # OSError as "[enforce fail at inline_container.cc] unexpected pos", without the reason
    _, path = _saved(tmp_path)
    old = path.read_bytes()
    script = textwrap.dedent(f"""
        import resource, sys, torch, fsd
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from conftest import mlp
        x = torch.randn(4000, 4, dtype=torch.float64)
        est = fsd.ExactFSD().fit(mlp([4, 6, 3]), x)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        try:
            est.save({str(path)!r})
        except OSError as error:
            print(type(error).__name__, "|", error)
        except Exception as error:
            print("OTHER", type(error).__name__, "|", error)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             sys.path)}).stdout.strip()
    assert out == f"OSError | [Errno {errno.EFBIG}] cannot save to {path}: File too large"
    assert path.read_bytes() == old and _leftovers(tmp_path) == []


# ----- 5: FIFOs, devices and other non-files -------------------------------------------

def _load_in_a_thread(load: Callable[[], object], fifo: Path) -> BaseException | None:
    """``load()``'s exception, failing the test if it blocks (then unblocking it)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            load()
            outcome.append(None)
        except BaseException as error:  # handed to the test
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=20)
    if thread.is_alive():  # blocked in open(): a writer that closes at once ends it
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(timeout=20)
        pytest.fail(f"loading the FIFO {fifo} blocked")
    return outcome[0]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
@pytest.mark.parametrize("loader", ["fsd.load", "ContinualRegularizer.load"])
def test_loading_a_fifo_is_refused_at_once_naming_it(loader, tmp_path):
    fifo = tmp_path / "pipe.fsd"
    os.mkfifo(fifo)
    load = (lambda: fsd.load(fifo)) if loader == "fsd.load" else \
        (lambda: fsd.ContinualRegularizer.load(fifo))
    error = _load_in_a_thread(load, fifo)
    kind = "summary" if loader == "fsd.load" else "regularizer"
    assert isinstance(error, fsd.SummaryFormatError)
    assert str(error) == (f"{fifo} is not an fsd {kind} file: it is a FIFO, not "
                          f"a regular file")
    link = tmp_path / "link.fsd"  # a link to a FIFO is a FIFO
    link.symlink_to(fifo)
    assert isinstance(_load_in_a_thread(lambda: fsd.load(link), fifo), fsd.SummaryFormatError)


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="no /dev/null")
def test_loading_a_device_is_refused_naming_it():
    with pytest.raises(fsd.SummaryFormatError,
                       match=r"^/dev/null is not an fsd summary file: it is a character device"):
        fsd.load("/dev/null")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
@pytest.mark.parametrize("what", ["summary", "regularizer"])
def test_saving_over_a_fifo_is_refused_and_keeps_it(what, tmp_path):
    fifo = tmp_path / "pipe.fsd"
    os.mkfifo(fifo)
    est = fsd.EWC().fit(mlp([4, 6, 3]), _inputs("standard").double())
    target = est if what == "summary" else fsd.ContinualRegularizer.from_summaries([est])
    with pytest.raises(OSError, match=f"^cannot save to {fifo}: it is a FIFO"):
        target.save(fifo)
    assert fifo.is_fifo() and _leftovers(tmp_path) == []


# ----- 8: checksums over the whole file; versions ---------------------------------------

def _summary_file(tmp_path: Path) -> tuple[fsd.Estimator, nn.Module, Path]:
    model = mlp([4, 6, 3])
    est = fsd.KFAC().fit(model, _inputs("standard").double())
    est.save(tmp_path / "s.fsd")
    return est, model, tmp_path / "s.fsd"


def test_a_summary_whose_checksums_were_deleted_is_refused(tmp_path):
    _, _, path = _summary_file(tmp_path)
    payload = torch.load(path, weights_only=True)
    del payload["checksums"]
    payload["tensors"]["kfac.0.G"] = 2 * payload["tensors"]["kfac.0.G"]  # another distance
    torch.save(payload, tmp_path / "edited.fsd")
    with pytest.raises(fsd.SummaryFormatError, match="the checksums are missing"):
        fsd.load(tmp_path / "edited.fsd")


def test_a_summary_written_before_checksums_still_loads(tmp_path):
    # what fsd wrote before checksums: format version 1, no checksums entry
    est, model, path = _summary_file(tmp_path)
    payload = torch.load(path, weights_only=True)
    del payload["checksums"]
    payload["version"] = 1
    torch.save(payload, tmp_path / "old.fsd")
    moved = perturbed(model)
    torch.testing.assert_close(fsd.load(tmp_path / "old.fsd").distance(moved),
                               est.distance(moved), rtol=0, atol=0)


@pytest.mark.parametrize("what", ["summary", "regularizer"])
def test_a_later_format_version_says_to_upgrade(what, tmp_path):
    est, _, path = _summary_file(tmp_path)
    if what == "regularizer":
        fsd.ContinualRegularizer.from_summaries([est]).save(path)
    payload = torch.load(path, weights_only=True)
    payload["version"] += 1
    torch.save(payload, tmp_path / "later.fsd")
    load = fsd.load if what == "summary" else fsd.ContinualRegularizer.load
    with pytest.raises(fsd.SummaryFormatError,
                       match=rf"written by a newer fsd \({what} format version "
                             rf"{payload['version']}.*upgrade fsd") as info:
        load(tmp_path / "later.fsd")
    assert "\n" not in str(info.value)


def _regularizer_file(tmp_path: Path) -> tuple[fsd.ContinualRegularizer, nn.Module, Path]:
    model = mlp([4, 6, 3])
    reg = fsd.ContinualRegularizer(fsd.EWC, strength=2.0)
    for t in range(3):
        reg.end_task(perturbed(model, 0.1, seed=t), _inputs("standard", seed=t).double())
    reg.save(tmp_path / "reg.fsd")
    return reg, model, tmp_path / "reg.fsd"


@pytest.mark.parametrize("edit", [
    lambda p: p["summaries"].pop(1),
    lambda p: p["summaries"].append(p["summaries"][0]),
    lambda p: p["summaries"].reverse(),
    lambda p: p.__setitem__("strength", 3.0),
    lambda p: p.__setitem__("reduction", "mean"),
], ids=["dropped", "duplicated", "reordered", "strength", "reduction"])
def test_a_hand_edited_regularizer_file_is_refused(edit, tmp_path):
    _, _, path = _regularizer_file(tmp_path)
    payload = torch.load(path, weights_only=True)
    edit(payload)
    torch.save(payload, tmp_path / "edited.fsd")
    with pytest.raises(fsd.SummaryFormatError,
                       match="checksum mismatch over the settings and the task list"):
        fsd.ContinualRegularizer.load(tmp_path / "edited.fsd")


def test_a_regularizer_file_whose_checksum_was_deleted_or_renamed_is_refused(tmp_path):
    _, _, path = _regularizer_file(tmp_path)
    payload = torch.load(path, weights_only=True)
    payload["summaries"].pop(1)
    checksum = payload.pop("checksum")
    torch.save(payload, tmp_path / "deleted.fsd")
    with pytest.raises(fsd.SummaryFormatError, match="the checksum over the settings and the "
                                                     "task list is missing"):
        fsd.ContinualRegularizer.load(tmp_path / "deleted.fsd")
    payload["checksun"] = checksum
    torch.save(payload, tmp_path / "renamed.fsd")
    with pytest.raises(fsd.SummaryFormatError, match="unexpected entries 'checksun'"):
        fsd.ContinualRegularizer.load(tmp_path / "renamed.fsd")


def test_a_regularizer_file_written_before_its_checksum_still_loads(tmp_path):
    # what fsd wrote before the checksum over the task list: format version 1, no checksum
    reg, model, path = _regularizer_file(tmp_path)
    payload = torch.load(path, weights_only=True)
    del payload["checksum"]
    payload["version"] = 1
    torch.save(payload, tmp_path / "old.fsd")
    loaded = fsd.ContinualRegularizer.load(tmp_path / "old.fsd")
    moved = perturbed(model, 0.2, seed=7)
    assert len(loaded) == 3
    torch.testing.assert_close(loaded.penalty(moved), reg.penalty(moved), rtol=0, atol=0)


def test_the_committed_files_of_format_version_1_load():
    # written by fsd at 6ac99dd (version 1, with checksums); tests/test_model_calls.py
    # checks their distances
    folder = Path(__file__).parent / "data" / "summaries_before_calls"
    for path in sorted(folder.glob("*.pt")):
        assert torch.load(path, weights_only=True)["version"] == 1
        fsd.load(path)


def test_what_save_writes_is_the_current_format_version(tmp_path):
    _, _, path = _summary_file(tmp_path)
    assert torch.load(path, weights_only=True)["version"] == base.FORMAT_VERSION == 2
