"""PCD reading/writing (reference layout and variants), error reporting and the .npy cache."""

import os
import struct

import numpy as np
import pytest

from opencood.data import pcd
from opencood.data.pcd import PcdError, PointCloudCache, default_cache_dir, read_pcd, write_pcd

REFERENCE_HEADER = (
    "# .PCD v0.7 - Point Cloud Data file format\n"
    "VERSION 0.7\n"
    "FIELDS x y z rgb\n"
    "SIZE 4 4 4 4\n"
    "TYPE F F F U\n"
    "COUNT 1 1 1 1\n"
    "WIDTH 2\n"
    "HEIGHT 1\n"
    "VIEWPOINT 0 0 0 1 0 0 0\n"
    "POINTS 2\n"
    "DATA ascii\n"
)


def _random_points(count, seed=0):
    """(count, 4) float32 points in lidar range with intensities anywhere in 0..1."""
    rng = np.random.default_rng(seed)
    points = np.empty((count, 4), np.float32)
    points[:, :3] = rng.uniform(-80.0, 80.0, (count, 3))
    points[:, 3] = rng.uniform(0.0, 1.0, count)
    points[0] = [0.0, -0.5, 1e-7, 0.0]      # zeros, a tiny value and both intensity ends
    points[1, 3] = 1.0
    return points


def _general_parser_forbidden(monkeypatch):
    """Make the slow ascii parser fail so a test proves the fast path handled the file."""
    def refuse(*args):
        raise AssertionError("general ascii parser used")
    monkeypatch.setattr(pcd, "_parse_ascii_general", refuse)


# ------------------------------------------------------------------------------ round trips

@pytest.mark.parametrize("intensity_field", ["rgb", "intensity"])
@pytest.mark.parametrize("data", ["ascii", "binary"])
def test_round_trip_each_layout(tmp_path, intensity_field, data):
    points = _random_points(200)
    path = tmp_path / f"cloud_{intensity_field}_{data}.pcd"
    write_pcd(path, points, intensity_field=intensity_field, data=data)
    loaded = read_pcd(path)

    assert loaded.shape == (200, 4) and loaded.dtype == np.float32
    if data == "binary":
        np.testing.assert_array_equal(loaded[:, :3], points[:, :3])
    else:
        _assert_within_six_decimals(loaded[:, :3], points[:, :3])
    if intensity_field == "rgb":   # the red byte holds round(intensity * 255)
        expected_intensity = (np.rint(points[:, 3].astype(np.float64) * 255) / 255).astype(np.float32)
        np.testing.assert_array_equal(loaded[:, 3], expected_intensity)
        assert np.abs(loaded[:, 3] - points[:, 3]).max() <= 0.5 / 255 + 1e-7
    elif data == "binary":
        np.testing.assert_array_equal(loaded[:, 3], points[:, 3])
    else:
        _assert_within_six_decimals(loaded[:, 3], points[:, 3])


def _assert_within_six_decimals(loaded, original):
    """"%.6f" is off by <= 5e-7, then float32 rounding adds <= half a float32 step."""
    error = np.abs(loaded.astype(np.float64) - original)
    bound = 5e-7 + np.spacing(np.abs(original)).astype(np.float64) / 2
    assert (error <= bound).all(), error.max()


def test_reference_layout_is_written_exactly(tmp_path):
    path = tmp_path / "ref.pcd"
    write_pcd(path, np.array([[15.327886, -4.360711, -0.446482, 97 / 255],
                              [1.0, 2.0, 3.0, 0.0]], np.float32))
    # 97 << 16 = 6356992
    assert path.read_text() == (REFERENCE_HEADER + "15.327886 -4.360711 -0.446482 6356992\n"
                                                   "1.000000 2.000000 3.000000 0\n")


