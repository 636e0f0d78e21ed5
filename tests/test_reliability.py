"""No silent wrong numbers: in-place activations, forward hooks, models swapped after fit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fsd
from conftest import perturbed
from fsd.metrics import output_hessian_factors

DTYPE = torch.float64


def fisher_diagonal_brute_force(model: nn.Module, x: torch.Tensor, metric: str
                                ) -> dict[str, torch.Tensor]:
    """(1/N) Σ_i Σ_k (J_iᵀ h_ik)², one autograd call per example and factor."""
    params = dict(model.named_parameters())
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    for xi in x:
        z = model(xi.unsqueeze(0))[0]
        for h in output_hessian_factors(metric, z.detach().unsqueeze(0))[0]:
            grads = torch.autograd.grad((z * h).sum(), list(params.values()), retain_graph=True)
            for k, g in zip(params, grads, strict=True):
                total[k] += g.pow(2)
    return {k: v / x.shape[0] for k, v in total.items()}


class InPlaceForward(nn.Module):
    """An MLP whose forward rectifies in place, without a module for it."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        h.relu_()
        return self.second(h)


@pytest.mark.parametrize("build", [
    lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 3)),
    lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 8),
                          nn.LeakyReLU(0.1, inplace=True), nn.Linear(8, 3)),
    InPlaceForward,
])
@pytest.mark.parametrize("metric", ["kl", "euclidean"])
def test_ewc_fisher_with_in_place_activations_matches_per_example_brute_force(build, metric):
    torch.manual_seed(0)
    model = build().to(DTYPE)
    x = torch.randn(64, 4, dtype=DTYPE)
    ewc = fsd.EWC(fisher="true", metric=metric).fit(model, x)
    # the reference runs the same weights without in-place operations
    expected = fisher_diagonal_brute_force(model, x, metric)
    for name, value in expected.items():
        torch.testing.assert_close(ewc._state[f"fisher.{name}"], value, rtol=1e-10, atol=1e-14)


def _scale_output(module, args, output):
    return 10 * output


def _shift_input(module, args):
    return (args[0] + 1,)


@pytest.mark.parametrize("make", [
    lambda: fsd.LAFTR(inputs="coreset", coreset_size=None),
    lambda: fsd.BGLN(deterministic=True),
    lambda: fsd.BGLN(num_samples=4),
])
@pytest.mark.parametrize("register", [
    lambda m: m[0].register_forward_hook(_scale_output),
    lambda m: m[2].register_forward_pre_hook(_shift_input),
    lambda m: m.register_forward_hook(_scale_output),
    lambda m: nn.modules.module.register_module_forward_hook(_scale_output),
])
def test_rule_based_estimators_refuse_models_with_forward_hooks(make, register):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    handle = register(model)
    try:
        with pytest.raises(fsd.UnsupportedModuleError, match=r"hook .*remove it"):
            make().fit(model, torch.randn(32, 4))
    finally:
        handle.remove()
    make().fit(model, torch.randn(32, 4))  # and work again once the hook is gone


def test_statistics_collector_hooks_do_not_count_as_user_hooks():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with fsd.StatisticsCollector(model) as collector:
        with collector.record():
            model(torch.randn(32, 4))
        # a second collector and a fit while the first one's hooks are attached
        fsd.StatisticsCollector(model).remove()
        fsd.BGLN(deterministic=True).fit(model, torch.randn(32, 4))


@pytest.mark.parametrize("make", [lambda: fsd.ExactFSD(), lambda: fsd.NTK(coreset_size=None)])
def test_estimators_that_run_the_forward_honour_hooks(make):
    # hooks on both the reference and the moved network: the distance is that of the hooked
    # functions, 10·f; NTK is exact on a linear model
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3)).to(DTYPE)
    x = torch.randn(50, 4, dtype=DTYPE)
    moved = perturbed(model, 0.3)
    handles = [m.register_forward_hook(_scale_output) for m in (model[0], moved[0])]
    expected = 0.5 * (moved(x) - model(x)).pow(2).sum(-1).mean()
    value = make().fit(model, x).distance(moved)
    for handle in handles:
        handle.remove()
    torch.testing.assert_close(value, expected, rtol=1e-10, atol=1e-12)


