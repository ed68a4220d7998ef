"""Read and write OPV2V point clouds (``.pcd``) and cache parsed clouds as ``.npy``.

Format (docs/DESIGN.md §2): the reference tools write ``DATA ascii`` with ``FIELDS x y z rgb`` /
``TYPE F F F U``, where the packed ``rgb`` integer is ``round(intensity * 255) << 16``
(intensity in the red byte). Readers return ``red / 255`` as intensity, which is what the
open3d-based reference readers see. We also read a plain ``intensity`` field, ``DATA binary``,
extra fields in any order, ``rgb`` stored as TYPE F (float bit pattern), comments and CRLF.

Parsing ascii is slow whatever the parser (numpy's loadtxt: ~70-90 ms per 120k points), so
the real speed comes from :class:`PointCloudCache`, which keeps each parsed cloud as a
``.npy`` in a cache folder (~1-2 ms to load).
"""

import hashlib
import io
import os
import pathlib
import warnings
from dataclasses import dataclass

import numpy as np

from opencood.errors import OpencoodError
from opencood.utils.atomic import atomic_write

__all__ = ["PcdError", "read_pcd", "write_pcd", "PointCloudCache", "default_cache_dir"]


class PcdError(OpencoodError, ValueError):
    """A point cloud file that cannot be read. The message starts with the file path."""


# ----------------------------------------------------------------------------------- header

_HEADER_KEYS = ("VERSION", "FIELDS", "SIZE", "TYPE", "COUNT", "WIDTH", "HEIGHT", "VIEWPOINT",
                "POINTS", "DATA")
_VALID_SIZES = {"U": (1, 2, 4, 8), "I": (1, 2, 4, 8), "F": (2, 4, 8)}
_NUMPY_KIND = {"U": "u", "I": "i", "F": "f"}


@dataclass(frozen=True)
class _Header:
    """What the PCD header says, validated.

    fields/sizes/types/counts: one entry per FIELDS name; n_points: POINTS;
    data: "ascii" or "binary"; data_start: byte offset of the body in the file;
    first_body_line: 1-based line number of the first body line (for error messages).
    """
    fields: tuple
    sizes: tuple
    types: tuple
    counts: tuple
    n_points: int
    data: str
    data_start: int
    first_body_line: int


def _fail(path, problem):
    """Build the one-line PcdError for `path`; problems are kept on one line for logs."""
    return PcdError(f"{os.fspath(path)}: {problem}")


def _read_header_entries(raw, path):
    """Split the header into {KEY: [tokens]} up to and including the DATA line.

    Returns (entries, data_start byte offset, number of header lines).
    """
    entries = {}
    pos = 0
    line_no = 0
    while True:
        if pos >= len(raw):
            problem = "empty file" if not raw else "header has no DATA line"
            raise _fail(path, problem)
        end = raw.find(b"\n", pos)
        end = len(raw) if end < 0 else end
        line_bytes = raw[pos:end]
        pos = end + 1
        line_no += 1
        try:
            text = line_bytes.decode("ascii").strip()
        except UnicodeDecodeError:
            raise _fail(path, f"line {line_no}: header is not ASCII text") from None
        if not text or text.startswith("#"):
            continue
        key, *values = text.split()
        key = key.upper()
        if key not in _HEADER_KEYS:
            hint = " (is the DATA line missing?)" if "DATA" not in entries else ""
            raise _fail(path, f"line {line_no}: expected a header keyword, got {text[:40]!r}{hint}")
        if key in entries:
            raise _fail(path, f"line {line_no}: {key} appears twice in the header")
        if not values:
            raise _fail(path, f"line {line_no}: {key} has no value")
        entries[key] = values
        if key == "DATA":
            return entries, pos, line_no


def _header_int(entries, key, path):
    """The single non-negative integer value of header line `key`."""
    values = entries[key]
    if len(values) != 1 or not values[0].isdigit():
        raise _fail(path, f"{key} must be one non-negative integer, got {' '.join(values)!r}")
    return int(values[0])