def test_written_rgb_lines_repeat_exactly(tmp_path):
    """Reading a reference file and writing it back gives the same bytes (fixture-like)."""
    text = REFERENCE_HEADER + "11.822620 -5.082414 -1.645051 7077888\n-0.000100 0.500000 12.000000 16711680\n"
    source = tmp_path / "source.pcd"
    source.write_text(text)
    copy = tmp_path / "copy.pcd"
    write_pcd(copy, read_pcd(source))
    assert copy.read_text() == text


def test_points_without_intensity_write_zero(tmp_path):
    path = tmp_path / "xyz.pcd"
    write_pcd(path, [[1.5, 2.5, 3.5]], data="binary")
    np.testing.assert_array_equal(read_pcd(path), [[1.5, 2.5, 3.5, 0.0]])


def test_empty_cloud_round_trips(tmp_path):
    path = tmp_path / "empty.pcd"
    write_pcd(path, np.zeros((0, 4), np.float32))
    assert read_pcd(path).shape == (0, 4)


@pytest.mark.parametrize("kwargs", [dict(intensity_field="colour"), dict(data="binary_compressed")])
def test_write_rejects_unknown_layouts(tmp_path, kwargs):
    with pytest.raises(ValueError):
        write_pcd(tmp_path / "x.pcd", np.zeros((1, 4)), **kwargs)


def test_write_rejects_bad_shape(tmp_path):
    with pytest.raises(ValueError, match="shape"):
        write_pcd(tmp_path / "x.pcd", np.zeros((4, 5)))


# ---------------------------------------------------------------------------- ascii parsing

def test_header_variant_comments_extra_fields_order_and_crlf(tmp_path):
    text = ("# written by some other tool\n"
            "VERSION 0.7\n"
            "FIELDS intensity t x y ring z\n"
            "SIZE 4 4 4 4 2 4\n"
            "TYPE F F F F U F\n"
            "COUNT 1 1 1 1 1 1\n"
            "# a comment inside the header\n"
            "\n"
            "WIDTH 3\n"
            "HEIGHT 1\n"
            "VIEWPOINT 0 0 0 1 0 0 0\n"
            "POINTS 3\n"
            "DATA ascii\n"
            "0.5 0.1 1.25 -2.5 7 3.0\n"
            "0.25 0.2 -0.125 4 9 .5\n"
            "1 0.3 -1e-1 2.5E+1 11 -0\n")
    path = tmp_path / "variant.pcd"
    path.write_bytes(text.replace("\n", "\r\n").encode())
    np.testing.assert_array_equal(read_pcd(path), np.array([[1.25, -2.5, 3.0, 0.5],
                                                            [-0.125, 4.0, 0.5, 0.25],
                                                            [-0.1, 25.0, -0.0, 1.0]], np.float32))


def test_fast_path_matches_strtod_on_reference_body(tmp_path, monkeypatch):
    """Fixed-6-decimal bodies (with CRLF) take the fast path and give exactly float(text)."""
    lines = ["15.327886 -4.360711 -0.446482 6356992", "-0.000001 0.000000 79.999999 0",
             "-123456789.123456 .500000 -.250000 16711680", "1.000000 2.000000 3.000000 65280"]  # 65280: green only
    path = tmp_path / "fixed.pcd"
    header = REFERENCE_HEADER.replace("2", str(len(lines)))   # WIDTH/POINTS 2 -> 4
    path.write_bytes((header + "\r\n".join(lines) + "\r\n").encode())
    _general_parser_forbidden(monkeypatch)
    expected_xyz = np.array([[float(v) for v in line.split()[:3]] for line in lines]).astype(np.float32)
    loaded = read_pcd(path)
    np.testing.assert_array_equal(loaded[:, :3], expected_xyz)
    np.testing.assert_array_equal(loaded[:, 3], np.float32([97 / 255, 0, 1, 0]))