def test_ewc_fisher_of_a_hooked_model_is_the_hooked_functions_fisher():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).to(DTYPE)
    x = torch.randn(32, 4, dtype=DTYPE)
    handle = model[0].register_forward_hook(_scale_output)
    try:
        ewc = fsd.EWC(fisher="true", metric="kl").fit(model, x)
        expected = fisher_diagonal_brute_force(model, x, "kl")
    finally:
        handle.remove()
    unhooked = fsd.EWC(fisher="true", metric="kl").fit(model, x)
    for name, value in expected.items():
        torch.testing.assert_close(ewc._state[f"fisher.{name}"], value, rtol=1e-10, atol=1e-14)
    assert not torch.allclose(unhooked._state["fisher.0.weight"], expected["0.weight"])


class TanhNet(nn.Module):
    """The same parameter shapes as the reference below, another forward."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def test_exact_fsd_compares_with_the_fitted_reference_whatever_model_came_first():
    torch.manual_seed(0)
    reference = TanhNet().to(DTYPE)
    reference.layers[1] = nn.ReLU()
    x = torch.randn(40, 4, dtype=DTYPE)
    relu_moved = perturbed(reference, 0.3)
    tanh_moved = TanhNet().to(DTYPE)
    tanh_moved.load_state_dict(perturbed(reference, 0.3, seed=2).state_dict())

    def truth(model):
        return 0.5 * (model(x) - reference(x)).pow(2).sum(-1).mean()

    for order in ([relu_moved, tanh_moved], [tanh_moved, relu_moved]):
        est = fsd.ExactFSD().fit(reference, x)
        for model in order:
            torch.testing.assert_close(est.distance(model), truth(model), rtol=1e-12, atol=0)
    # the stored outputs survive save/load
    est = fsd.ExactFSD().fit(reference, x)
    assert "data.f0" in est._state


def test_exact_fsd_summaries_without_stored_outputs_still_load(tmp_path):
    # a summary written before f(x, θ0) was stored evaluates it from θ0 with the model given
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).to(DTYPE)
    x = torch.randn(40, 4, dtype=DTYPE)
    moved = perturbed(model, 0.3)
    est = fsd.ExactFSD().fit(model, x)
    expected = est.distance(moved)
    del est._state["data.f0"]
    est.save(tmp_path / "old.fsd")
    torch.testing.assert_close(fsd.load(tmp_path / "old.fsd").distance(moved), expected,
                               rtol=1e-12, atol=0)


# ----- tampered or malformed summaries fail at load, naming the file and the field ---------

def _fitted_summaries():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(60, 4), torch.randint(0, 3, (60,))
    makers = {
        "exact": fsd.ExactFSD,
        "ntk": lambda: fsd.NTK(coreset_size=20),
        "ewc": lambda: fsd.EWC(fisher="true", metric="euclidean"),
        "laftr-coreset": lambda: fsd.LAFTR(inputs="coreset", coreset_size=20),
        "bgln-d": lambda: fsd.BGLN(deterministic=True, covariance="full"),
        "bgln-d-diag-cw": lambda: fsd.BGLN(deterministic=True, covariance="diag", classwise=True),
        "bgln-d-lowrank": lambda: fsd.BGLN(deterministic=True, covariance="lowrank", rank=2),
        "bgln-s-coreset-cw": lambda: fsd.BGLN(inputs="coreset", coreset_size=20, classwise=True),
        "bgln-d-layerwise": lambda: fsd.BGLN(deterministic=True, moments="exact",
                                             reference="layerwise"),
    }
    return model, {name: make().fit(model, [(x, y)], outputs=[0, 2])
                   for name, make in makers.items()}


MODEL, SUMMARIES = _fitted_summaries()


def _tampered(tmp_path, name, change):
    path = tmp_path / f"{name}.fsd"
    SUMMARIES[name].save(path)
    payload = torch.load(path, weights_only=True)
    change(payload["tensors"])
    torch.save(payload, path)
    return path


def _set(key, value):
    def change(tensors):
        tensors[key] = value(tensors[key]) if callable(value) else value
    return change


TAMPERING = [
    # (summary, what is changed, field the error must name)
    ("bgln-d", _set("input.cov", lambda c: -c), "input.cov"),
    ("bgln-d", _set("input.cov", lambda c: c[:, :3, :3]), "input.cov"),
    ("bgln-d", _set("input.mean", lambda m: m.long()), "input.mean"),
    ("bgln-d", _set("gate.1", lambda g: g + 1.5), "gate.1"),
    ("bgln-d", _set("weights", lambda w: 2 * w), "weights"),
    ("bgln-d", lambda t: t.pop("input.mean"), "input.mean"),
    ("bgln-d-diag-cw", _set("input.cov", lambda c: c - 10), "input.cov"),
    ("bgln-d-lowrank", _set("input.cov_residual", lambda r: r - 10), "input.cov_residual"),
    ("bgln-d-lowrank", _set("input.cov_factor", lambda f: f[..., :1, :]), "input.cov_factor"),
    ("bgln-d-layerwise", _set("layer.2.cov", lambda c: -c), "layer.2.cov"),
    ("ewc", _set("fisher.0.weight", lambda f: -f), "fisher.0.weight"),
    ("ewc", _set("fisher.2.bias", lambda f: f[:2]), "fisher.2.bias"),
    ("ewc", lambda t: t.pop("fisher.0.bias"), "fisher.0.bias"),
    ("exact", _set("data.x", lambda x: x.long()), "data.x"),
    ("exact", _set("data.f0", lambda f: f[:5]), "data.f0"),
    ("exact", _set("data.x", lambda x: x.fill_(float("nan"))), "data.x"),
    ("ntk", _set("coreset.x", lambda x: x[0]), "coreset.x"),
    ("laftr-coreset", _set("theta0.0.weight", lambda w: w[:, :3]), "theta0.0.weight"),
    ("bgln-s-coreset-cw", _set("coreset.group", lambda g: g[:3]), "coreset.group"),
    ("bgln-s-coreset-cw", _set("outputs", lambda o: o.float()), "outputs"),
    ("ntk", _set("outputs", torch.tensor([-1])), "outputs"),
]


@pytest.mark.parametrize("name,change,field", TAMPERING,
                         ids=[f"{n}:{f}:{i}" for i, (n, _, f) in enumerate(TAMPERING)])
def test_tampered_summaries_are_refused_at_load(tmp_path, name, change, field):
    path = _tampered(tmp_path, name, change)
    with pytest.raises(fsd.SummaryFormatError) as info:
        fsd.load(path)
    message = str(info.value)
    assert str(path) in message and repr(field) in message and "\n" not in message


@pytest.mark.parametrize("name", sorted(SUMMARIES))
def test_untouched_summaries_load_and_give_the_same_distance(tmp_path, name):
    path = tmp_path / f"{name}.fsd"
    SUMMARIES[name].save(path)
    moved = perturbed(MODEL, 0.1)
    torch.testing.assert_close(fsd.load(path).distance(moved), SUMMARIES[name].distance(moved),
                               rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("content", [b"", b"hello", bytes(range(256)) * 3, "truncated"])
def test_unreadable_summary_files_are_one_line_errors(tmp_path, content):
    path = tmp_path / "summary.fsd"
    if content == "truncated":
        SUMMARIES["ewc"].save(path)
        content = path.read_bytes()[:400]
    path.write_bytes(content)
    with pytest.raises(fsd.SummaryFormatError) as info:
        fsd.load(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message and "weights_only" not in message


def test_save_to_a_directory_is_a_clear_error_and_leaves_nothing(tmp_path):
    with pytest.raises(IsADirectoryError, match="is a directory: give the summary a file name"):
        SUMMARIES["ewc"].save(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_saved_summaries_get_the_usual_file_mode(tmp_path):
    import os
    old = os.umask(0o022)
    try:
        SUMMARIES["ewc"].save(tmp_path / "a.fsd")
    finally:
        os.umask(old)
    assert (tmp_path / "a.fsd").stat().st_mode & 0o777 == 0o644


def test_a_save_killed_before_its_rename_is_cleaned_by_the_next_save_to_that_file(tmp_path):
    import os
    import subprocess
    import sys
    import time

    # a real SIGKILL between writing the temporary file and renaming it
    killed = subprocess.run([sys.executable, "-c", """