def _field_layout(entries, path):
    """Validated (fields, sizes, types, counts) tuples from FIELDS/SIZE/TYPE/COUNT."""
    for key in ("FIELDS", "SIZE", "TYPE"):
        if key not in entries:
            raise _fail(path, f"header has no {key} line")
    fields = tuple(name.lower() for name in entries["FIELDS"])
    n_fields = len(fields)
    counts_text = entries.get("COUNT", ["1"] * n_fields)   # COUNT is optional in PCD v0.7
    for key, values in (("SIZE", entries["SIZE"]), ("TYPE", entries["TYPE"]), ("COUNT", counts_text)):
        if len(values) != n_fields:
            raise _fail(path, f"{key} has {len(values)} entries but FIELDS has {n_fields}")
    if not all(v.isdigit() for v in entries["SIZE"] + counts_text):
        raise _fail(path, "SIZE and COUNT must be positive integers")
    sizes = tuple(int(v) for v in entries["SIZE"])
    counts = tuple(int(v) for v in counts_text)
    types = tuple(t.upper() for t in entries["TYPE"])
    for name, size, kind, count in zip(fields, sizes, types, counts):
        if kind not in _VALID_SIZES or size not in _VALID_SIZES[kind]:
            raise _fail(path, f"field {name!r} has unsupported TYPE {kind} with SIZE {size}")
        if count < 1:
            raise _fail(path, f"field {name!r} has COUNT {count}")
    return fields, sizes, types, counts


def _parse_header(raw, path):
    """Parse and validate the header of the file contents `raw` (bytes) -> _Header."""
    entries, data_start, n_header_lines = _read_header_entries(raw, path)
    fields, sizes, types, counts = _field_layout(entries, path)
    if "POINTS" not in entries:
        raise _fail(path, "header has no POINTS line")
    n_points = _header_int(entries, "POINTS", path)
    if "WIDTH" in entries and "HEIGHT" in entries:
        width_x_height = _header_int(entries, "WIDTH", path) * _header_int(entries, "HEIGHT", path)
        if width_x_height != n_points:
            raise _fail(path, f"WIDTH x HEIGHT = {width_x_height} but POINTS = {n_points}")
    data = entries["DATA"][0].lower()
    if data == "binary_compressed":
        raise _fail(path, "DATA binary_compressed is not supported (convert to ascii or binary)")
    if data not in ("ascii", "binary"):
        raise _fail(path, f"unknown DATA {entries['DATA'][0]!r} (expected ascii or binary)")
    return _Header(fields, sizes, types, counts, n_points, data, data_start, n_header_lines + 1)


# ------------------------------------------------------------------------------- ascii body

# Bytes the fixed-point fast path understands; anything else ("nan", "1e-5", "+1") goes to
# the general parser.
_FIXED_POINT_BYTES = b"0123456789-. \t\r\n"
_NEWLINE, _MINUS, _DOT = ord("\n"), ord("-"), ord(".")


def _token_bounds(chars):
    """Start and end offsets (int64) of the whitespace-separated tokens of a uint8 array."""
    is_space = chars <= 32           # only tab/CR/LF/space can occur here (checked before)
    edges = np.flatnonzero(is_space[:-1] != is_space[1:]) + 1
    if not is_space[0]:
        edges = np.concatenate(([0], edges))
    if not is_space[-1]:
        edges = np.concatenate((edges, [chars.size]))
    return edges[0::2], edges[1::2]


def _rows_are_regular(chars, starts, ends, n_cols):
    """True when every line holds exactly `n_cols` tokens.

    Conservative: inside a line tokens must be separated by one space or tab, and every
    row's first token must follow a newline. Layouts it rejects go to the general parser,
    which decides precisely.
    """
    gap_after = ends[:-1]
    next_start = starts[1:]
    within_line = np.ones(gap_after.size, bool)
    within_line[n_cols - 1::n_cols] = False
    single_gap = next_start[within_line] - gap_after[within_line] == 1
    gap_char = chars[gap_after[within_line]]
    if not (single_gap.all() and ((gap_char == 32) | (gap_char == 9)).all()):
        return False
    return bool((chars[next_start[~within_line] - 1] == _NEWLINE).all())


