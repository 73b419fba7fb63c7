"""What data-parallel training (`torch.nn.parallel.DistributedDataParallel`) needs from the adapter:
batch norm over the sparse features of every rank, and the same algorithm choices on every rank.

    model = cst.convert_sync_batchnorm(MinkUNet18(3, 13)).to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])
    ...one warm-up step under model.no_sync()...
    cst.share_tuning()

`torch.nn.SyncBatchNorm.convert_sync_batchnorm` cannot be used on sparse networks: it replaces each
`SparseBatchNorm` by a dense `nn.SyncBatchNorm`, which takes a tensor, not a `SparseTensor` (and
synchronises only CUDA tensors). `convert_sync_batchnorm` here swaps in `SparseSyncBatchNorm`,
which works on every backend `torch.distributed` reduces on (NCCL, Gloo for CPU tensors), and leaves
dense batch norms to torch's converter.

`SparseSyncBatchNorm` normalises with the statistics of all ranks' voxels together, as one
`BatchNorm1d` over the concatenated features would. On CUDA it runs PyTorch's fused batch-norm
kernels around one all-gather (forward) and one all-reduce (backward) per layer, without host
synchronisation (`_FusedSyncBatchNorm`). Elsewhere (Gloo on the CPU) each rank
reduces its own voxels to a count, a sum and a sum of squared deviations from its own mean (float32;
float64 for float64 features), one all-reduce adds the ranks' values in float64 (the cross-rank
variance, `Σ M2_r + Σ n_r·m_r² − n·m²`, cancels only over the ranks' means), and autograd carries
gradients back through the all-reduce to every rank's features. Ranks may hold different numbers of
voxels, or none (all ranks together need at least two).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from cupysparse.tuning import agreement

from cupysparse.adapters.torch.pointwise import SparseBatchNorm
from cupysparse.adapters.torch.tensor import SparseTensor


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; each rank's gradient is the sum of all ranks' gradients of the result."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        reduced = tensor.clone()
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=group)
        return reduced

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllReduceSum.apply(grad.contiguous(), ctx.group), None


class _FusedSyncBatchNorm(torch.autograd.Function):
    """Batch norm over every rank's rows with PyTorch's fused CUDA kernels: one all-gather of each
    rank's (mean, inverse std, count) forward, one all-reduce of two per-channel sums backward,
    a handful of launches per layer and no host synchronisation. (torch's own SyncBatchNorm function
    reads the gathered counts on the host every layer to drop ranks without rows; here such a rank
    sends a count of 0 and an inverse std of 1, which weigh nothing in the combination.) The rows'
    statistics accumulate in float32 (float64 for float64 features)."""

    @staticmethod
    def forward(ctx, features, weight, bias, running_mean, running_var, eps, factor, group, world_size):
        features = features.contiguous()
        channels = features.shape[1]
        if len(features):
            mean, invstd = torch.batch_norm_stats(features, eps)
        else:
            mean = features.new_zeros(channels, dtype=torch.promote_types(features.dtype, torch.float32))
            invstd = torch.ones_like(mean)
        local = torch.cat([mean, invstd, mean.new_full((1,), len(features))])
        gathered = local.new_empty(world_size, 2 * channels + 1)
        dist.all_gather_into_tensor(gathered, local, group=group)
        means, invstds, counts = torch.split(gathered, channels, dim=1)
        counts = counts.reshape(-1)
        if running_mean is not None:
            counts = counts.to(running_mean.dtype)
        mean, invstd = torch.batch_norm_gather_stats_with_counts(features, means, invstds, running_mean, running_var,
                                                                 factor, eps, counts)
        ctx.save_for_backward(features, weight, mean, invstd, counts.to(torch.int32))
        ctx.group = group
        if not len(features):  # the fused kernels take no empty input
            return torch.empty_like(features)
        return torch.batch_norm_elemt(features, weight, bias, mean, invstd, eps)

    @staticmethod
    def backward(ctx, grad_output):
        grad_output = grad_output.contiguous()
        features, weight, mean, invstd, counts = ctx.saved_tensors
        needs_input, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        if len(features):
            sum_dy, sum_dy_xmu, grad_weight, grad_bias = torch.batch_norm_backward_reduce(
                grad_output, features, mean, invstd, weight, needs_input, needs_weight, needs_bias)
        else:
            sum_dy, sum_dy_xmu = torch.zeros_like(mean), torch.zeros_like(mean)
            grad_weight = torch.zeros_like(weight) if needs_weight else None
            grad_bias = torch.zeros_like(weight) if needs_bias else None
        grad_input = None
        if needs_input:  # the same on every rank (one model), so every rank joins the all-reduce
            sums = torch.cat([sum_dy, sum_dy_xmu])
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=ctx.group)
            sum_dy, sum_dy_xmu = torch.split(sums, len(mean))
            grad_input = (torch.batch_norm_backward_elemt(grad_output, features, mean, invstd, weight, sum_dy,
                                                          sum_dy_xmu, counts)
                          if len(features) else torch.empty_like(grad_output))
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


def _synchronised(group) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


class SparseSyncBatchNorm(SparseBatchNorm):
    """`SparseBatchNorm` whose training statistics are those of the voxels of every rank of
    `process_group` (default: the whole job); in evaluation, or outside a distributed job, it is
    `SparseBatchNorm`. Its state-dict keys are BatchNorm1d's."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group=None, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def forward(self, input: SparseTensor) -> SparseTensor:
        group = self.process_group or (dist.group.WORLD if dist.is_available() and dist.is_initialized() else None)
        if not self.training or group is None or not _synchronised(group):
            return super().forward(input)
        return input.replace_feature(self._synchronised_batch_norm(input.features, group))

    def _synchronised_batch_norm(self, features: torch.Tensor, group) -> torch.Tensor:
        if features.is_cuda:
            return self._fused_batch_norm(features, group)
        channels = features.shape[1]
        compute = torch.promote_types(features.dtype, torch.float32)
        x = features.to(compute)
        count = x.shape[0]
        local_mean = x.mean(dim=0) if count else x.new_zeros(channels)
        local_m2 = (x - local_mean).square().sum(dim=0)
        wide_mean = local_mean.double()
        local = torch.cat([wide_mean.new_full((1,), float(count)), count * wide_mean,
                           local_m2.double() + count * wide_mean.square()])
        total = _AllReduceSum.apply(local, group)
        total_count = total[0].detach()  # stays on the device: reading it would wait for the GPU every layer
        mean = total[1:1 + channels] / total_count
        variance = (total[1 + channels:] / total_count - mean.square()).clamp_min(0)
        if self.track_running_stats:
            self._update_running_statistics(mean.detach(), variance.detach(), total_count)
        scale = torch.rsqrt(variance + self.eps).to(compute)
        if self.weight is not None:
            scale = scale * self.weight.to(compute)
        shift = -mean.to(compute) * scale
        if self.bias is not None:
            shift = shift + self.bias.to(compute)
        return torch.addcmul(shift, x, scale).to(features.dtype)

    def _fused_batch_norm(self, features: torch.Tensor, group) -> torch.Tensor:
        factor = 0.0
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        running_mean, running_var = (self.running_mean, self.running_var) if self.track_running_stats else (None, None)
        return _FusedSyncBatchNorm.apply(features, self.weight, self.bias, running_mean, running_var, self.eps,
                                         factor, group, dist.get_world_size(group))

    @torch.no_grad()
    def _update_running_statistics(self, mean: torch.Tensor, variance: torch.Tensor, count: torch.Tensor) -> None:
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = variance * (count / (count - 1))
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)


