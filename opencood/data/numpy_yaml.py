"""Yaml with numpy arrays and scalars, read and written without the unsafe loader.

V2V4Real's per-frame yaml files were dumped with PyYAML's default (unsafe) Dumper from numpy
objects: ``lidar_pose`` is a 4x4 float64 array and ``gps`` a list of float64 scalars, written as

    lidar_pose: !!python/object/apply:numpy.core.multiarray._reconstruct
      args: [!!python/name:numpy.ndarray '', !!python/tuple [0], !!binary "Yg=="]
      state: !!python/tuple [1, !!python/tuple [4, 4], <dtype>, false, !!binary <raw bytes>]
    gps: [!!python/object/apply:numpy.core.multiarray.scalar [<dtype>, !!binary <raw bytes>]]
    <dtype> = !!python/object/apply:numpy.dtype {args: [f8, false, true],
                                                 state: !!python/tuple [3, <, null, ...]}

The reference reader loads them with ``yaml.Loader``, which calls any Python function a file
names (``!!python/object/apply:os.system [...]`` runs a shell command). :class:`NumpyYamlLoader`
is the safe loader plus exactly these tags, rebuilt from their data (never by calling what the
tag names), for plain numeric dtypes only; every other ``python/`` tag stays an error.
:class:`NumpyYamlDumper` writes arrays and scalars in the same form (numpy 1.x module names, as the
published files have), so the synthetic world writes what the real data set holds.
"""
from __future__ import annotations

import numpy as np
import yaml

_PY = "tag:yaml.org,2002:python/"
# numpy 1.x wrote ``numpy.core``; numpy 2 writes ``numpy._core``: the same functions.
_NUMPY_CORE_MODULES = ("numpy.core.multiarray", "numpy._core.multiarray")
RECONSTRUCT_TAGS = tuple(f"{_PY}object/apply:{m}._reconstruct" for m in _NUMPY_CORE_MODULES)
SCALAR_TAGS = tuple(f"{_PY}object/apply:{m}.scalar" for m in _NUMPY_CORE_MODULES)
DTYPE_TAG = f"{_PY}object/apply:numpy.dtype"
NDARRAY_NAME_TAG = f"{_PY}name:numpy.ndarray"
TUPLE_TAG = f"{_PY}tuple"
# Numbers only: an object dtype ("O") would unpickle its payload.
_ALLOWED_KINDS = "biuf"
_BYTE_ORDERS = ("<", ">", "|", "=")


class _NdarrayName:
    """What ``!!python/name:numpy.ndarray`` stands for: a marker, never the class itself."""


def _construct_tuple(loader, node) -> tuple:
    return tuple(loader.construct_sequence(node, deep=True))


def _construct_ndarray_name(loader, node) -> _NdarrayName:
    if loader.construct_scalar(node) not in ("", None):
        raise yaml.constructor.ConstructorError(
            None, None, "!!python/name:numpy.ndarray takes no value", node.start_mark)
    return _NdarrayName()


def _apply_arguments(loader, node) -> tuple:
    """(args, state) of an ``object/apply`` node: a sequence (args only) or {args, state}."""
    if isinstance(node, yaml.SequenceNode):
        return list(loader.construct_sequence(node, deep=True)), None
    mapping = loader.construct_mapping(node, deep=True)
    unknown = set(mapping) - {"args", "state"}
    if unknown:
        raise _error(node, f"unexpected keys {sorted(unknown)}")
    return list(mapping.get("args") or []), mapping.get("state")


def _error(node, problem: str) -> yaml.constructor.ConstructorError:
    return yaml.constructor.ConstructorError(None, None, f"{node.tag}: {problem}",
                                             node.start_mark)


def _construct_dtype(loader, node) -> np.dtype:
    """``numpy.dtype(name, align, copy)`` with ``state[1]`` the byte order; numbers only."""
    args, state = _apply_arguments(loader, node)
    if not args or not isinstance(args[0], str):
        raise _error(node, f"expects a dtype name as first argument, got {args!r}")
    try:
        dtype = np.dtype(args[0])
    except TypeError:
        raise _error(node, f"unknown dtype {args[0]!r}") from None
    if dtype.kind not in _ALLOWED_KINDS or dtype.fields is not None:
        raise _error(node, f"dtype {args[0]!r} is not a plain number type")
    if state is not None:
        order = state[1] if isinstance(state, (tuple, list)) and len(state) > 1 else None
        if order not in _BYTE_ORDERS:
            raise _error(node, f"bad byte order in state {state!r}")
        dtype = dtype.newbyteorder(order) if order in "<>" else dtype
    return dtype