def _decimal_places(body, chars, starts, ends):
    """(has_dot bool per token, places) when every dotted token has the same number of
    decimals, else None. The reference writer always uses 6.

    Relies on the caller's checks (only digits, '-', '.' and whitespace; '-' only first in
    a token): then a token holding exactly one dot, places+1 bytes before its end, is
    -?digits.digits with `places` decimals.
    """
    has_dot = np.zeros(starts.size, bool)
    first_dot = body.find(b".")
    if first_dot < 0:
        return has_dot, 0
    places = int(ends[np.searchsorted(ends, first_dot)] - first_dot - 1)
    dot_guess = np.maximum(ends - places - 1, 0)
    has_dot = (chars[dot_guess] == _DOT) & (dot_guess >= starts)
    # Each flagged token owns a distinct dot, so equal counts mean no token has a second
    # dot and no dot sits elsewhere (other decimal counts).
    if has_dot.sum() != np.count_nonzero(chars == _DOT):
        return None
    return has_dot, places


def _parse_fixed_point(body, n_points, n_cols):
    """Fast path for bodies of plain decimals like "15.327886 -4.360711 -0.446482 6356992".

    Removes the dots, parses every token as an int64 in one C call (about 8x faster than
    parsing floats) and divides by 10**places. Both operands are exact doubles (at most 15
    digits, places <= 22), so the IEEE division gives the correctly rounded value: the same
    float64 that strtod/loadtxt would return. Returns (n_points, n_cols) float64, or None
    when the body is not of that simple form (the caller then uses the general parser).
    """
    if not body or n_points == 0 or body.translate(None, _FIXED_POINT_BYTES):
        return None
    chars = np.frombuffer(body, np.uint8)
    starts, ends = _token_bounds(chars)
    if starts.size != n_points * n_cols or not _rows_are_regular(chars, starts, ends, n_cols):
        return None
    negative = chars[starts] == _MINUS
    if np.count_nonzero(chars == _MINUS) != negative.sum():
        return None                           # a '-' inside a token, e.g. "1-2"
    decimals = _decimal_places(body, chars, starts, ends)
    if decimals is None:
        return None
    has_dot, places = decimals
    digits = (ends - starts) - negative - has_dot
    if digits.min() < 1 or digits.max() > 15:
        return None                           # "-", "." or too long to be exact as int64
    # Checked above: each token is -?digits with at most one dot, so with the dots removed
    # fromstring sees only clean integers and parses all of them.
    integers = np.fromstring(body.translate(None, b"."), sep=" ", dtype=np.int64)
    if integers.size != starts.size:
        return None
    values = integers.astype(np.float64)
    values[has_dot] /= 10.0 ** places
    return values.reshape(n_points, n_cols)


def _parse_ascii_general(body, header, n_cols, path):
    """Parse any ascii body (exponents, nan, blank lines, odd spacing) with numpy's C
    loadtxt, which also rejects rows of differing length. Returns (n_points, n_cols)
    float64; on failure a line-by-line pass names the first bad line.
    """
    if header.n_points == 0 and not body.strip():
        return np.zeros((0, n_cols))          # loadtxt warns on empty input
    try:
        text = body.decode("ascii")
        values = np.loadtxt(io.StringIO(text), dtype=np.float64, comments=None, ndmin=2)
    except ValueError as exc:                  # UnicodeDecodeError is a ValueError too
        raise _fail(path, _describe_bad_body(body, header, n_cols, exc)) from None
    if values.shape != (header.n_points, n_cols):
        raise _fail(path, _describe_bad_body(body, header, n_cols, None))
    return values


