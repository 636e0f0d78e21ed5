"""Fitting on torch.distributed: 2 and 3 CPU processes (gloo), each with its own shard.

Every rank must end with the summary one process fits on the union of the shards (to 1e-6
relative), coresets must be one uniform draw of the union that all ranks agree on, and a DDP
training step with the penalty must leave the ranks' parameters identical.
"""

from __future__ import annotations

import copy
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fsd

DTYPE = torch.float64
N = 90


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 12), nn.ReLU(), nn.Linear(12, 12), nn.ReLU(),
                         nn.Linear(12, 3)).to(DTYPE)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 5, generator=g, dtype=DTYPE)
    return x, torch.randint(0, 3, (N,), generator=g)


ESTIMATORS = {
    "bgln-d": lambda: fsd.BGLN(deterministic=True),
    "bgln-d-exact-cw": lambda: fsd.BGLN(deterministic=True, moments="exact", classwise=True),
    "bgln-d-diag": lambda: fsd.BGLN(deterministic=True, covariance="diag"),
    "bgln-d-layerwise": lambda: fsd.BGLN(deterministic=True, reference="layerwise"),
    "laftr-gaussian": lambda: fsd.LAFTR(inputs="gaussian", num_samples=8),
    "ewc": lambda: fsd.EWC(metric="kl"),
    "kfac": lambda: fsd.KFAC(metric="kl"),
    "exact": fsd.ExactFSD,
}
CORESETS = {
    "ntk": lambda: fsd.NTK(coreset_size=20),
    "bgln-s-coreset-cw": lambda: fsd.BGLN(inputs="coreset", coreset_size=20, classwise=True),
    "laftr-all": lambda: fsd.LAFTR(inputs="coreset", coreset_size=None),
}


