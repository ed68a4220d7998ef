"""Benchmark PCD reading: numpy's loadtxt vs read_pcd vs a PointCloudCache hit.

Usage: python tools/bench_pcd.py [--points 120000] [--repeat 5]

Writes temporary reference-layout files (ascii and binary, plus an ascii file printed with
"%.9g" that the fixed-point fast path declines) and prints ms per file; speed-ups are against
loadtxt measured in the same run. Numbers on a shared machine are noisy: the median of
--repeat runs is the headline, the best run is shown beside it.
"""

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

from opencood.data.pcd import PointCloudCache, read_pcd, write_pcd

REFERENCE_HEADER_LINES = 11   # lines loadtxt must skip in a reference-layout file


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=120_000, help="points per cloud")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per method")
    return parser.parse_args(argv)


def make_points(count, seed=0):
    """(count, 4) float32 lidar-like points: xyz within 80 m, intensity on the 1/255 grid."""
    rng = np.random.default_rng(seed)
    points = np.empty((count, 4), np.float32)
    points[:, :3] = rng.uniform(-80.0, 80.0, (count, 3))
    points[:, 3] = rng.integers(0, 256, count) / 255.0
    return points


def write_general_ascii(path, points):
    """Reference layout but values printed with "%.9g" (exponents, varying decimals), as
    other tools do; read_pcd's fast path declines it, so this times the general parser."""
    red = np.rint(points[:, 3].astype(np.float64) * 255).astype(np.int64) << 16
    lines = ["%.9g %.9g %.9g %d" % (x, y, z, r)
             for (x, y, z), r in zip(points[:, :3].tolist(), red.tolist())]
    header = ("# .PCD v0.7 - Point Cloud Data file format\nVERSION 0.7\nFIELDS x y z rgb\n"
              "SIZE 4 4 4 4\nTYPE F F F U\nCOUNT 1 1 1 1\n"
              f"WIDTH {len(points)}\nHEIGHT 1\nVIEWPOINT 0 0 0 1 0 0 0\n"
              f"POINTS {len(points)}\nDATA ascii\n")
    pathlib.Path(path).write_text(header + "\n".join(lines) + "\n")


def time_ms(function, repeat):
    """(median, best) wall time of function() in ms over `repeat` runs after one warm-up."""
    function()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times)


def load_uncached(cache, path):
    """A cache miss: drop the entry, then load (parse + atomic store)."""
    cache.entry_path(path).unlink(missing_ok=True)
    return cache.load(path)


def check_agreement(ascii_path, binary_path, general_path, cache):
    """Every method must return the same cloud, or the timings compare different work."""
    reference = np.loadtxt(ascii_path, skiprows=REFERENCE_HEADER_LINES)
    parsed = read_pcd(ascii_path)
    assert np.array_equal(parsed[:, :3], reference[:, :3].astype(np.float32))
    assert np.array_equal(parsed[:, 3], ((reference[:, 3].astype(np.int64) >> 16) / 255).astype(np.float32))
    assert np.array_equal(cache.load(ascii_path), parsed)
    assert np.allclose(read_pcd(binary_path), parsed, rtol=0, atol=1e-5)
    assert np.allclose(read_pcd(general_path), parsed, rtol=0, atol=1e-5)


def main(argv=None):
    args = parse_args(argv)
    points = make_points(args.points)
    with tempfile.TemporaryDirectory(prefix="bench_pcd_") as folder:
        folder = pathlib.Path(folder)
        ascii_path, binary_path = folder / "ref_ascii.pcd", folder / "ref_binary.pcd"
        general_path = folder / "general_ascii.pcd"
        write_pcd(ascii_path, points)
        write_pcd(binary_path, points, data="binary")
        write_general_ascii(general_path, points)
        cache = PointCloudCache(folder / "cache")
        check_agreement(ascii_path, binary_path, general_path, cache)

        rows = [
            ("np.loadtxt (parse only, ascii)",
             lambda: np.loadtxt(ascii_path, skiprows=REFERENCE_HEADER_LINES)),
            ("read_pcd ascii (cold parse)", lambda: read_pcd(ascii_path)),
            ("read_pcd ascii '%.9g' (general parser)", lambda: read_pcd(general_path)),
            ("read_pcd binary", lambda: read_pcd(binary_path)),
            ("PointCloudCache.load (miss: parse+store)", lambda: load_uncached(cache, ascii_path)),
            ("PointCloudCache.load (hit)", lambda: cache.load(ascii_path)),
        ]
        results = [(name, *time_ms(function, args.repeat)) for name, function in rows]
        sizes = ", ".join(f"{path.name} {path.stat().st_size / 1e6:.1f} MB"
                          for path in (ascii_path, general_path, binary_path))

    print(f"{args.points} points per file ({sizes}); {args.repeat} runs each, ms per file")
    print(f"{'method':42s} {'median':>8s} {'best':>8s} {'vs loadtxt':>11s}")
    baseline = results[0][1]
    for name, median, best in results:
        print(f"{name:42s} {median:8.1f} {best:8.1f} {baseline / median:10.1f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
