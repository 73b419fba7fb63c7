"""Data-parallel support of the torch adapter on the CPU: synchronised batch norm over two Gloo ranks
against one BatchNorm1d over both ranks' voxels, the conversion of a network, and the exchange that
makes two ranks with different measurements choose alike."""

import json

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from cupysparse.adapters import torch as cst  # noqa: E402
from cupysparse.adapters.torch.networks import MinkUNet18  # noqa: E402

import distributed_worker  # noqa: E402
from distributed_runs import assert_one_batch_norm_over_both_ranks, run_two_ranks  # noqa: E402

needs_gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="no Gloo backend")


@pytest.fixture(scope="module")
def batch_norm_runs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("sync_batch_norm")
    run_two_ranks("sync_batch_norm", out_dir)
    return out_dir


@needs_gloo
@pytest.mark.parametrize("case", sorted(distributed_worker.BATCH_NORM_ROWS))
def test_sync_batch_norm_over_two_ranks_is_one_batch_norm_over_their_voxels(batch_norm_runs, case):
    assert_one_batch_norm_over_both_ranks(batch_norm_runs, case, "float64", rtol=1e-10, atol=1e-12)


@needs_gloo
def test_two_ranks_with_different_measurements_choose_alike_after_sharing(tmp_path):
    # The ranks' own measurements only: the shipped file may hold the problems' keys.
    run_two_ranks("share_tuning", tmp_path, CUPYSPARSE_SHIPPED_CACHE="0")
    ranks = [json.loads((tmp_path / f"share_tuning_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["before"]["shared"] != ranks[1]["before"]["shared"]  # measured differently
    assert ranks[0]["before"]["rank 1 only"] is None  # rank 0 never measured it
    assert ranks[0]["after"] == ranks[1]["after"]
    assert ranks[1]["after"]["shared"] == ranks[0]["before"]["shared"]  # the lowest rank's choice
    assert ranks[0]["after"]["rank 1 only"] == ranks[1]["before"]["rank 1 only"]  # the only measurement
    assert ranks[0]["stored"] > 0 and ranks[1]["stored"] > 0


def test_outside_a_distributed_job_sync_batch_norm_is_batch_norm():
    torch.manual_seed(0)
    coordinates = torch.zeros(30, 4, dtype=torch.int32)
    coordinates[:, 1] = torch.arange(30, dtype=torch.int32)
    x = cst.SparseTensor(coordinates, torch.randn(30, 6))
    plain, synced = cst.SparseBatchNorm(6), cst.SparseSyncBatchNorm(6)
    for mode in (True, False):
        plain.train(mode)
        synced.train(mode)
        torch.testing.assert_close(synced(x).features, plain(x).features, rtol=0, atol=0)
    torch.testing.assert_close(synced.running_var, plain.running_var, rtol=0, atol=0)


def test_conversion_swaps_every_sparse_batch_norm_and_keeps_parameters_and_statistics():
    model = MinkUNet18(3, 13, width=0.25)
    with torch.no_grad():
        model.stem.first_norm.running_mean.fill_(0.5)
    names = {name for name, module in model.named_modules() if isinstance(module, cst.SparseBatchNorm)}
    weight = model.stem.first_norm.weight
    state = {name: value.clone() for name, value in model.state_dict().items()}
    converted = cst.convert_sync_batchnorm(model)
    synced = {name for name, module in converted.named_modules() if isinstance(module, cst.SparseSyncBatchNorm)}
    assert synced == names and len(names) > 10
    assert converted.stem.first_norm.weight is weight  # shared, not copied
    assert converted.state_dict().keys() == state.keys()
    for name, value in converted.state_dict().items():
        torch.testing.assert_close(value, state[name], rtol=0, atol=0)


def test_dense_batch_norms_go_to_torchs_converter_and_a_sparse_one_is_replaced_itself():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    assert isinstance(cst.convert_sync_batchnorm(model)[1], torch.nn.SyncBatchNorm)
    assert isinstance(cst.convert_sync_batchnorm(cst.SparseBatchNorm(4)), cst.SparseSyncBatchNorm)