def test_fast_path_agrees_with_general_parser_on_random_text():
    rng = np.random.default_rng(1)
    values = rng.uniform(-1e4, 1e4, (500, 4)) * rng.choice([1, 1e-4], (500, 4))
    body = "\n".join(" ".join("%.6f" % v for v in row) for row in values).encode()
    fast = pcd._parse_fixed_point(body, 500, 4)
    assert fast is not None
    np.testing.assert_array_equal(fast, [[float("%.6f" % v) for v in row] for row in values])


@pytest.mark.parametrize("body", [b"1.5 2.25 3 4\n5 6 7e0 8\n",       # exponent
                                  b"1.5 2.25 3 4\n5 6 nan 8\n",       # nan
                                  b"1.5 2.25 3 4\n\n5 6 7 8\n",       # blank line
                                  b"1.5 2.25 3 4\n5 6  7 8\n",        # double space
                                  b"1.50 2.25 3 4\n5 6 7 8.5\n",     # mixed decimals
                                  b"0.000001 5. 12345 1\n5 6 7 8\n",  # dot 6 before a later end
                                  b"1 2 3\n4 5 6 7 8\n",             # ragged rows, right total
                                  b"1 2 3 4\n5 6 7-1 8\n",           # '-' inside a token
                                  b"1 2 3 4 5 6 7 8\n",               # two rows on one line
                                  b"1 2 3 4\n5 6 7 -\n"])            # fromstring reads "-" as 0
def test_fast_path_declines_what_it_cannot_prove(body):
    assert pcd._parse_fixed_point(body, 2, 4) is None


def test_missing_intensity_gives_zero(tmp_path):
    path = tmp_path / "xyz.pcd"
    path.write_text("FIELDS x y z\nSIZE 4 4 4\nTYPE F F F\nPOINTS 1\nDATA ascii\n1 2 3\n")
    np.testing.assert_array_equal(read_pcd(path), [[1.0, 2.0, 3.0, 0.0]])


def _float_bits(packed):
    """The float32 whose bit pattern is the uint32 `packed` (how PCL stores rgb as F)."""
    return float(np.uint32(packed).view(np.float32))


def test_rgb_stored_as_float_ascii(tmp_path):
    header = REFERENCE_HEADER.replace("TYPE F F F U", "TYPE F F F F")
    path = tmp_path / "rgbf.pcd"
    path.write_text(header + f"1 2 3 {_float_bits(97 << 16)!r}\n4 5 6 {_float_bits(0xFF0000 | 0x1234)!r}\n")
    np.testing.assert_array_equal(read_pcd(path)[:, 3], np.float32([97 / 255, 1.0]))


def test_rgb_typed_float_but_printed_as_integer_ascii(tmp_path):
    """PCL's ascii writer prints rgb as the uint32 even when TYPE says F."""
    header = REFERENCE_HEADER.replace("TYPE F F F U", "TYPE F F F F")
    path = tmp_path / "rgb_pcl.pcd"
    path.write_text(header + "1 2 3 6356992\n4 5 6 0\n")
    np.testing.assert_array_equal(read_pcd(path)[:, 3], np.float32([97 / 255, 0.0]))


# --------------------------------------------------------------------------- binary parsing

def test_binary_extra_fields_types_and_rgb_float(tmp_path):
    """x,y,z as F8, rgb as F4 bit pattern, padding and integer fields of every size."""
    header = ("FIELDS ring x _ y z rgb t\n"
              "SIZE 2 8 1 8 8 4 4\nTYPE U F U F F F I\nCOUNT 1 1 3 1 1 1 1\n"
              "WIDTH 2\nHEIGHT 1\nPOINTS 2\nDATA binary\n")
    record = struct.Struct("<Hd3Bdd4si")
    rows = [(7, 1.5, 0, 0, 0, -2.25, 1e-3, struct.pack("<I", 200 << 16), -5),
            (9, -0.125, 1, 2, 3, 64.0, 3.0, struct.pack("<I", 0xFF00FFFF), 6)]
    path = tmp_path / "mixed.pcd"
    path.write_bytes(header.encode() + b"".join(record.pack(*row) for row in rows))
    np.testing.assert_array_equal(read_pcd(path), np.array([[1.5, -2.25, 1e-3, 200 / 255],
                                                            [-0.125, 64.0, 3.0, 0.0]], np.float32))


