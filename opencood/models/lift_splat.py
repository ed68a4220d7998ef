"""Lift-splat-shoot camera BEV encoder: HEAL's ``LiftSplatShoot`` (Philion & Fidler, ECCV 2020,
as HEAL modified it), in torch only.

Per camera, an image trunk (:mod:`opencood.models.camera_backbones`) gives a feature map at
stride ``img_downsample``; two 1x1 convs turn it into ``img_features`` channels and a softmax over
``D`` depth bins. **Lift**: their outer product is a feature for every (bin, feature pixel), i.e.
for every point of the camera *frustum*. The frustum's points are moved into the agent frame
(:func:`frustum_to_agent`: undo the image augmentation, back-project through the intrinsics,
camera-to-agent extrinsic). **Splat**: points are summed per BEV cell (:func:`splat`, the cumsum
trick) and the height cells stacked as channels. With ``bev_encoder_channels`` HEAL's ResNet-18
``BevEncode`` follows (its single-agent ``LiftSplatShoot``); without, the splat is the output (its
heterogeneous encoder of the same name, whose BEV map the fusion models read).

Camera inputs (a mapping; other keys are ignored), per agent, cameras in a fixed order:
  images (N_agents, N_cams, 3, H, W) normalised RGB, (H, W) = ``image_size``;
  intrinsics (N_agents, N_cams, 3, 3) of the original image;
  extrinsics (N_agents, N_cams, 4, 4) camera-to-agent (x right, y down, z forward camera axes);
  post_rots (N_agents, N_cams, 3, 3) and post_trans (N_agents, N_cams, 3): the image
  augmentation, augmented pixel = post_rots @ (u, v, 1)-pixel + post_trans (HEAL's
  ``img_transform`` made 3x3, last row / entry identity);
  depth_maps (N_agents, N_cams, H, W) metres, only with ``depth_supervision`` (HEAL passes it as a
  4th image channel).
HEAL's collate names these imgs, intrins, extrinsics (rots / trans: its rotation and
translation), post_rots, post_trans.

Output: (N_agents, out_channels, ny, nx), rows along y and columns along x of the agent frame
(HEAL's layout), ``out_channels`` = ``bev_encoder_channels`` or ``img_features`` x nz.

What is kept from HEAL on purpose (each pinned by tests/test_parity_lss.py): frustum pixels at
``linspace(0, W - 1, fW)`` (not feature-cell centres), depth targets sampled at pixel
``ds // 2 + k * ds``, cell indices by truncation toward zero (a point less than one cell below
the lower edge lands in the first cell), the EfficientNet's TensorFlow padding.
"""
from __future__ import annotations

import math
from typing import Literal, Mapping, NamedTuple, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from opencood.config_schema import Problems, positive, section, spec
from opencood.models.camera_backbones import (EfficientNetB0, LightTrunk, ResNet101Stem,
                                              ResNetBevEncode, UpConcat,
                                              efficientnet_pytorch_to_ours)
from opencood.registry import ENCODERS

CAMERA_KEYS = ("images", "intrinsics", "extrinsics", "post_rots", "post_trans")
EFFICIENTNET_WIDTHS = {32: 320, 16: 112, 8: 40}      # channels of the trunk's endpoints
TRUNK_WIDTH = 512                                    # HEAL's: what depth_head / image_head read


def axis_bound(value) -> Optional[str]:
    """(min, max, cell size): min < max, cell > 0."""
    low, high, cell = value
    return None if low < high and cell > 0 else "must be [min, max, cell size] with min < max, cell > 0"


def depth_range(value) -> Optional[str]:
    """(d_min, d_max, num_bins)."""
    low, high, bins = value
    return None if 0 <= low < high and bins >= 1 else \
        "must be [d_min, d_max, num_bins] with 0 <= d_min < d_max, num_bins >= 1"