def convert_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """`module` with every `SparseBatchNorm` replaced by a `SparseSyncBatchNorm` that shares its
    parameters and statistics, and every dense batch norm by torch's `nn.SyncBatchNorm`; returns the
    replacement when `module` itself is one."""
    if isinstance(module, SparseBatchNorm) and not isinstance(module, SparseSyncBatchNorm):
        converted = SparseSyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                        module.track_running_stats, process_group)
        if module.affine:
            converted.weight, converted.bias = module.weight, module.bias
        converted.running_mean, converted.running_var = module.running_mean, module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
        return converted
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, SparseBatchNorm):
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    for name, child in module.named_children():
        converted = convert_sync_batchnorm(child, process_group)
        if converted is not child:
            setattr(module, name, converted)
    return module


def share_tuning(group=None) -> int:
    """A collective (every rank of `group` must call it, at the same point): afterwards every rank
    makes the same algorithm choice for every problem any rank had met, the lowest rank's (see
    `cupysparse.tuning.agreement`). Call it after a step in which each rank tuned on its own, e.g.
    a warm-up step under `DistributedDataParallel.no_sync()`. Returns how many cache entries this
    rank took from others. With NCCL, `torch.cuda.set_device(local_rank)` must come first."""
    entries = agreement.local_entries()
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, entries, group=group)
    return agreement.adopt(gathered)