def test_binary_intensity_field_as_uint8_is_taken_as_stored(tmp_path):
    header = "FIELDS x y z intensity\nSIZE 4 4 4 1\nTYPE F F F U\nPOINTS 1\nDATA binary\n"
    path = tmp_path / "u8.pcd"
    path.write_bytes(header.encode() + struct.pack("<fffB", 1.0, 2.0, 3.0, 17))
    np.testing.assert_array_equal(read_pcd(path), [[1.0, 2.0, 3.0, 17.0]])


# ---------------------------------------------------------------------------------- errors

_CORRUPT_FILES = {
    "truncated ascii": (REFERENCE_HEADER + "1.000000 2.000000 3.000000 0\n4.000000 5.0", "line 13"),
    "missing last row": (REFERENCE_HEADER + "1.000000 2.000000 3.000000 0\n", "POINTS is 2"),
    "extra row": (REFERENCE_HEADER + "1 2 3 0\n4 5 6 0\n7 8 9 0\n", "POINTS is 2"),
    "garbage number": (REFERENCE_HEADER + "1 2 3 0\n4 abc 6 0\n", "'abc' is not a number"),
    "underscore number": (REFERENCE_HEADER + "1 2 3 0\n4 1_0 6 0\n", "line 13: '1_0' is not a number"),
    "lone sign": (REFERENCE_HEADER + "1 2 3 0\n4 5 6 -\n", "line 13: '-' is not a number"),
    "ragged rows": (REFERENCE_HEADER + "1 2 3\n4 5 6 0 9\n", "line 12: expected 4 values, found 3"),
    "wrong column count": (REFERENCE_HEADER + "1 2 3 0 9\n4 5 6 0 9\n", "expected 4 values"),
    "missing FIELDS": (REFERENCE_HEADER.replace("FIELDS x y z rgb\n", ""), "no FIELDS"),
    "missing POINTS": (REFERENCE_HEADER.replace("POINTS 2\n", ""), "no POINTS"),
    "missing DATA": (REFERENCE_HEADER.replace("DATA ascii\n", "") + "1 2 3 0\n", "DATA line"),
    "compressed": (REFERENCE_HEADER.replace("DATA ascii", "DATA binary_compressed"), "binary_compressed"),
    "width mismatch": (REFERENCE_HEADER.replace("WIDTH 2", "WIDTH 3") + "1 2 3 0\n4 5 6 0\n", "WIDTH"),
    "no x field": (REFERENCE_HEADER.replace("x y z", "a y z") + "1 2 3 0\n4 5 6 0\n", "no 'x'"),
    "empty file": ("", "empty file"),
    "binary truncated": (REFERENCE_HEADER.replace("ascii", "binary") + "\0" * 20, "truncated"),
}