def _shard(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _data()
    bounds = torch.linspace(0, N, world + 1).round().long().tolist()
    return x[bounds[rank]:bounds[rank + 1]], y[bounds[rank]:bounds[rank + 1]]


def _batches(x, y, size=16):
    return [(x[i:i + size], y[i:i + size]) for i in range(0, x.shape[0], size)]


def _worker(rank: int, world: int, directory: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous",
                            rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        model = _model()
        x, y = _shard(rank, world)
        out = {}
        for name, make in {**ESTIMATORS, **CORESETS}.items():
            out[name] = dict(make().fit(model, _batches(x, y))._stored)
        # statistics recorded during "training", then fit from them
        collector = fsd.StatisticsCollector(model)
        with collector:
            for xb, yb in _batches(x, y):
                with collector.record(labels=yb):
                    model(xb)
            out["collector-cw"] = dict(fsd.BGLN(deterministic=True, classwise=True).fit(
                model, statistics=collector)._stored)
        # one DDP step with the penalty of a distributedly fitted regularizer
        reg = fsd.ContinualRegularizer(lambda: fsd.BGLN(deterministic=True, moments="exact"),
                                       strength=3.0)
        reg.end_task(model, _batches(x, y))
        ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        with torch.no_grad():
            for p in ddp.parameters():
                p.add_(0.05)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        xb, yb = _shard(rank, world)  # a different batch on every rank
        loss = nn.functional.cross_entropy(ddp(xb), yb) + reg.penalty(ddp.module)
        loss.backward()
        optimizer.step()
        out["ddp"] = {k: v.detach() for k, v in ddp.module.state_dict().items()}
        torch.save(out, os.path.join(directory, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run(world: int, tmp_path) -> list[dict]:
    mp.start_processes(_worker, args=(world, str(tmp_path)), nprocs=world, join=True,
                       start_method="spawn")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def ranks(request, tmp_path_factory):
    return _run(request.param, tmp_path_factory.mktemp(f"world{request.param}"))


def _assert_same_summary(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-12, msg=key)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_every_rank_holds_the_single_process_summary_of_the_union(ranks, name):
    x, y = _data()
    expected = dict(ESTIMATORS[name]().fit(_model(), _batches(x, y))._stored)
    for out in ranks:
        _assert_same_summary(out[name], expected)


def test_statistics_collected_in_training_merge_over_ranks(ranks):
    x, y = _data()
    model = _model()
    expected = dict(fsd.BGLN(deterministic=True, classwise=True).fit(model, [(x, y)])._stored)
    for out in ranks:
        _assert_same_summary(out["collector-cw"], expected)


@pytest.mark.parametrize("name", sorted(CORESETS))
def test_coresets_are_one_draw_of_the_union_that_all_ranks_share(ranks, name):
    x, _ = _data()
    first = ranks[0][name]["coreset.x"]
    size = N if name == "laftr-all" else 20
    assert first.shape == (size, 5)
    rows = {tuple(r.tolist()) for r in x}
    assert all(tuple(r.tolist()) in rows for r in first)  # drawn from the data
    assert len({tuple(r.tolist()) for r in first}) == size  # without repetition
    for out in ranks[1:]:
        torch.testing.assert_close(out[name]["coreset.x"], first, rtol=0, atol=0)
    if name == "laftr-all":
        torch.testing.assert_close(first, x, rtol=0, atol=0)  # all of it, in order


def test_a_ddp_step_with_the_penalty_keeps_ranks_identical(ranks):
    for out in ranks[1:]:
        for key, value in ranks[0]["ddp"].items():
            torch.testing.assert_close(out["ddp"][key], value, rtol=0, atol=0)
    moved = any(not torch.allclose(ranks[0]["ddp"][k], v + 0.05)
                for k, v in _model().state_dict().items())
    assert moved


def test_coreset_shards_are_sampled_uniformly():
    # the union draw: each of 12 points in a 2-rank split (3 + 9 points) lands in a 4-point
    # coreset with probability 1/3; simulated with the same merge as fsd's, 3000 draws
    from fsd.statistics.coreset import Reservoir

    counts = torch.zeros(12)
    for seed in range(3000):
        parts = []
        for rank_, (lo, hi) in enumerate([(0, 3), (3, 12)]):
            generator = torch.Generator().manual_seed(seed)
            reservoir = Reservoir(4, generator)
            generator.manual_seed(seed + 1 + rank_)  # what a rank does under torch.distributed
            reservoir.add(torch.arange(lo, hi, dtype=DTYPE).unsqueeze(1), None)
            parts.append((torch.stack(reservoir.x), None, reservoir.seen))
        merged = Reservoir(4, torch.Generator().manual_seed(seed))
        from unittest import mock
        with mock.patch("fsd.statistics.distributed.gather_objects", return_value=parts):
            x, _ = merged._union_sample(parts[0][0], None)
        counts[x[:, 0].long()] += 1
    frequency = counts / 3000
    # binomial standard error √(p(1−p)/n) ≈ 0.0086; 5 standard errors
    assert torch.all((frequency - 1 / 3).abs() < 5 * 0.0086), frequency


def _refusal_worker(rank: int, world: int, directory: str) -> None:
    # a short timeout: before the check, the ranks that had data waited for the empty one
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous",
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    torch.set_num_threads(1)
    messages = {}
    try:
        x, y = _shard(rank, world)
        cases = {
            # rank 1's shard is empty: a DataLoader over no examples, or an empty tensor
            "empty-loader": (_model(), [] if rank == 1 else _batches(x, y), fsd.EWC),
            "empty-tensor": (_model(), x[:0] if rank == 1 else x,
                             lambda: fsd.BGLN(deterministic=True)),
            # rank 1 fits another network
            "theta0": (perturbed_last_layer(_model()) if rank == 1 else _model(),
                       _batches(x, y), fsd.KFAC),
        }
        for case, (model, data, make) in cases.items():
            try:
                make().fit(model, data)
                messages[case] = None
            except Exception as error:  # recorded for the parent to compare
                messages[case] = f"{type(error).__name__}: {error}"
        # the group still works: the same fit on every rank succeeds afterwards
        fsd.EWC().fit(_model(), _batches(x, y))
        messages["after"] = "ok"
    finally:
        torch.save(messages, os.path.join(directory, f"refusal{rank}.pt"))
        dist.destroy_process_group()


def perturbed_last_layer(model: nn.Sequential) -> nn.Sequential:
    with torch.no_grad():
        model[4].weight[0, 0] += 1e-6
    return model


def test_a_rank_that_cannot_fit_fails_every_rank_with_one_line(tmp_path):
    world = 2
    mp.start_processes(_refusal_worker, args=(world, str(tmp_path)), nprocs=world,
                       join=True, start_method="spawn")
    got = [torch.load(tmp_path / f"refusal{r}.pt", weights_only=True) for r in range(world)]
    expected = {
        "empty-loader": "DistributedFitError: rank 1 of 2 cannot fit: no data: the data "
                        "iterable is empty",
        "empty-tensor": "DistributedFitError: rank 1 of 2 cannot fit: data is empty: fit "
                        "needs at least one example",
        "theta0": "DistributedFitError: the ranks hold different reference networks: "
                  "parameter '4.weight' on rank 1 of 2 differs from rank 0's; every rank "
                  "must fit the same θ0 (load or broadcast the same weights before fit)",
        "after": "ok",
    }
    for messages in got:  # the same one line on every rank
        assert messages == expected
