"""Pillar feature net (PointPillars / OpenCOOD ``PillarVFE``): points of a pillar -> one vector."""
from __future__ import annotations

from typing import Literal, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from opencood.config_schema import non_empty, positive, section, spec


def masked_batch_norm(norm: nn.BatchNorm1d, values: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
    """``norm`` applied to (R, C) ``values`` as if only the rows where ``mask`` (R,) is True
    existed: in training, the batch statistics (and the running-statistics update) come from
    those rows alone; the other rows are normalised too but meaningless.

    The static-shape step's VFE: it cannot drop padded points by boolean indexing (a
    data-dependent size), and letting them into the statistics would change the model. Sums
    run in float32 at least (the rows can be millions, under bf16 autocast too).
    """
    if not (norm.training or norm.running_mean is None):
        return F.batch_norm(values, norm.running_mean, norm.running_var, norm.weight, norm.bias,
                            False, 0.0, norm.eps)
    rows = values.to(torch.promote_types(values.dtype, torch.float32))    # fp16/bf16 -> fp32
    weight = mask.to(rows.dtype).unsqueeze(1)
    count = sum_over_ranks(weight.sum(), norm).clamp(min=1.0)
    mean = sum_over_ranks((rows * weight).sum(dim=0), norm) / count
    centred = rows - mean
    variance = sum_over_ranks((centred.square() * weight).sum(dim=0), norm) / count  # biased
    if norm.training and norm.running_mean is not None:
        update_running_statistics(norm, mean.detach(), variance.detach(), count)
    normed = centred * torch.rsqrt(variance + norm.eps)
    if norm.affine:
        normed = normed * norm.weight + norm.bias
    return normed.to(values.dtype)


def masked_linear_batch_norm(linear: nn.Linear, norm: nn.BatchNorm1d, values: torch.Tensor,
                             mask: torch.Tensor) -> torch.Tensor:
    """``masked_batch_norm(norm, linear(values), mask)`` for a bias-free ``linear``, without
    the (R, C_out) statistics pass: (R, C_in) values, (R,) mask -> (R, C_out).

    The linear layer is linear, so the batch statistics of its output follow from those of its
    input: mean ``W m`` and variance ``diag(W S W^T)`` for the masked rows' mean ``m`` and
    (biased) covariance ``S``, both over C_in (10 for the PointPillars VFE) instead of C_out
    (64) channels. BatchNorm's per-channel scale and shift then fold into the weight, so the
    layer is one ``addmm`` over the rows. Why: the static-shape step runs the VFE over every
    point slot (P x M rows, ~5x the real points at 16,000 pillars x 32 slots), and the masked
    statistics over (R, 64) in float32 were ~10 passes of 0.8 GB forward and more backward:
    the static step took 45 ms against the dynamic step's 31 ms on an H100 (issue 40). Equal
    to :func:`masked_batch_norm` but for rounding (tests/test_static_step.py).
    """
    if not (norm.training or norm.running_mean is None):
        return F.batch_norm(linear(values), norm.running_mean, norm.running_var, norm.weight,
                            norm.bias, False, 0.0, norm.eps)
    # The statistics in float32 at least, also under autocast (its matmuls would be bf16).
    with torch.autocast(values.device.type, enabled=False):
        rows = values.to(torch.promote_types(values.dtype, torch.float32))
        weight = linear.weight.to(rows.dtype)                            # (C_out, C_in)
        row_weight = mask.to(rows.dtype).unsqueeze(1)                    # (R, 1)
        count = sum_over_ranks(row_weight.sum(), norm).clamp(min=1.0)
        input_mean = sum_over_ranks((rows * row_weight).sum(dim=0), norm) / count   # (C_in,)
        centred = rows - input_mean
        covariance = sum_over_ranks((centred * row_weight).T @ centred, norm) / count
        mean = weight @ input_mean                                                   # (C_out,)
        variance = ((weight @ covariance) * weight).sum(dim=1).clamp(min=0.0)        # biased
        if norm.training and norm.running_mean is not None:
            update_running_statistics(norm, mean.detach(), variance.detach(), count)
        scale = torch.rsqrt(variance + norm.eps)
        shift = -mean * scale
        if norm.affine:
            scale, shift = scale * norm.weight, shift * norm.weight + norm.bias
    # (x - m) W^T * scale + ... == x (W^T * scale) + shift: one GEMM over the rows.
    return torch.addmm(shift, values, (weight * scale.unsqueeze(1)).T.to(values.dtype))


def sum_over_ranks(local_sum: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """A SyncBatchNorm (CUDA, world > 1) takes its statistics over every rank's rows: the sum
    all-reduced (with its gradient all-reduced back, as SyncBatchNorm does); else unchanged."""
    if not isinstance(norm, nn.SyncBatchNorm) or not torch.distributed.is_available() or \
            not torch.distributed.is_initialized():
        return local_sum
    group = norm.process_group or torch.distributed.group.WORLD
    if torch.distributed.get_world_size(group) == 1:
        return local_sum
    from torch.distributed.nn.functional import all_reduce
    return all_reduce(local_sum, group=group)


@torch.no_grad()
def update_running_statistics(norm: nn.BatchNorm1d, mean: torch.Tensor, variance: torch.Tensor,
                              count: torch.Tensor) -> None:
    """BatchNorm's update from (C,) batch mean and biased variance over ``count`` rows: the
    variance made unbiased, momentum (or the cumulative average when momentum is None)."""
    norm.num_batches_tracked.add_(1)
    momentum = norm.momentum if norm.momentum is not None else \
        1.0 / norm.num_batches_tracked.to(mean.dtype)
    unbiased = variance * count / (count - 1.0).clamp(min=1.0)
    norm.running_mean.mul_(1.0 - momentum).add_(mean * momentum)
    norm.running_var.mul_(1.0 - momentum).add_(unbiased * momentum)


class PillarLayer(nn.Module):
    """Linear + BatchNorm1d + ReLU over the real points of every pillar, then max over points.

    Padded points are dropped before the linear layer (rather than zeroed after it, as OpenCOOD
    does) so they neither shift the BatchNorm statistics nor reach the max.

    ``padded_slots="reference"``: OpenCOOD's (and OpenPCDet's) PFN layer instead, which weights
    trained there expect: every point slot of a pillar, the padded ones holding zeros, goes
    through linear + BatchNorm (statistics over all slots) + ReLU, so a padded slot's
    relu(BN(0)) joins the max, and a non-last layer hands on its output without masking.
    """

    def __init__(self, in_channels: int, out_channels: int, last_layer: bool,
                 padded_slots: str = "ignore"):
        super().__init__()
        self.last_layer = last_layer
        self.padded_slots = padded_slots
        # A non-last layer concatenates its per-point output with the pillar max (PointPillars),
        # so it computes half the channels to hand out_channels to the next layer.
        hidden = out_channels if last_layer else out_channels // 2
        self.linear = nn.Linear(in_channels, hidden, bias=False)
        self.norm = nn.BatchNorm1d(hidden, eps=1e-3, momentum=0.01)
        self.out_channels = out_channels if last_layer else 2 * hidden

    def forward(self, point_features: torch.Tensor, point_mask: torch.Tensor,
                static_shapes: bool = False) -> torch.Tensor:
        """(P, M, C_in) features, (P, M) bool mask -> (P, C_out) if last else (P, M, C_out).

        ``static_shapes``: every point slot goes through the linear layer and the BatchNorm
        statistics are masked (:func:`masked_linear_batch_norm`), instead of selecting the real
        points (a data-dependent size): same result, fixed shapes."""
        if self.padded_slots == "reference":
            return self.forward_reference(point_features, point_mask, static_shapes)
        if static_shapes:
            normed = masked_linear_batch_norm(self.linear, self.norm, point_features.flatten(0, 1),
                                              point_mask.flatten())
            per_point = torch.relu(normed.view(*point_mask.shape, -1)) * point_mask.unsqueeze(-1)
        else:
            real_points = torch.relu(self.norm(self.linear(point_features[point_mask])))
            per_point = real_points.new_zeros(*point_mask.shape, real_points.shape[-1])
            per_point = per_point.index_put((point_mask,), real_points)
        # ReLU outputs are >= 0, so the zeros left at padded slots never win the max.
        pillar_max = per_point.amax(dim=1)
        if self.last_layer:
            return pillar_max
        repeated_max = pillar_max.unsqueeze(1).expand_as(per_point)
        return torch.cat([per_point, repeated_max], dim=-1) * point_mask.unsqueeze(-1)

    def forward_reference(self, point_features: torch.Tensor, point_mask: torch.Tensor,
                          static_shapes: bool) -> torch.Tensor:
        """OpenCOOD's PFN layer (class docstring); same shapes as ``forward``.

        With ``static_shapes`` the pillars that only pad the batch (no point at all) stay out
        of the BatchNorm statistics, which OpenCOOD (no such pillars) never sees; their
        features are dropped by the scatter."""
        encoded = self.linear(point_features)
        rows = encoded.flatten(0, 1)
        if static_shapes:
            real_pillar = point_mask.any(dim=1, keepdim=True).expand_as(point_mask)
            normed = masked_batch_norm(self.norm, rows, real_pillar.flatten())
        else:
            normed = self.norm(rows)
        per_point = torch.relu(normed.view_as(encoded))
        pillar_max = per_point.amax(dim=1)
        if self.last_layer:
            return pillar_max
        return torch.cat([per_point, pillar_max.unsqueeze(1).expand_as(per_point)], dim=-1)


@section
class PillarVFEArgs:
    """``model.args.pillar_vfe``."""

    in_channels: int = spec(4, check=positive)      # x, y, z, intensity
    num_filters: Tuple[int, ...] = spec((64,), check=non_empty)
    with_distance: bool = False
    # "ignore": padded point slots are left out (ours); "reference": OpenCOOD's PFN layers,
    # where they take part (``PillarLayer``), for weights trained there
    padded_slots: Literal["ignore", "reference"] = "ignore"


class PillarVFE(nn.Module):
    """Decorates each point with offsets to its pillar's point mean and centre, encodes, pools.

    Point channels: [x, y, z, intensity, x-x_mean, y-y_mean, z-z_mean, x-x_c, y-y_c, z-z_c]
    (plus ||xyz|| when ``with_distance``).
    """

    def __init__(self, args: PillarVFEArgs, voxel_size: Sequence[float],
                 lidar_range: Sequence[float]):
        super().__init__()
        self.with_distance = args.with_distance
        self.register_buffer("voxel_size", torch.tensor(voxel_size[:3], dtype=torch.float32),
                             persistent=False)
        self.register_buffer("range_min", torch.tensor(lidar_range[:3], dtype=torch.float32),
                             persistent=False)
        channels = args.in_channels + 6 + int(args.with_distance)
        layers = []
        for index, width in enumerate(args.num_filters):
            layer = PillarLayer(channels, width, last_layer=index == len(args.num_filters) - 1,
                                padded_slots=args.padded_slots)
            layers.append(layer)
            channels = layer.out_channels
        self.layers = nn.ModuleList(layers)
        self.out_channels = channels

    def decorate(self, voxel_features: torch.Tensor, voxel_num_points: torch.Tensor,
                 voxel_coords: torch.Tensor, point_mask: torch.Tensor) -> torch.Tensor:
        """(P, M, C) raw points -> (P, M, C + 6 [+1]) decorated, padded points zeroed."""
        xyz = voxel_features[..., :3]
        valid = point_mask.unsqueeze(-1).to(xyz.dtype)
        counts = voxel_num_points.clamp(min=1).to(xyz.dtype).view(-1, 1, 1)
        offset_to_mean = xyz - (xyz * valid).sum(dim=1, keepdim=True) / counts
        # voxel_coords is [agent, z, y, x]; flip to (x, y, z) to match the point channels
        # (a slice and flip: a Python-list index is a host tensor copied to the device, which a
        # CUDA graph capture refuses).
        cell_xyz = voxel_coords[:, 1:4].flip(-1).to(xyz.dtype)
        pillar_centre = (cell_xyz + 0.5) * self.voxel_size.to(xyz.dtype) + self.range_min.to(
            xyz.dtype)
        parts = [voxel_features, offset_to_mean, xyz - pillar_centre.unsqueeze(1)]
        if self.with_distance:
            parts.append(xyz.norm(dim=-1, keepdim=True))
        return torch.cat(parts, dim=-1) * valid

    def forward(self, voxel_features: torch.Tensor, voxel_num_points: torch.Tensor,
                voxel_coords: torch.Tensor, static_shapes: bool = False) -> torch.Tensor:
        """(P, M, 4), (P,), (P, 4) [agent, z, y, x] -> (P, C) pillar features.

        ``static_shapes``: no data-dependent sizes inside (padded pillars, with 0 points, are
        allowed and give zero features); see ``PillarLayer.forward``."""
        slots = torch.arange(voxel_features.shape[1], device=voxel_features.device)
        point_mask = slots.unsqueeze(0) < voxel_num_points.unsqueeze(1)
        features = self.decorate(voxel_features, voxel_num_points, voxel_coords, point_mask)
        for layer in self.layers:
            features = layer(features, point_mask, static_shapes)
        return features