@pytest.mark.parametrize("name", sorted(_CORRUPT_FILES))
def test_corrupt_files_raise_pcd_error_naming_the_file(tmp_path, name):
    text, problem = _CORRUPT_FILES[name]
    path = tmp_path / (name.replace(" ", "_") + ".pcd")
    path.write_text(text)
    with pytest.raises(PcdError) as caught:
        read_pcd(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    assert problem in message


def test_missing_file_raises_pcd_error(tmp_path):
    path = tmp_path / "absent.pcd"
    with pytest.raises(PcdError, match="absent.pcd: file not found"):
        read_pcd(path)
    with pytest.raises(PcdError, match="absent.pcd: file not found"):
        PointCloudCache(tmp_path / "cache").load(path)


# ----------------------------------------------------------------------------------- cache

@pytest.fixture
def cloud_file(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    path = data_dir / "000068.pcd"
    write_pcd(path, _random_points(50))
    return path


def test_cache_second_load_does_not_parse(tmp_path, cloud_file, monkeypatch):
    cache = PointCloudCache(tmp_path / "cache")
    first = cache.load(cloud_file)
    np.testing.assert_array_equal(first, read_pcd(cloud_file))

    def refuse(path):
        raise AssertionError("parsed again")
    monkeypatch.setattr(pcd, "read_pcd", refuse)
    second = cache.load(cloud_file)
    np.testing.assert_array_equal(second, first)
    assert second.dtype == np.float32 and second.shape == (50, 4)


def test_cache_entries_live_only_in_the_cache_dir(tmp_path, cloud_file):
    cache_dir = tmp_path / "cache"
    cache = PointCloudCache(cache_dir)
    cache.load(cloud_file)
    assert [p.name for p in cloud_file.parent.iterdir()] == ["000068.pcd"]
    assert [p.name for p in cache_dir.iterdir()] == [cache.entry_path(cloud_file).name]
    assert cache.entry_path(cloud_file).suffix == ".npy"


def test_cache_rereads_a_modified_file(tmp_path, cloud_file):
    cache = PointCloudCache(tmp_path / "cache")
    cache.load(cloud_file)
    old_mtime = cloud_file.stat().st_mtime_ns
    new_points = _random_points(50, seed=5)
    write_pcd(cloud_file, new_points)                               # same size
    os.utime(cloud_file, ns=(old_mtime + 10**9, old_mtime + 10**9))  # coarse clocks
    np.testing.assert_array_equal(cache.load(cloud_file), read_pcd(cloud_file))
    _assert_within_six_decimals(cache.load(cloud_file)[:, :3], new_points[:, :3])


def test_cache_skips_storing_a_file_changed_while_parsing(tmp_path, cloud_file, monkeypatch):
    real_read_pcd = pcd.read_pcd

    def read_then_touch(path):
        points = real_read_pcd(path)
        mtime = os.stat(path).st_mtime_ns + 10**9
        os.utime(path, ns=(mtime, mtime))     # another process rewrote it meanwhile
        return points
    monkeypatch.setattr(pcd, "read_pcd", read_then_touch)
    cache_dir = tmp_path / "cache"
    assert PointCloudCache(cache_dir).load(cloud_file).shape == (50, 4)
    assert not cache_dir.exists() or not any(cache_dir.iterdir())


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "wrong shape"])
def test_corrupt_cache_entry_is_rewritten(tmp_path, cloud_file, damage):
    cache = PointCloudCache(tmp_path / "cache")
    expected = cache.load(cloud_file)
    entry = cache.entry_path(cloud_file)
    if damage == "garbage":
        entry.write_bytes(b"not a numpy file")
    elif damage == "truncated":
        entry.write_bytes(entry.read_bytes()[:-100])
    elif damage == "empty":
        entry.write_bytes(b"")
    else:
        np.save(entry, np.zeros((3, 3), np.float32))
    np.testing.assert_array_equal(cache.load(cloud_file), expected)
    np.testing.assert_array_equal(np.load(entry), expected)          # repaired on disk
    assert [p.suffix for p in entry.parent.iterdir()] == [".npy"]     # no temp files left


def test_unwritable_cache_still_loads(tmp_path, cloud_file):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the cache folder should be")
    cache = PointCloudCache(blocker / "pcd")
    with pytest.warns(RuntimeWarning, match="not writable"):
        points = cache.load(cloud_file)
    np.testing.assert_array_equal(points, read_pcd(cloud_file))


def test_default_cache_dir_follows_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENCOOD_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    assert PointCloudCache().cache_dir == tmp_path / "c" / "pcd"
    monkeypatch.delenv("OPENCOOD_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "opencood"