@section
class LiftSplatArgs:
    """``model.args.encoder.args`` of ``core_method: lss``: HEAL's ``encoder_args`` of
    ``lift_splat_shoot``, its ``grid_conf`` and ``data_aug_conf.final_dim`` flattened in."""

    ALIASES = {"mode": "depth_mode", "bevout_feature": "bev_encoder_channels"}   # HEAL's names

    # metres: min, max, cell; None: from the model's BEV grid (``geometry.bev``: bev_grid)
    xbound: Optional[Tuple[float, float, float]] = spec(None, check=axis_bound)
    ybound: Optional[Tuple[float, float, float]] = spec(None, check=axis_bound)
    zbound: Tuple[float, float, float] = spec((-10.0, 10.0, 20.0), check=axis_bound)
    ddiscr: Tuple[float, float, int] = spec((2.0, 50.0, 48), check=depth_range)
    depth_mode: Literal["UD", "LID"] = "LID"          # HEAL's grid_conf.mode
    image_size: Tuple[int, int] = spec(check=lambda v: None if min(v) > 0 else "must be > 0")
    img_downsample: Literal[8, 16] = 8
    img_features: int = spec(128, check=positive)    # camC
    # HEAL's spelling; Light (ours, not HEAL's): a few strided convs (LightTrunk), for CPU budgets
    camera_encoder: Literal["EfficientNet", "Resnet101", "Light"] = "EfficientNet"
    # ours: the channels of the EfficientNet's up convs, which the depth and image heads read
    # (HEAL's 512; at stride 16 their 3x3 convs cost twice the trunk itself, so a CPU config
    # narrows them), or of the Light trunk's last stage; the ResNet-101 stem's layer2 is 512 wide
    trunk_width: int = spec(TRUNK_WIDTH, check=positive)
    # keep the depth logits and the depth targets of the last forward (``depth_outputs``)
    depth_supervision: bool = False
    # where a feature cell's depth target is read: ``pixel``, HEAL's, the depth map at pixel
    # (ds // 2 + k ds) (dense depth images); ``cell_min``, the nearest positive depth in the
    # cell's ds x ds pixels (sparse maps of LiDAR returns, :func:`lidar_depth_maps`)
    depth_sampling: Literal["pixel", "cell_min"] = "pixel"
    # HEAL's ``bevout_feature``: its ResNet-18 BevEncode after the splat; None: the splat itself
    bev_encoder_channels: Optional[int] = spec(None, check=positive)

    def problems(self) -> Problems:
        height, width = self.image_size
        multiple = {"EfficientNet": 32, "Resnet101": 8}.get(self.camera_encoder,
                                                             self.img_downsample)
        if height % multiple or width % multiple:
            yield "image_size", f"must be multiples of {multiple} for {self.camera_encoder}"
        if self.camera_encoder == "Resnet101" and self.img_downsample != 8:
            yield "img_downsample", "must be 8 with Resnet101 (its layer2 ends at stride 8)"
        if self.camera_encoder == "Resnet101" and self.trunk_width != TRUNK_WIDTH:
            yield "trunk_width", f"must be {TRUNK_WIDTH} with Resnet101 (its layer2's width)"

Bound = Tuple[float, float, float]


def grid_cells(axes: Tuple[Bound, Bound, Bound]) -> Tuple[int, int, int]:
    """(nx, ny, nz) of (xbound, ybound, zbound) as HEAL's ``gen_dx_bx`` (truncated: a partial
    last cell is dropped)."""
    return tuple(int((high - low) / cell) for low, high, cell in axes)


def grid_bounds(args: LiftSplatArgs, geometry=None) -> Tuple[Bound, Bound, Bound]:
    """(xbound, ybound, zbound) of the splat: x and y from ``args`` or, left out, from the
    model's BEV grid (``geometry.bev``: ``lidar_range``, ``voxel_size``, ``nx``, ``ny``, the
    encoder slot's :class:`~opencood.models.warp.BevGrid`); given both, they must agree."""
    bounds = [args.xbound, args.ybound]
    if geometry is not None:
        bev = geometry.bev
        for axis in range(2):
            low, high = bev.lidar_range[axis], bev.lidar_range[axis + 3]
            from_grid = (float(low), float(high), float(bev.voxel_size[axis]))
            given = bounds[axis]
            if given is not None and any(abs(a - b) > 1e-6 for a, b in zip(given, from_grid)):
                raise ValueError(f"lss encoder: {'xy'[axis]}bound {list(given)} is not the BEV "
                                 f"grid's {list(from_grid)} (bev_grid); leave it out")
            bounds[axis] = from_grid
        cells = grid_cells((bounds[0], bounds[1], args.zbound))[:2]
        if cells != (bev.nx, bev.ny):
            raise ValueError(f"lss encoder: {cells[0]} x {cells[1]} cells, the BEV grid has "
                             f"{bev.nx} x {bev.ny}")
    if bounds[0] is None or bounds[1] is None:
        raise ValueError("lss encoder: xbound and ybound are needed without a BEV grid")
    return bounds[0], bounds[1], args.zbound


