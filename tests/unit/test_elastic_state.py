"""Elastic state on one process (a size-1 job, no Ray): commit/restore/sync, the run loop, the sampler,
and the driver's blacklist."""

from __future__ import annotations


import pytest
import torch

import hvdray.torch as hvd
from hvdray.collective.errors import HvdrayError
from hvdray.torch import elastic as torch_elastic


@pytest.fixture(autouse=True)
def size_one_job():
    hvd.init()
    yield
    hvd.shutdown()


def test_object_state_commit_and_restore_deep_copies():
    state = hvd.elastic.ObjectState(epoch=0, history=[])
    state.history.append("a")
    state.epoch = 1
    state.commit()
    state.history.append("b")
    state.epoch = 2
    state.restore()
    assert (state.epoch, state.history) == (1, ["a"])
    state.history.append("c")
    state.restore()
    assert state.history == ["a"], "restore must hand out a copy, not the saved object"


def test_torch_state_rolls_back_model_optimizer_and_attributes():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt, epoch=0)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    state.epoch = 1
    state.commit()
    committed = [p.detach().clone() for p in model.parameters()]
    momentum = opt.state_dict()["state"][0]["momentum_buffer"].clone()
    opt.zero_grad()
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    state.epoch = 2
    state.restore()
    assert state.epoch == 1
    assert all(torch.equal(a, b) for a, b in zip(committed, model.parameters()))
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], momentum)


def test_restore_discards_reductions_in_flight():
    model = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt)
    model(torch.ones(2, 3)).sum().backward()  # hooks submitted the gradients; no step() follows
    state.restore()
    hvd.shutdown()  # what hvd.elastic.run does after a restore: a fresh engine
    hvd.init()
    opt.zero_grad()  # would raise "zero_grad() after backward() but before step()" without the discard
    model(torch.ones(2, 3)).sum().backward()
    opt.step()


def test_run_syncs_calls_and_returns():
    state = hvd.elastic.ObjectState(epoch=0)
    calls = []

    @hvd.elastic.run
    def train(state, until):
        while state.epoch < until:
            calls.append(state.epoch)
            state.epoch += 1
            state.commit()
        return "done"

    assert train(state, 3) == "done"
    assert calls == [0, 1, 2]


def test_run_outside_an_elastic_job_rolls_back_then_says_why_it_cannot_reset():
    state = hvd.elastic.ObjectState(epoch=0)

    @hvd.elastic.run
    def train(state):
        state.epoch = 5
        raise hvd.HorovodInternalError("peer lost")

    with pytest.raises(HvdrayError, match="not elastic"):
        train(state)
    assert state.epoch == 0


def test_run_needs_a_state():
    with pytest.raises(TypeError, match="must be a State"):
        hvd.elastic.run(lambda state: None)(object())


def test_reset_callbacks_and_host_updates_interrupt():
    state = hvd.elastic.ObjectState()
    seen = []
    state.register_reset_callbacks([lambda: seen.append(hvd.size())])
    state.on_reset()
    assert seen == [1]
    with pytest.raises(TypeError, match="callables"):
        state.register_reset_callbacks([3])
    assert hvd.elastic.HostsUpdatedInterrupt(skip_sync=True).skip_sync
    state.check_host_updates()  # no driver, no updates: returns quietly


def _shards(sampler_cls, dataset, size, processed=(), epoch=0, monkeypatch=None):
    shards = []
    for rank in range(size):
        monkeypatch.setattr(torch_elastic, "_current_rank", lambda rank=rank: rank)
        monkeypatch.setattr(torch_elastic, "_current_size", lambda: size)
        sampler = sampler_cls(dataset, shuffle=True, seed=3)
        sampler.load_state_dict({"epoch": epoch, "processed_indices": set(processed)})
        shards.append(list(sampler))
    return shards


def test_elastic_sampler_shards_cover_the_rest_after_a_resize(monkeypatch):
    """Three ranks process two batches each, then the job shrinks to two: what is left is shared out."""
    dataset = list(range(23))
    three = _shards(hvd.elastic.ElasticSampler, dataset, 3, monkeypatch=monkeypatch)
    assert len({len(s) for s in three}) == 1 and set().union(*map(set, three)) == set(dataset)
    processed = {i for shard in three for i in shard[:4]}  # two batches of 2 on every rank
    two = _shards(hvd.elastic.ElasticSampler, dataset, 2, processed=processed, monkeypatch=monkeypatch)
    remaining = set(dataset) - processed
    assert set(two[0]) | set(two[1]) == remaining
    assert len(two[0]) == len(two[1]) == -(-len(remaining) // 2)


def test_elastic_sampler_record_batch_and_set_epoch():
    sampler = hvd.elastic.ElasticSampler(list(range(10)), shuffle=False)
    assert list(sampler) == list(range(10)) and len(sampler) == 10
    sampler.record_batch(0, 4)
    assert sampler.processed_indices == {0, 1, 2, 3}
    sampler.reset()
    assert list(sampler) == list(range(4, 10))
    sampler.set_epoch(1)
    assert len(sampler) == 10 and sampler.epoch == 1


def test_torch_state_commits_and_restores_sampler_progress():
    sampler = hvd.elastic.ElasticSampler(list(range(8)), shuffle=False)
    state = hvd.elastic.TorchState(sampler=sampler, epoch=0)
    assert state.sampler is sampler
    sampler.record_batch(0, 2)
    state.commit()
    sampler.record_batch(1, 2)
    state.restore()
    assert sampler.processed_indices == {0, 1}
    assert list(sampler) == list(range(2, 8))


def test_torch_state_rejects_wrong_types():
    with pytest.raises(TypeError, match="model"):
        hvd.elastic.TorchState(model="not a module")
    with pytest.raises(TypeError, match="optimizer"):
        hvd.elastic.TorchState(optimizer=3)
