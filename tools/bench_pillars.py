"""Time pillarisation and target assignment at the OPV2V geometry (DESIGN §2).

    python tools/bench_pillars.py [--agents 3] [--points 100000] [--pillars 16000] [--threads 1]

Per agent the cloud has ``--points`` points in exactly ``--pillars`` non-empty pillars (one point
in each, the rest piled onto them with skewed weights so some pillars overflow 32 points, as near
the sensor) plus 3% of points outside the range. Prints the median ms per call of ``pillarize``
on CPU (and CUDA when present) against a per-point Python-dict reference timed on a subset and
scaled to the full cloud, and of ``assign_targets`` for a batch of 2 with 30 GT boxes.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from opencood.ops.anchors import generate_anchors
from opencood.ops.target_assigner import assign_targets
from opencood.ops.voxelize import grid_size, pillarize

LIDAR_RANGE = (-140.8, -40.0, -3.0, 140.8, 40.0, 1.0)
VOXEL_SIZE = (0.4, 0.4, 4.0)
MAX_POINTS = 32
OUTSIDE_FRACTION = 0.03


def agent_cloud(num_points: int, num_pillars: int, generator: torch.Generator) -> torch.Tensor:
    """(num_points, 4) points of one agent covering exactly ``num_pillars`` pillars."""
    nx, ny, _ = grid_size(LIDAR_RANGE, VOXEL_SIZE)
    num_outside = int(num_points * OUTSIDE_FRACTION)
    num_inside = num_points - num_outside
    cells = torch.randperm(nx * ny, generator=generator)[:num_pillars]
    # Exponential weights: most pillars get a few points, some get more than MAX_POINTS.
    weights = torch.empty(num_pillars).exponential_(generator=generator) ** 3
    extra = torch.multinomial(weights, num_inside - num_pillars, replacement=True,
                              generator=generator)
    point_cells = cells[torch.cat([torch.arange(num_pillars), extra])]
    # kept off the cell borders so float32 rounding cannot move a point to the next pillar
    offsets = 0.05 + 0.9 * torch.rand(num_inside, 2, generator=generator)
    x = LIDAR_RANGE[0] + ((point_cells % nx) + offsets[:, 0]) * VOXEL_SIZE[0]
    y = LIDAR_RANGE[1] + ((point_cells // nx) + offsets[:, 1]) * VOXEL_SIZE[1]
    z = LIDAR_RANGE[2] + torch.rand(num_inside, generator=generator) * 3.99
    inside = torch.stack([x, y, z, torch.rand(num_inside, generator=generator)], dim=1)
    outside = torch.rand(num_outside, 4, generator=generator) * 10
    outside[:, 2] -= 20.0                                  # below the ground: out of range
    cloud = torch.cat([inside, outside]).float()
    return cloud[torch.randperm(num_points, generator=generator)]


def batch_cloud(num_agents, num_points, num_pillars, seed):
    generator = torch.Generator().manual_seed(seed)
    clouds = [agent_cloud(num_points, num_pillars, generator) for _ in range(num_agents)]
    batch_index = torch.repeat_interleave(torch.arange(num_agents), num_points)
    return torch.cat(clouds), batch_index


def reference_pillarize(points, batch_index):
    """Per-point Python dict, the obvious way; returns the number of pillars."""
    nx, ny, nz = grid_size(LIDAR_RANGE, VOXEL_SIZE)
    pillars = {}
    for row, batch in zip(points.tolist(), batch_index.tolist()):
        cell = []
        for axis, count in enumerate((nx, ny, nz)):
            low, high = LIDAR_RANGE[axis], LIDAR_RANGE[axis + 3]
            if not low <= row[axis] < high:
                break
            cell.append(min(math.floor((row[axis] - low) / VOXEL_SIZE[axis]), count - 1))
        else:
            rows = pillars.setdefault((batch, cell[2], cell[1], cell[0]), [])
            if len(rows) < MAX_POINTS:
                rows.append(row)
    keys = sorted(pillars)
    features = torch.zeros(len(keys), MAX_POINTS, points.shape[1])
    for index, key in enumerate(keys):
        features[index, :len(pillars[key])] = torch.tensor(pillars[key])
    return len(keys)


def median_ms(function, repeats, device):
    """Median wall time of ``function()`` in ms after one warm-up call (the median, not the
    mean, so a burst of load from other processes on a shared machine does not dominate)."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    function()
    synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def random_gt(batch, count, seed):
    """(batch, count, 7) car-sized boxes inside the range."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, generator=generator)

    centre = (rand(batch, count, 2) - 0.5) * torch.tensor([270.0, 70.0])
    z = torch.full((batch, count, 1), -1.0)
    hwl = torch.tensor([1.5, 1.8, 4.2]) + rand(batch, count, 3) * torch.tensor([0.5, 0.4, 1.5])
    yaw = (rand(batch, count, 1) - 0.5) * 2 * math.pi
    return torch.cat([centre, z, hwl, yaw], dim=-1)


def bench_pillarize(points, batch_index, devices, repeats, reference_points):
    results = {}
    for device in devices:
        points_dev, batch_dev = points.to(device), batch_index.to(device)
        results[device.type] = median_ms(
            lambda: pillarize(points_dev, batch_dev, LIDAR_RANGE, VOXEL_SIZE, MAX_POINTS),
            repeats, device)
    subset = torch.randperm(len(points), generator=torch.Generator().manual_seed(1))
    subset = subset[:reference_points]
    start = time.perf_counter()
    reference_pillarize(points[subset], batch_index[subset])
    scale = len(points) / len(subset)
    results["reference"] = (time.perf_counter() - start) * 1e3 * scale
    return results


def bench_targets(devices, repeats, batch, num_gt):
    results = {}
    for device in devices:
        anchors = generate_anchors(LIDAR_RANGE, VOXEL_SIZE, device=device)
        gt_boxes = random_gt(batch, num_gt, seed=2).to(device)
        gt_mask = torch.ones(batch, num_gt, dtype=torch.bool, device=device)
        results[device.type] = median_ms(
            lambda: assign_targets(anchors, gt_boxes, gt_mask), repeats, device)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--points", type=int, default=100_000, help="per agent")
    parser.add_argument("--pillars", type=int, default=16_000, help="non-empty, per agent")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--reference-points", type=int, default=20_000)
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch; 1 gives stable numbers on a busy machine")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    print(f"torch {torch.__version__}, CPU threads {torch.get_num_threads()}, "
          f"devices {[d.type for d in devices]}")

    points, batch_index = batch_cloud(args.agents, args.points, args.pillars, seed=0)
    out = pillarize(points, batch_index, LIDAR_RANGE, VOXEL_SIZE, MAX_POINTS)
    pillars_per_agent = out["voxel_coords"][:, 0].bincount().tolist()
    full = int((out["voxel_num_points"] == MAX_POINTS).sum())
    print(f"cloud: {args.agents} agents x {args.points} points, grid "
          f"{grid_size(LIDAR_RANGE, VOXEL_SIZE)}, pillars per agent {pillars_per_agent}, "
          f"{full} pillars capped at {MAX_POINTS} points")

    timing = bench_pillarize(points, batch_index, devices, args.repeats, args.reference_points)
    print(f"pillarize      cpu {timing['cpu']:8.1f} ms")
    if "cuda" in timing:
        print(f"pillarize     cuda {timing['cuda']:8.2f} ms   (cpu / cuda = "
              f"{timing['cpu'] / timing['cuda']:.1f}x)")
    print(f"python dict reference {timing['reference']:8.1f} ms (timed on "
          f"{args.reference_points} points, scaled)   reference / pillarize cpu = "
          f"{timing['reference'] / timing['cpu']:.1f}x")

    targets = bench_targets(devices, args.repeats, batch=2, num_gt=30)
    num_anchors = generate_anchors(LIDAR_RANGE, VOXEL_SIZE).reshape(-1, 7).shape[0]
    print(f"assign_targets cpu {targets['cpu']:8.1f} ms   (batch 2, 30 GT, {num_anchors} anchors)")
    if "cuda" in targets:
        print(f"assign_targets cuda {targets['cuda']:7.2f} ms   (cpu / cuda = "
              f"{targets['cpu'] / targets['cuda']:.1f}x)")


if __name__ == "__main__":
    main()