# -- depth bins -------------------------------------------------------------------------------

def depth_bin_starts(d_min: float, d_max: float, num_bins: int, mode: str) -> np.ndarray:
    """The depth of each bin's frustum points, (num_bins,) float64 (HEAL's
    ``depth_discretization``). UD: ``d_min + i * (d_max - d_min) / n``; LID (linearly increasing
    bin widths, widths 1, 2, 3... units): ``d_min + unit * i (i + 1) / 2``, unit
    ``2 (d_max - d_min) / (n (n + 1))``, so the last bin ends at d_max."""
    index = np.arange(num_bins)
    if mode == "UD":
        return d_min + (d_max - d_min) / num_bins * index
    if mode == "LID":
        unit = 2 * (d_max - d_min) / (num_bins * (1 + num_bins))
        return d_min + unit * (index * np.arange(1, 1 + num_bins)) / 2
    raise ValueError(f"depth mode {mode!r}: expected UD or LID")


def depth_bin_indices(depth: torch.Tensor, d_min: float, d_max: float, num_bins: int,
                      mode: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Depths (any shape, metres) -> (bin index int64 in [0, n), inside mask bool): the bin
    whose [start, next start) holds the depth (HEAL's ``bin_depths``). Outside [d_min, d_max)
    or not finite: the index is clamped (below: 0; above or non-finite: n - 1) and the mask
    False. LID has no real index for a depth more than unit / 8 below d_min (the square root of
    a negative): it lands in the last bin, as HEAL's."""
    if mode == "UD":
        indices = (depth - d_min) / ((d_max - d_min) / num_bins)
    elif mode == "LID":
        unit = 2 * (d_max - d_min) / (num_bins * (1 + num_bins))
        indices = -0.5 + 0.5 * torch.sqrt(1 + 8 * (depth - d_min) / unit)
    else:
        raise ValueError(f"depth mode {mode!r}: expected UD or LID")
    inside = (indices >= 0) & (indices < num_bins) & torch.isfinite(indices)
    indices = torch.where(indices < 0, torch.zeros_like(indices), indices)
    indices = torch.where((indices >= num_bins) | ~torch.isfinite(indices),
                          torch.full_like(indices, num_bins - 1), indices)
    return indices.long(), inside


def lidar_depth_maps(points: torch.Tensor, intrinsics: torch.Tensor, extrinsics: torch.Tensor,
                     post_rots: torch.Tensor, post_trans: torch.Tensor,
                     image_size: Tuple[int, int]) -> torch.Tensor:
    """One agent's LiDAR returns as depth images of its cameras: points (P, >= 3) in the agent
    frame; intrinsics / post_rots (N, 3, 3), extrinsics (N, 4, 4) camera-to-agent, post_trans
    (N, 3) -> (N, H, W) the nearest return's depth (metres along the optical axis) on each
    augmented-image pixel, 0 where none. The inverse of :func:`frustum_to_agent`: pixel
    coordinate i is pixel i's centre (HEAL's frustum convention), so a return lands on
    round(u), round(v)."""
    height, width = image_size
    cams = intrinsics.shape[0]
    to_camera = torch.inverse(extrinsics)
    xyz = points[:, :3]
    in_camera = xyz @ to_camera[:, :3, :3].transpose(1, 2) + to_camera[:, None, :3, 3]  # (N, P, 3)
    depth = in_camera[..., 2]
    pixels = in_camera @ intrinsics.transpose(1, 2)
    pixels = torch.cat([pixels[..., :2] / depth.clamp(min=1e-6).unsqueeze(-1),
                        depth.unsqueeze(-1)], -1)
    augmented = pixels @ post_rots.transpose(1, 2) + post_trans[:, None]
    u, v = augmented[..., 0].round().long(), augmented[..., 1].round().long()
    seen = (depth > 0) & (u >= 0) & (u < width) & (v >= 0) & (v < height)
    camera = torch.arange(cams, device=points.device)[:, None].expand_as(u)
    flat = (camera * height + v) * width + u
    nearest = torch.full((cams * height * width,), math.inf, device=points.device,
                         dtype=points.dtype)
    nearest.scatter_reduce_(0, flat[seen], depth[seen], reduce="amin")
    nearest[torch.isinf(nearest)] = 0
    return nearest.view(cams, height, width)


# -- geometry ---------------------------------------------------------------------------------

def make_frustum(image_size: Tuple[int, int], downsample: int,
                 depths: np.ndarray) -> torch.Tensor:
    """(D, fH, fW, 3) points (u, v, depth) in augmented-image pixels: fH x fW pixels spread
    evenly over the whole image, first and last pixel included (HEAL's ``create_frustum``;
    ``fH = H // downsample``), one copy per bin depth."""
    height, width = image_size
    rows, cols = height // downsample, width // downsample
    d = torch.tensor(depths, dtype=torch.float).view(-1, 1, 1).expand(-1, rows, cols)
    u = torch.linspace(0, width - 1, cols).view(1, 1, cols).expand_as(d)
    v = torch.linspace(0, height - 1, rows).view(1, rows, 1).expand_as(d)
    return torch.stack((u, v, d), -1)


def frustum_to_agent(frustum: torch.Tensor, intrinsics: torch.Tensor, extrinsics: torch.Tensor,
                     post_rots: torch.Tensor, post_trans: torch.Tensor) -> torch.Tensor:
    """Frustum (D, fH, fW, 3) -> points (B, N, D, fH, fW, 3) in each agent's frame (HEAL's
    ``get_geometry``): undo the image augmentation (``post_rots^-1 (p - post_trans)``), scale
    (u, v) by the depth, back-project with ``K^-1`` and apply the camera-to-agent extrinsic.
    intrinsics / post_rots (B, N, 3, 3), extrinsics (B, N, 4, 4), post_trans (B, N, 3)."""
    batch, cams = post_trans.shape[:2]
    rotation, translation = extrinsics[..., :3, :3], extrinsics[..., :3, 3]
    points = frustum - post_trans.view(batch, cams, 1, 1, 1, 3)
    points = torch.inverse(post_rots).view(batch, cams, 1, 1, 1, 3, 3).matmul(points.unsqueeze(-1))
    points = torch.cat((points[..., :2, :] * points[..., 2:3, :], points[..., 2:3, :]), -2)
    combine = rotation.matmul(torch.inverse(intrinsics))
    points = combine.view(batch, cams, 1, 1, 1, 3, 3).matmul(points).squeeze(-1)
    return points + translation.view(batch, cams, 1, 1, 1, 3)


# -- splat: sum-pooling by cell, the cumsum trick ---------------------------------------------

class BevGridSpec(NamedTuple):
    lower: torch.Tensor        # (3,) lower edge of the first cell, metres
    cell: torch.Tensor         # (3,) cell size
    cells: Tuple[int, int, int]     # nx, ny, nz


class CumsumPool(torch.autograd.Function):
    """Sum of the rows of ``features`` (P, C) with equal ``ranks`` (P,), rows sorted by rank:
    -> (one row per rank (R, C), the index of each rank's last row (R,)).

    The cumsum trick (Philion & Fidler's ``QuickCumsum``): a running sum, read at each rank's
    last row, minus the previous one. Its gradient is not autograd's through the cumsum: every
    row gets its sum's gradient, gathered by a running count of kept rows."""

    @staticmethod
    def forward(ctx, features: torch.Tensor, ranks: torch.Tensor):
        # the scan along the contiguous axis: CPU's along dim 0 of a (P, C) matrix strides
        # through memory (7x slower at HEAL's size; the transpose pays back, same bits)
        running = features.t().contiguous().cumsum(1).t()
        last = torch.ones(features.shape[0], device=features.device, dtype=torch.bool)
        last[:-1] = ranks[1:] != ranks[:-1]
        sums = running[last]
        sums = torch.cat((sums[:1], sums[1:] - sums[:-1]))
        ctx.save_for_backward(last)
        last_rows = torch.nonzero(last).squeeze(1)
        ctx.mark_non_differentiable(last_rows)
        return sums, last_rows

    @staticmethod
    def backward(ctx, grad_sums: torch.Tensor, grad_rows):
        last, = ctx.saved_tensors
        group = torch.cumsum(last, 0)
        group[last] -= 1                 # the row that closes a group belongs to it
        return grad_sums[group], None


def cell_ranks(cells: torch.Tensor, batch_index: torch.Tensor,
               shape: Tuple[int, int, int], batch: int) -> torch.Tensor:
    """One integer per (cell, sample), equal for points that share both; HEAL's order (x, then y,
    z, sample): ((x ny + y) nz + z) B + b."""
    nx, ny, nz = shape
    return cells[:, 0] * (ny * nz * batch) + cells[:, 1] * (nz * batch) + cells[:, 2] * batch \
        + batch_index


def rank_order(ranks: torch.Tensor) -> torch.Tensor:
    """Rows of equal rank next to each other (stable, so the sum order is reproducible)."""
    return torch.sort(ranks, stable=True).indices


def splat(points: torch.Tensor, features: torch.Tensor, grid: BevGridSpec) -> torch.Tensor:
    """points (B, N, D, fH, fW, 3) agent-frame metres, features (B, N, D, fH, fW, C) -> the sum
    of the features per BEV cell, heights stacked as channels: (B, C nz, ny, nx) float32, channel
    ``z * C + c`` (HEAL's ``voxel_pooling``)."""
    batch, channels = points.shape[0], features.shape[-1]
    nx, ny, nz = grid.cells
    # float32 whatever autocast made the features: the cumsum trick's error is eps x the
    # running total (bf16: 1 % of it, more than a cell's own sum)
    features = features.reshape(-1, channels).float()
    # truncation toward zero, as theirs: (-1, 0) lands in the first cell
    cells = ((points - grid.lower) / grid.cell).long().view(-1, 3)
    per_sample = math.prod(points.shape[1:-1])
    batch_index = torch.arange(batch, device=points.device).repeat_interleave(per_sample)
    inside = ((cells >= 0) & (cells < torch.tensor(grid.cells, device=cells.device))).all(1)
    kept = torch.nonzero(inside).squeeze(1)
    ranks = cell_ranks(cells[kept], batch_index[kept], grid.cells, batch)
    order = rank_order(ranks)
    kept, ranks = kept[order], ranks[order]      # one gather of the features, not two
    sums, last_rows = CumsumPool.apply(features[kept], ranks)
    closing = kept[last_rows]
    cells, batch_index = cells[closing], batch_index[closing]
    bev = features.new_zeros(batch, channels, nz, ny, nx)
    bev[batch_index, :, cells[:, 2], cells[:, 1], cells[:, 0]] = sums
    return torch.cat(bev.unbind(dim=2), 1)


# -- the camera encoder -----------------------------------------------------------------------

class CameraEncoder(nn.Module):
    """Images (M, 3, H, W) -> (image features (M, C, fH, fW), depth logits (M, D, fH, fW))
    (HEAL's ``CamEncode`` / ``CamEncode_Resnet101``; ``Light``: ours, :class:`LightTrunk`); the
    heads read ``width`` trunk channels (HEAL's 512)."""

    def __init__(self, kind: str, downsample: int, num_bins: int, channels: int,
                 width: int = TRUNK_WIDTH):
        super().__init__()
        self.kind = kind
        self.downsample = downsample
        if kind == "EfficientNet":
            self.trunk = EfficientNetB0()
            self.up1 = UpConcat(EFFICIENTNET_WIDTHS[32] + EFFICIENTNET_WIDTHS[16], width)
            if downsample == 8:
                self.up2 = UpConcat(width + EFFICIENTNET_WIDTHS[8], width)
        elif kind == "Light":
            self.trunk = LightTrunk(downsample, width)
        else:
            self.trunk = ResNet101Stem()
        self.depth_head = nn.Conv2d(width, num_bins, 1)
        self.image_head = nn.Conv2d(width, channels, 1)

    def trunk_features(self, images: torch.Tensor) -> torch.Tensor:
        if self.kind != "EfficientNet":
            return self.trunk(images)
        endpoints = self.trunk(images)
        x = self.up1(endpoints[32], endpoints[16])
        return self.up2(x, endpoints[8]) if self.downsample == 8 else x

    def forward(self, images: torch.Tensor):
        features = self.trunk_features(images)
        return self.image_head(features), self.depth_head(features)


@ENCODERS.register("lss", args=LiftSplatArgs)
class LiftSplat(nn.Module):
    """Camera inputs (module doc) -> BEV features (N_agents, out_channels, ny, nx): the
    encoder ``lss`` of the detectors' slot (``model.args.encoder: {core_method: lss, args}``,
    ``opencood.models.encoders``).

    ``geometry``: the encoder slot's (its ``bev`` grid gives x / y bounds the args leave out)."""

    def __init__(self, args: LiftSplatArgs, geometry=None):
        super().__init__()
        self.args = args
        axes = grid_bounds(args, geometry)
        self.cells = grid_cells(axes)
        if args.bev_encoder_channels is not None and any(n % 8 for n in self.cells[:2]):
            raise ValueError(f"lss encoder: bev_encoder_channels (HEAL's BevEncode) needs a grid "
                             f"of multiples of 8 cells, not {self.cells[0]} x {self.cells[1]}")
        d_min, d_max, num_bins = args.ddiscr
        depths = depth_bin_starts(d_min, d_max, int(num_bins), args.depth_mode)
        self.register_buffer("frustum", make_frustum(args.image_size, args.img_downsample, depths),
                             persistent=False)
        cell_size = torch.tensor([cell for _, _, cell in axes])
        # HEAL's bx - dx / 2: the first cell's centre (float64, then float32) less half a cell
        first_centre = torch.tensor([low + cell / 2.0 for low, _, cell in axes])
        self.register_buffer("grid_lower", first_centre - cell_size / 2.0, persistent=False)
        self.register_buffer("cell_size", cell_size, persistent=False)
        self.num_bins = int(num_bins)
        self.camera_encoder = CameraEncoder(args.camera_encoder, args.img_downsample,
                                            self.num_bins, args.img_features, args.trunk_width)
        splat_channels = args.img_features * self.cells[2]
        self.bev_encoder = None
        if args.bev_encoder_channels is not None:
            self.bev_encoder = ResNetBevEncode(splat_channels, args.bev_encoder_channels)
        self.out_channels = args.bev_encoder_channels or splat_channels
        self.depth_outputs: Optional[dict] = None

    def lift(self, images: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """images (B, N, 3, H, W) -> (frustum features (B, N, D, fH, fW, C), depth logits
        (B N, D, fH, fW)): each pixel's image feature times its depth distribution."""
        batch, cams = images.shape[:2]
        image_features, depth_logits = self.camera_encoder(images.flatten(0, 1))
        lifted = depth_logits.softmax(1).unsqueeze(1) * image_features.unsqueeze(2)
        lifted = lifted.view(batch, cams, *lifted.shape[1:])        # (B, N, C, D, fH, fW)
        return lifted.permute(0, 1, 3, 4, 5, 2), depth_logits

    def depth_targets(self, depth_maps: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """depth_maps (B, N, H, W) metres (0: no measurement) -> (bin indices (B N, fH, fW),
        valid (B N, fH, fW): the depth lies in the bins), read per ``depth_sampling``."""
        step = self.args.img_downsample
        maps = depth_maps.flatten(0, 1)
        if self.args.depth_sampling == "pixel":
            sampled = maps[:, step // 2::step, step // 2::step]
        else:       # the nearest positive depth of each cell: a max-pool of the negated map
            missing = torch.where(maps > 0, -maps, torch.full_like(maps, -math.inf))
            sampled = -F.max_pool2d(missing.unsqueeze(1), step).squeeze(1)
        d_min, d_max, _ = self.args.ddiscr
        return depth_bin_indices(sampled, d_min, d_max, self.num_bins, self.args.depth_mode)

    def forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The BEV map; with ``depth_supervision``, also ``depth_outputs`` (the depth logits,
        targets and valid cells of this forward) where the batch has ``depth_maps``, which a
        training forward must have (None otherwise: evaluation needs no depth images)."""
        missing = [key for key in CAMERA_KEYS if key not in batch]
        if missing:
            raise KeyError(f"lift-splat encoder: the batch lacks camera keys {missing}")
        if self.args.depth_supervision and self.training and "depth_maps" not in batch:
            raise KeyError("lift-splat encoder: depth_supervision trains on the batch's "
                           "depth_maps, which it lacks (input_source needs 'depth')")
        self.depth_outputs = None
        # the geometry in float32 even under autocast: a bf16 matmul would move points by
        # 0.4 % of their range (20 cm at 50 m), cells of their own
        with torch.autocast(self.frustum.device.type, enabled=False):
            points = frustum_to_agent(self.frustum, *(batch[key].float() for key in
                                                      CAMERA_KEYS[1:]))
        lifted, depth_logits = self.lift(batch["images"])
        grid = BevGridSpec(self.grid_lower, self.cell_size, self.cells)
        bev = splat(points, lifted, grid)
        if self.args.depth_supervision and "depth_maps" in batch:
            target, valid = self.depth_targets(batch["depth_maps"])
            self.depth_outputs = {"depth_logits": depth_logits, "depth_target": target,
                                  "depth_valid": valid}
        return self.bev_encoder(bev) if self.bev_encoder is not None else bev


# -- HEAL's configuration and weights ---------------------------------------------------------

def args_from_heal(encoder_args: Mapping) -> dict:
    """HEAL's ``encoder_args`` of a ``lift_splat_shoot`` agent (or its single-agent model's
    ``args``) -> our ``LiftSplatArgs`` keys. HEAL's ``use_depth_gt`` (ground-truth depth in
    place of the predicted distribution) is not reproduced and refused."""
    if encoder_args.get("use_depth_gt"):
        raise ValueError("HEAL's use_depth_gt: true is not reproduced by the lss encoder")
    grid = encoder_args["grid_conf"]
    d_min, d_max, bins = grid["ddiscr"]
    args = {"xbound": list(grid["xbound"]), "ybound": list(grid["ybound"]),
            "zbound": list(grid["zbound"]), "ddiscr": [float(d_min), float(d_max), int(bins)],
            "depth_mode": grid["mode"],
            "image_size": list(encoder_args["data_aug_conf"]["final_dim"]),
            "img_downsample": encoder_args["img_downsample"],
            "img_features": encoder_args["img_features"],
            "camera_encoder": encoder_args["camera_encoder"],
            "depth_supervision": bool(encoder_args.get("depth_supervision", False))}
    if "bevout_feature" in encoder_args:
        args["bev_encoder_channels"] = encoder_args["bevout_feature"]
    return args


HEAL_PREFIXES = (("camencode.trunk.", "camera_encoder.trunk."),
                 ("camencode.", "camera_encoder."), ("bevencode.", "bev_encoder."))


def heal_to_ours(state: Mapping[str, torch.Tensor], camera_encoder: str) -> dict:
    """The ``camencode.*`` / ``bevencode.*`` keys of HEAL's ``LiftSplatShoot`` state dict -> our
    :class:`LiftSplat`'s (EfficientNet keys through :func:`efficientnet_pytorch_to_ours`; the
    ResNet-101's are torchvision's on both sides). Other keys (heads) are not taken; an unknown
    EfficientNet key raises :class:`WeightMappingError`, any other that does not fit fails the
    strict ``load_state_dict``."""
    ours = {}
    for key, tensor in state.items():
        if camera_encoder == "EfficientNet" and key.startswith("camencode.trunk."):
            inner = efficientnet_pytorch_to_ours({key[len("camencode.trunk."):]: tensor})
            ours.update({"camera_encoder.trunk." + k: v for k, v in inner.items()})
            continue
        if camera_encoder == "Resnet101" and key.startswith("camencode.") and \
                key.split(".")[1] in ("conv1", "bn1", "layer1", "layer2"):
            ours["camera_encoder.trunk." + key[len("camencode."):]] = tensor
            continue
        for theirs, mine in HEAL_PREFIXES[1:]:
            if key.startswith(theirs):
                ours[mine + key[len(theirs):]] = tensor
                break
    return ours