def _describe_bad_body(body, header, n_cols, parse_error):
    """One-line description of the first problem in an ascii body (slow; errors only)."""
    rows = []
    for line_no, line in enumerate(body.split(b"\n"), start=header.first_body_line):
        tokens = line.split()
        if not tokens:
            continue                           # blank lines are allowed
        if len(tokens) != n_cols:
            return f"line {line_no}: expected {n_cols} values, found {len(tokens)}"
        for token in tokens:
            if not _is_number(token):
                return f"line {line_no}: {token.decode('ascii', 'replace')[:30]!r} is not a number"
        rows.append(line_no)
    if len(rows) != header.n_points:
        truncated = " (truncated?)" if len(rows) < header.n_points else ""
        return f"POINTS is {header.n_points} but the data has {len(rows)} rows{truncated}"
    detail = " ".join(str(parse_error).split()) if parse_error else "unexpected layout"
    return f"cannot parse the ascii data ({detail})"


def _is_number(token):
    """True when the bytes token parses as a float the way loadtxt accepts it."""
    if b"_" in token:                          # Python's float() accepts "1_0"; loadtxt does not
        return False
    try:
        float(token)
    except ValueError:
        return False
    return True


def _ascii_columns(raw, header, path):
    """Parse the ascii body -> (n_points, total COUNT) float64 values."""
    body = raw[header.data_start:]
    n_cols = sum(header.counts)
    values = _parse_fixed_point(body, header.n_points, n_cols)
    if values is None:
        values = _parse_ascii_general(body, header, n_cols, path)
    return values


# ------------------------------------------------------------------------------ binary body

def _binary_dtype(header):
    """Packed little-endian structured dtype of one point; field i is named "f{i}" because
    PCD allows repeated names (PCL pads with "_")."""
    formats = []
    for i, (size, kind, count) in enumerate(zip(header.sizes, header.types, header.counts)):
        base = f"<{_NUMPY_KIND[kind]}{size}"
        formats.append((f"f{i}", base, (count,)) if count > 1 else (f"f{i}", base))
    return np.dtype(formats)


def _binary_records(raw, header, path):
    """The binary body as a structured array of n_points records."""
    dtype = _binary_dtype(header)
    expected = header.n_points * dtype.itemsize
    available = len(raw) - header.data_start
    if available < expected:
        raise _fail(path, f"binary data is truncated: {max(available, 0)} bytes, expected "
                          f"{expected} ({header.n_points} points x {dtype.itemsize} bytes)")
    if available > expected:
        raise _fail(path, f"binary data has {available} bytes but POINTS = {header.n_points} "
                          f"needs {expected}")
    return np.frombuffer(raw, dtype, count=header.n_points, offset=header.data_start)


# ---------------------------------------------------------------------------- field mapping

def _field_index(header, name, path, required):
    """Index of field `name` in FIELDS (first occurrence), or None when optional and absent."""
    if name not in header.fields:
        if required:
            raise _fail(path, f"FIELDS has no {name!r} ({' '.join(header.fields)})")
        return None
    index = header.fields.index(name)
    if header.counts[index] != 1:
        raise _fail(path, f"field {name!r} has COUNT {header.counts[index]}, expected 1")
    return index


def _rgb_to_intensity(packed):
    """(N,) uint32 packed rgb -> (N,) float32 red / 255 (the reference intensity)."""
    red = (packed >> 16) & 0xFF
    return (red / 255.0).astype(np.float32)