import os, signal, sys, torch, fsd
def kill(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
os.replace = kill
fsd.EWC().fit(torch.nn.Linear(2, 1), torch.randn(4, 2)).save(sys.argv[1])
""", str(tmp_path / "a.fsd")], capture_output=True)
    assert killed.returncode == -9, killed.stderr
    leftover = [p.name for p in tmp_path.iterdir()]
    assert len(leftover) == 1 and leftover[0].startswith(".fsd-a.fsd.")
    an_hour_ago = time.time() - 3700
    os.utime(tmp_path / leftover[0], (an_hour_ago, an_hour_ago))
    # a recent one may be another process's save in progress; other targets' are theirs
    for name in (".fsd-a.fsd.recent.tmp", ".fsd-b.fsd.old.tmp"):
        (tmp_path / name).write_bytes(b"")
    os.utime(tmp_path / ".fsd-b.fsd.old.tmp", (an_hour_ago, an_hour_ago))
    SUMMARIES["ewc"].save(tmp_path / "a.fsd")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".fsd-a.fsd.recent.tmp", ".fsd-b.fsd.old.tmp", "a.fsd"]
    fsd.load(tmp_path / "a.fsd")


def test_save_into_a_folder_it_cannot_write_names_the_path_not_a_temporary(tmp_path,
                                                                           monkeypatch):
    import tempfile

    target = tmp_path / "missing" / "a.fsd"
    with pytest.raises(FileNotFoundError) as info:
        SUMMARIES["ewc"].save(target)
    assert str(info.value) == f"cannot save to {target}: its folder {target.parent} does not exist"

    def refuse(*args, **kwargs):  # a read-only folder (root would ignore a chmod)
        raise PermissionError(13, "Permission denied", str(tmp_path / ".fsd-a.fsd.x.tmp"))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(PermissionError) as info:
        SUMMARIES["ewc"].save(tmp_path / "a.fsd")
    assert str(info.value) == (f"cannot save to {tmp_path / 'a.fsd'}: its folder {tmp_path} "
                               "cannot be written (Permission denied)")


# ----- bad input at fit: one clear error, before any work ---------------------------------

def _mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


ALL_ESTIMATORS = [fsd.ExactFSD, fsd.LAFTR, lambda: fsd.BGLN(deterministic=True),
                  lambda: fsd.BGLN(num_samples=4), fsd.NTK, fsd.EWC]


@pytest.mark.parametrize("make", ALL_ESTIMATORS)
@pytest.mark.parametrize("call,message", [
    (lambda e, m: e.fit(m, [{"x": torch.randn(8, 4)}]), "is a dict"),
    (lambda e, m: e.fit(m, torch.randn(8, 4), outputs=[-1]), "non-negative integer output indices"),
    (lambda e, m: e.fit(m, torch.randn(8, 4), outputs=[0, 3]), "out of range"),
    (lambda e, m: e.fit(m, torch.randn(8, 5)), "cannot run on the data.*shape \\(8, 5\\)"),
    (lambda e, m: e.fit(m, (x for x in [])), "empty"),
])
def test_bad_data_or_outputs_fail_at_fit_with_one_line(make, call, message):
    with pytest.raises(ValueError, match=message) as info:
        call(make(), _mlp())
    assert "\n" not in str(info.value)


def test_a_generator_of_batches_still_reaches_fit_whole():
    torch.manual_seed(0)
    model = _mlp().double()
    batches = [torch.randn(10, 4, dtype=DTYPE) for _ in range(3)]
    from_list = fsd.ExactFSD().fit(model, batches)
    from_generator = fsd.ExactFSD().fit(model, (b for b in batches))
    assert from_generator._state["data.x"].shape[0] == 30
    torch.testing.assert_close(from_generator._state["data.x"], from_list._state["data.x"])


@pytest.mark.parametrize("labels", [torch.tensor([-1, 0, 1, 2] * 5), torch.full((20,), 0.5)])
def test_classwise_summaries_refuse_labels_that_are_not_classes(labels):
    with pytest.raises(ValueError, match="class labels must"):
        fsd.BGLN(deterministic=True, classwise=True).fit(_mlp(), [(torch.randn(20, 4), labels)])


@pytest.mark.parametrize("make,message", [
    (lambda: fsd.ExactFSD(batch_size=0), "batch_size must be a positive int"),
    (lambda: fsd.EWC(chunk_size=0), "chunk_size must be a positive int"),
    (lambda: fsd.NTK(coreset_size=0), "coreset_size must be a positive int or None"),
    (lambda: fsd.LAFTR(coreset_size=-3), "coreset_size must be a positive int or None"),
    (lambda: fsd.BGLN(num_samples=2.5), "num_samples must be a positive int"),
])
def test_bad_constructor_arguments_fail_at_construction(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# ----- the data forms PyTorch users pass -----------------------------------------------------

def _forms():
    from torch.utils.data import DataLoader, TensorDataset
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 4, generator=g, dtype=DTYPE)
    y = torch.randint(0, 3, (48,), generator=g)
    task = torch.zeros(48, dtype=torch.long)
    return x, y, {
        "tensor": (x, {}),
        "(X, Y) pair": ((x, y), {}),
        "list of (x, y)": ([(x[:20], y[:20]), (x[20:], y[20:])], {}),
        "TensorDataset": (TensorDataset(x, y), {}),
        "DataLoader of (x, y, task)": (DataLoader(TensorDataset(x, y, task), batch_size=16), {}),
        "dict batches": ([{"image": x[:30], "label": y[:30]}, {"image": x[30:], "label": y[30:]}],
                         {"batch_to_input": lambda b: (b["image"], b["label"])}),
    }


@pytest.mark.parametrize("make", [fsd.ExactFSD,
                                  lambda: fsd.BGLN(deterministic=True, classwise=True),
                                  lambda: fsd.EWC(metric="euclidean"), fsd.KFAC])
@pytest.mark.parametrize("form", list(_forms()[2]))
def test_every_data_form_gives_the_summary_of_one_labelled_batch(make, form):
    x, y, forms = _forms()
    data, kwargs = forms[form]
    model = _mlp().double()
    if form == "tensor" and getattr(make(), "needs_labels", False):
        with pytest.raises(ValueError, match="need labels"):
            make().fit(model, data)
        return
    moved = perturbed(model, 0.2)
    expected = make().fit(model, [(x, y)]).distance(moved)
    torch.testing.assert_close(make().fit(model, data, **kwargs).distance(moved), expected,
                               rtol=1e-10, atol=1e-14)


def test_batches_of_another_form_say_what_is_accepted():
    with pytest.raises(ValueError, match="batch_to_input"):
        fsd.EWC().fit(_mlp(), [{"image": torch.randn(4, 4)}])
    with pytest.raises(ValueError, match=r"is a str.*batch_to_input"):
        fsd.EWC().fit(_mlp(), ["not a batch"])


def test_influence_functions_take_a_dataloader_of_the_training_set():
    from torch.utils.data import DataLoader, TensorDataset

    from fsd.uses import influence

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1)).double()
    x, y = torch.randn(30, 3, dtype=DTYPE), torch.randn(30, 1, dtype=DTYPE)
    loader = DataLoader(TensorDataset(x, y), batch_size=7)
    common = dict(loss="squared", damping=0.1, steps=5, lr=0.1, progress=False)
    from_tensors = influence.pbrf_scores(model, x, y, range(4), "ewc", **common)
    from_loader = influence.pbrf_scores(model, loader, None, range(4), "ewc", **common)
    assert from_loader.tolist() == from_tensors.tolist()
    cg = influence.cg_scores(model, TensorDataset(x, y), None, range(4), progress=False)[0]
    assert cg.tolist() == influence.cg_scores(model, x, y, range(4), progress=False)[0].tolist()
    with pytest.raises(ValueError, match="targets are missing"):
        influence.make_term("ewc", model, x, None, "squared")