def _construct_scalar(loader, node):
    """``multiarray.scalar(dtype, raw bytes)`` -> a numpy scalar of that dtype."""
    args, _ = _apply_arguments(loader, node)
    if len(args) != 2 or not isinstance(args[0], np.dtype) or not isinstance(args[1], bytes):
        raise _error(node, "expects [dtype, !!binary bytes]")
    dtype, raw = args
    if len(raw) != dtype.itemsize:
        raise _error(node, f"{len(raw)} bytes for a {dtype} scalar of {dtype.itemsize}")
    return np.frombuffer(raw, dtype=dtype)[0]


def _construct_ndarray(loader, node) -> np.ndarray:
    """``_reconstruct(ndarray, (0,), b'b')`` plus ``__setstate__((1, shape, dtype, fortran,
    raw))`` -> the array, built from the raw bytes (native byte order, writable copy)."""
    args, state = _apply_arguments(loader, node)
    if len(args) != 3 or not isinstance(args[0], _NdarrayName):
        raise _error(node, "expects args [!!python/name:numpy.ndarray, (0,), b'b']")
    if not isinstance(state, tuple) or len(state) != 5:
        raise _error(node, "expects state (version, shape, dtype, fortran_order, raw bytes)")
    _, shape, dtype, fortran_order, raw = state
    if not isinstance(dtype, np.dtype) or not isinstance(raw, bytes) \
            or not isinstance(shape, tuple) or not all(isinstance(n, int) and n >= 0
                                                       for n in shape):
        raise _error(node, "state must hold a shape tuple, a numeric dtype and raw bytes")
    count = int(np.prod(shape, dtype=np.int64))
    if len(raw) != count * dtype.itemsize:
        raise _error(node, f"{len(raw)} bytes for shape {shape} of {dtype}")
    flat = np.frombuffer(raw, dtype=dtype)
    array = flat.reshape(shape, order="F" if fortran_order else "C")
    return np.ascontiguousarray(array, dtype=dtype.newbyteorder("="))


class NumpyYamlLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """Safe loader + numpy arrays/scalars (see the module doc); any other python tag fails."""


NumpyYamlLoader.add_constructor(TUPLE_TAG, _construct_tuple)
NumpyYamlLoader.add_constructor(NDARRAY_NAME_TAG, _construct_ndarray_name)
NumpyYamlLoader.add_constructor(DTYPE_TAG, _construct_dtype)
for _tag in RECONSTRUCT_TAGS:
    NumpyYamlLoader.add_constructor(_tag, _construct_ndarray)
for _tag in SCALAR_TAGS:
    NumpyYamlLoader.add_constructor(_tag, _construct_scalar)


# --------------------------------------------------------------------------------- writing

def _tuple_node(dumper, items: list):
    return dumper.represent_sequence(TUPLE_TAG, items)


def _dtype_node(dumper, dtype: np.dtype):
    """The dtype as numpy 1.x pickles it: args (name, align=False, copy=True), state (3, order,
    None, None, None, -1, -1, 0)."""
    order = "|" if dtype.itemsize == 1 else "<"
    state = _tuple_node(dumper, [3, order, None, None, None, -1, -1, 0])
    args = dumper.represent_list([dtype.str[1:], False, True])
    return yaml.MappingNode(DTYPE_TAG, [(dumper.represent_str("args"), args),
                                        (dumper.represent_str("state"), state)])


def _represent_ndarray(dumper, array: np.ndarray):
    if array.dtype.kind not in _ALLOWED_KINDS:
        raise yaml.representer.RepresenterError(f"cannot write a {array.dtype} array")
    little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    name = yaml.ScalarNode(NDARRAY_NAME_TAG, "")
    args = yaml.SequenceNode("tag:yaml.org,2002:seq",
                             [name, _tuple_node(dumper, [0]), dumper.represent_binary(b"b")])
    state = yaml.SequenceNode(TUPLE_TAG, [
        dumper.represent_int(1), _tuple_node(dumper, list(array.shape)),
        _dtype_node(dumper, array.dtype), dumper.represent_bool(False),
        dumper.represent_binary(little.tobytes())])
    return yaml.MappingNode(RECONSTRUCT_TAGS[0], [(dumper.represent_str("args"), args),
                                                  (dumper.represent_str("state"), state)])


def _represent_numpy_scalar(dumper, value: np.generic):
    raw = np.asarray(value, dtype=value.dtype.newbyteorder("<")).tobytes()
    return yaml.SequenceNode(SCALAR_TAGS[0], [_dtype_node(dumper, value.dtype),
                                              dumper.represent_binary(raw)])


class NumpyYamlDumper(yaml.SafeDumper):
    """Safe dumper + numpy arrays and float/int scalars in the published V2V4Real form."""


NumpyYamlDumper.add_representer(np.ndarray, _represent_ndarray)
for _scalar_type in (np.float64, np.float32, np.int64, np.int32):
    NumpyYamlDumper.add_representer(_scalar_type, _represent_numpy_scalar)