def _packed_rgb_from_text(values, kind, path):
    """(N,) float64 parsed ascii rgb column -> (N,) uint32 packed rgb.

    TYPE U/I hold the integer itself. TYPE F is meant to hold the float whose bit pattern is
    the packed integer (open3d reads it that way), but PCL's ascii writer prints rgb as the
    uint32 even when TYPE is F. Packed colours with a zero alpha byte, as OPV2V writes, are
    denormal floats (< 1.2e-38) and never print as integers >= 1, so a column of whole
    numbers with any value >= 1 is the PCL style.
    """
    whole = values == np.floor(values)
    if kind == "F" and not (whole.all() and values.size and values.max() >= 1):
        return values.astype(np.float32).view(np.uint32)
    if not whole.all() or (values.size and (values.min() < -2**31 or values.max() >= 2**32)):
        raise _fail(path, "rgb values are not 32-bit integers")
    return values.astype(np.int64).astype(np.uint32)   # int64 first so negative I wraps


def _packed_rgb_from_binary(column, kind, size, path):
    """(N,) raw binary rgb column -> (N,) uint32 packed rgb (float bits for TYPE F)."""
    if size != 4:
        raise _fail(path, f"rgb field has SIZE {size}, expected 4")
    column = np.ascontiguousarray(column)
    return column.view(np.uint32) if kind == "F" else column.astype(np.uint32)


def _assemble_points(header, column, path):
    """Gather x, y, z and intensity into the (N, 4) float32 result.

    column(i) returns field i's values: float64 for ascii, the stored dtype for binary.
    Intensity comes from an "intensity" field as stored, else from "rgb" (red / 255),
    else 0.
    """
    points = np.zeros((header.n_points, 4), np.float32)
    for axis, name in enumerate("xyz"):
        points[:, axis] = column(_field_index(header, name, path, required=True))
    intensity_index = _field_index(header, "intensity", path, required=False)
    if intensity_index is not None:
        points[:, 3] = column(intensity_index)
        return points
    rgb_index = _field_index(header, "rgb", path, required=False)
    if rgb_index is not None:
        kind = header.types[rgb_index]
        if header.data == "ascii":
            packed = _packed_rgb_from_text(column(rgb_index), kind, path)
        else:
            packed = _packed_rgb_from_binary(column(rgb_index), kind, header.sizes[rgb_index], path)
        points[:, 3] = _rgb_to_intensity(packed)
    return points


def _read_file_bytes(path):
    """Whole file as bytes; any OS error becomes a PcdError naming the file."""
    try:
        with open(path, "rb") as stream:
            return stream.read()
    except FileNotFoundError:
        raise _fail(path, "file not found") from None
    except OSError as exc:
        raise _fail(path, f"cannot read file ({exc.strerror or exc})") from exc


def read_pcd(path):
    """Read a PCD file.

    Args:
        path: str or os.PathLike.
    Returns:
        (N, 4) float32 C-contiguous array [x, y, z, intensity]. Intensity is the
        "intensity" field as stored, else red/255 of a packed "rgb" field (0..1), else 0.
        VIEWPOINT is ignored (OPV2V points are already in the lidar frame).
    Raises:
        PcdError (a ValueError) "<path>: <problem>" for a missing, unreadable or malformed
        file, or an unsupported layout (DATA binary_compressed).
    """
    raw = _read_file_bytes(path)
    header = _parse_header(raw, path)
    if header.data == "ascii":
        values = _ascii_columns(raw, header, path)
        offsets = np.cumsum((0,) + header.counts)
        return _assemble_points(header, lambda i: values[:, offsets[i]], path)
    records = _binary_records(raw, header, path)
    return _assemble_points(header, lambda i: records[f"f{i}"], path)


# ----------------------------------------------------------------------------------- writer

def _reference_header(intensity_field, n_points, data):
    """Header text in the reference writer's exact layout."""
    last_type = "U" if intensity_field == "rgb" else "F"
    return ("# .PCD v0.7 - Point Cloud Data file format\n"
            "VERSION 0.7\n"
            f"FIELDS x y z {intensity_field}\n"
            "SIZE 4 4 4 4\n"
            f"TYPE F F F {last_type}\n"
            "COUNT 1 1 1 1\n"
            f"WIDTH {n_points}\n"
            "HEIGHT 1\n"
            "VIEWPOINT 0 0 0 1 0 0 0\n"
            f"POINTS {n_points}\n"
            f"DATA {data}\n")


