"""BGLN-S on models without gates: nothing to sample, so it is LAFTR with the same inputs.

A model with no ReLU-type or smooth activation (an Embedding → mean-pool → Linear classifier
on token ids, a Linear–Linear chain, an LSTM/GRU classifier whose nonlinearities are inside
the recurrent module) gives BGLN-S no gate to draw: every operation is linearized as LAFTR
linearizes it, so on the same coreset its distance is LAFTR's, to the last bit. Before, BGLN-S
with ``inputs="coreset"`` failed at fit with "no examples were recorded": its collector records
no input moments and had no gate hook to fire, so it counted no examples.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fsd
import zoo_models as zoo
from conftest import labelled_batches, linear_net, perturbed
from fsd.statistics.collector import distributed

pytestmark = pytest.mark.usefixtures("single_thread")

DTYPE = torch.float64
VOCAB, LENGTH = 10, 6


class _MeanPooledTokens(nn.Module):
    """Embedding → mean over the sequence → Linear: no activation anywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.fc = nn.Embedding(VOCAB, 4), nn.Linear(4, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc(self.embedding(tokens).mean(1))


def _tokens(n: int = 30, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n, LENGTH), generator=g), torch.randint(0, 3, (n,),
                                                                            generator=g)


def _models():
    torch.manual_seed(0)
    x, y = _tokens()
    yield "embedding", _MeanPooledTokens().to(DTYPE), x, y
    (xv, yv), = labelled_batches(30, (5,), batch=30)
    yield "linear-linear", linear_net([5, 6, 3]), xv, yv
    for name in ("lstm-text", "gru-text"):
        model, tokens = zoo.build(name)
        yield name, model, tokens, torch.arange(len(tokens)) % 3


MODELS = {name: (model, x, y) for name, model, x, y in _models()}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("coreset_size", [None, 7])
def test_bgln_s_with_a_coreset_is_laftr_on_the_same_coreset(name, coreset_size):
    model, x, _ = MODELS[name]
    moved = perturbed(model, 0.1, seed=3)
    laftr = fsd.LAFTR(inputs="coreset", coreset_size=coreset_size).fit(model, x)
    bgln = fsd.BGLN(inputs="coreset", coreset_size=coreset_size).fit(model, x)
    torch.testing.assert_close(bgln._stored["coreset.x"], laftr._stored["coreset.x"],
                               rtol=0, atol=0)
    expected = laftr.distance(moved)
    assert float(expected.detach()) > 0
    torch.testing.assert_close(bgln.distance(moved), expected, rtol=0, atol=0)
    assert float(bgln.distance(model).detach().abs()) < 1e-12  # zero at θ0


@pytest.mark.parametrize("name", ["embedding", "linear-linear"])
def test_class_wise_bgln_s_counts_each_class(name):
    # the mixture weights are the classes' shares of the data (bincount), the coreset's
    # components its labels, and the distance is still LAFTR's on the same coreset
    model, x, y = MODELS[name]
    moved = perturbed(model, 0.1, seed=3)
    batches = [(x[:13], y[:13]), (x[13:], y[13:])]
    bgln = fsd.BGLN(inputs="coreset", coreset_size=None, classwise=True).fit(model, batches)
    counts = torch.bincount(y).to(DTYPE)
    torch.testing.assert_close(bgln._stored["weights"], counts / counts.sum(), rtol=0, atol=0)
    assert bgln._meta["groups"] == [[0], [1], [2]]
    torch.testing.assert_close(bgln._stored["coreset.group"], y, rtol=0, atol=0)
    laftr = fsd.LAFTR(inputs="coreset", coreset_size=None).fit(model, batches)
    torch.testing.assert_close(bgln.distance(moved), laftr.distance(moved), rtol=0, atol=0)


def test_statistics_recorded_during_training_fit_a_gateless_model():
    # the collector BGLN-S hands out, recorded in "training", then fit from it
    model, x, y = MODELS["embedding"]
    est = fsd.BGLN(inputs="coreset", coreset_size=None, classwise=True)
    collector = est.statistics_collector(model)
    assert collector is not None
    with collector:
        for i in range(0, len(x), 8):
            with collector.record(labels=y[i:i + 8]):
                model(x[i:i + 8])
    assert collector.count == len(x)
    est.fit(model, [(x, y)], statistics=collector)
    counts = torch.bincount(y).to(DTYPE)
    torch.testing.assert_close(est._stored["weights"], counts / counts.sum(), rtol=0, atol=0)
    moved = perturbed(model, 0.1, seed=3)
    laftr = fsd.LAFTR(inputs="coreset", coreset_size=None).fit(model, x)
    torch.testing.assert_close(est.distance(moved), laftr.distance(moved), rtol=0, atol=0)


def test_a_gateless_collector_merges_its_counts_over_ranks(monkeypatch):
    # two "ranks", each with its shard: the merged weights are those of the union
    model, x, y = MODELS["embedding"]
    shards = [(x[:11], y[:11]), (x[11:], y[11:])]
    collectors = []
    for xs, ys in shards:
        collector = fsd.StatisticsCollector(model, moments=None, gates=True)
        with collector, collector.record(labels=ys):
            model(xs)
        collectors.append(collector)
    local = [c._merged_over_ranks() for c in collectors]  # each one's own (one process)
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "gather_objects", lambda obj: local)
    stats = collectors[0].finalize(classwise=True)
    counts = torch.bincount(y).to(DTYPE)
    torch.testing.assert_close(stats.weights, counts / counts.sum(), rtol=0, atol=0)
    assert stats.groups == [[0], [1], [2]] and stats.gate_means == {}
    assert stats.input_shape == (LENGTH,)


def test_bgln_s_with_gaussian_inputs_is_laftr_with_them():
    # float inputs: the same Gaussian samples (one generator, no gate draws between them)
    model, x, _ = MODELS["linear-linear"]
    moved = perturbed(model, 0.1, seed=3)
    options = {"inputs": "gaussian", "covariance": "full", "num_samples": 16}
    laftr = fsd.LAFTR(**options).fit(model, x)
    bgln = fsd.BGLN(**options).fit(model, x)
    torch.testing.assert_close(bgln.distance(moved), laftr.distance(moved), rtol=0, atol=0)