def _points_for_writing(points):
    """(N,3)/(N,4) array-like -> (xyz (N,3) float32, intensity (N,) float32)."""
    points = np.asarray(points)
    if points.ndim != 2 or points.shape[1] not in (3, 4):
        raise ValueError(f"points must have shape (N, 3) or (N, 4), got {points.shape}")
    xyz = points[:, :3].astype(np.float32)
    if points.shape[1] == 4:
        intensity = points[:, 3].astype(np.float32)
    else:
        intensity = np.zeros(len(points), np.float32)
    return xyz, intensity


def _intensity_to_rgb(intensity):
    """(N,) float intensity in 0..1 -> (N,) uint32 round(intensity*255) << 16.
    Values outside 0..1 are clipped; the red byte cannot hold them."""
    if not np.isfinite(intensity).all():
        raise ValueError("intensity must be finite to be packed into rgb")
    red = np.rint(np.clip(intensity.astype(np.float64), 0.0, 1.0) * 255.0)
    return red.astype(np.uint32) << 16


def write_pcd(path, points, intensity_field="rgb", data="ascii"):
    """Write points as a PCD file in the reference layout.

    Args:
        path: str or os.PathLike (overwritten).
        points: (N, 3) or (N, 4) array [x, y, z(, intensity)]; missing intensity is 0.
        intensity_field: "rgb" (reference: TYPE U, round(intensity*255) << 16, intensity
            clipped to 0..1) or "intensity" (TYPE F, value as is).
        data: "ascii" (6 decimals, as the reference) or "binary" (little-endian float32).
    """
    if intensity_field not in ("rgb", "intensity"):
        raise ValueError(f"intensity_field must be 'rgb' or 'intensity', got {intensity_field!r}")
    if data not in ("ascii", "binary"):
        raise ValueError(f"data must be 'ascii' or 'binary', got {data!r}")
    xyz, intensity = _points_for_writing(points)
    last = _intensity_to_rgb(intensity) if intensity_field == "rgb" else intensity
    header = _reference_header(intensity_field, len(xyz), data).encode("ascii")
    if data == "ascii":
        body = _ascii_body(xyz, last).encode("ascii")
    else:
        last_format = "<u4" if intensity_field == "rgb" else "<f4"
        record = np.dtype([("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("last", last_format)])
        records = np.empty(len(xyz), record)
        records["x"], records["y"], records["z"] = xyz.T
        records["last"] = last
        body = records.tobytes()
    with open(path, "wb") as stream:
        stream.write(header + body)


def _ascii_body(xyz, last):
    """One "%.6f %.6f %.6f <last>" line per point; <last> is %d for packed rgb (uint32)."""
    line_format = "%.6f %.6f %.6f " + ("%d\n" if last.dtype.kind == "u" else "%.6f\n")
    columns = [xyz[:, 0].tolist(), xyz[:, 1].tolist(), xyz[:, 2].tolist(), last.tolist()]
    return "".join(map(line_format.__mod__, zip(*columns)))


# ------------------------------------------------------------------------------------ cache

# Bump when read_pcd's output for the same file changes, so old entries stop matching.
_CACHE_FORMAT_VERSION = 1


def default_cache_dir():
    """Root of opencood's caches: $OPENCOOD_CACHE, else ~/.cache/opencood (pathlib.Path).

    PointCloudCache uses its "pcd" subfolder; other caches can take their own subfolders.
    """
    return pathlib.Path(os.environ.get("OPENCOOD_CACHE") or "~/.cache/opencood").expanduser()


class PointCloudCache:
    """Parsed clouds stored as .npy files, keyed by absolute path, size and mtime_ns.

    Entries live only in the cache folder, never beside the data. A changed file (new size
    or mtime) gets a new key and is parsed again; the stale entry is left behind (the folder
    can be deleted at any time). Edits that keep both size and mtime_ns (possible on file
    systems with coarse timestamps) are not detected. Corrupt or unreadable entries are
    re-parsed and rewritten; a cache that cannot be written only costs speed (one warning).
    Safe with several processes: entries are written to a temp file and renamed into place.
    """

    def __init__(self, cache_dir=None):
        """cache_dir: folder for the entries (used as is); None -> default_cache_dir()/"pcd"."""
        if cache_dir is None:
            cache_dir = default_cache_dir() / "pcd"
        self.cache_dir = pathlib.Path(cache_dir).expanduser()
        self._warned_unwritable = False

    def entry_path(self, path):
        """Where the cached cloud of `path` (in its current state) is or would be stored."""
        return self._entry_for(os.path.abspath(path), _stat(path))

    #: None: a hit is read into memory (a writable array). "r": a hit is memory-mapped read-only,
    #: for callers that only read it (no copy out of the page cache, no fresh pages to fault in).
    mmap_mode = None

    def parse(self, path):
        """What an entry holds for ``path``: read_pcd(path). A subclass may store a cloud derived
        from it ((K, 4) float32, e.g. less some points), in its own cache folder."""
        return read_pcd(path)

    def load(self, path):
        """Same as self.parse(path) -> (N, 4) float32, served from the cache when fresh."""
        file_stat = _stat(path)
        entry = self._entry_for(os.path.abspath(path), file_stat)
        cached = _load_entry(entry, self.mmap_mode)
        if cached is not None:
            return cached
        points = self.parse(path)
        # Store only if the file did not change while it was parsed; otherwise the entry
        # would pair the old key with new content.
        if _same_version(file_stat, _stat(path)):
            self._store(entry, points)
        return points

    def _entry_for(self, absolute_path, file_stat):
        """Entry file name: hash of format version, absolute path, size and mtime_ns."""
        key = f"{_CACHE_FORMAT_VERSION}\0{absolute_path}\0{file_stat.st_size}\0{file_stat.st_mtime_ns}"
        digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:32]
        return self.cache_dir / f"{digest}.npy"

    def _store(self, entry, points):
        """Write `points` to `entry` atomically (a failed write leaves no entry behind)."""
        try:
            with atomic_write(entry, "wb") as stream:
                np.save(stream, points, allow_pickle=False)
        except OSError as exc:
            if not self._warned_unwritable:
                self._warned_unwritable = True
                warnings.warn(f"point-cloud cache {self.cache_dir} is not writable ({exc}); "
                              "clouds will be parsed on every load", RuntimeWarning, stacklevel=3)


def _stat(path):
    """os.stat(path); a missing or unreadable file becomes a PcdError like read_pcd's."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        raise _fail(path, "file not found") from None
    except OSError as exc:
        raise _fail(path, f"cannot read file ({exc.strerror or exc})") from exc


def _same_version(stat_a, stat_b):
    """True when two stats describe the same file content version (size and mtime_ns)."""
    return (stat_a.st_size, stat_a.st_mtime_ns) == (stat_b.st_size, stat_b.st_mtime_ns)


def _load_entry(entry, mmap_mode=None):
    """Cached (N, 4) float32 array, or None when absent, unreadable or not a valid cloud.
    ``mmap_mode="r"``: a read-only plain ndarray view of the file mapped in memory."""
    try:
        cached = np.load(entry, mmap_mode=mmap_mode, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None                   # missing, truncated or garbage: parse again
    if not isinstance(cached, np.ndarray):
        cached.close()                # an .npz: not ours
        return None
    if cached.dtype != np.float32 or cached.ndim != 2 or cached.shape[1] != 4:
        return None
    return np.asarray(cached)         # a np.memmap as a plain array (its slices stay plain)


def _remove_quietly(file_name):
    """Delete a temp file if it is still there."""
    try:
        os.unlink(file_name)
    except OSError:
        pass
