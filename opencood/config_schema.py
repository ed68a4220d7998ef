"""The typed, closed schema of an experiment config: one frozen dataclass per yaml section.

Why: defaults used to live at the read sites (``section.get(key, default)``), so a run folder's
saved ``config.yaml`` lacked what had been applied, a misspelt key was silently ignored and a
bad enumeration failed (or not) deep inside training. Here every key has one type and one
default, in one place; :func:`parse` refuses unknown keys, wrong types and bad enumerations
with a :class:`SchemaError` naming the dotted key. ``parse(...)`` is the complete (resolved)
config that the program carries (``opencood.config.load_config``): each section also reads as
a read-only mapping (below), and ``to_plain`` of it is the plain nested dict the run folder
saves and ``--model_dir`` reloads to an equal config. OpenCOOD key names are kept (``train_params.epoches``,
``preprocess.args.max_voxel_train``, ``data_augment[].NAME``).

How a section class reads:
* ``@section``: a frozen, keyword-only dataclass that is also a read-only ``Mapping`` of its
  fields (``section["key"]``, ``.get``, ``in``, iteration, equality with a dict): a key reads as
  the plain config held it (a tuple as a new list, a nested section typed), a write is a
  TypeError; open mappings (``Dict[str, Any]``) are stored as a read-only ``FrozenDict``;
* its fields are the keys, in the order a saved config lists them; a field without a default is
  required, except a section (or ``spec(args_of=...)``) field, which an absent key gives the
  defaults of (and names its first required key when it has one);
* ``spec(check=f)``: ``f(value)`` returns what is wrong ("must be > 0") or None;
* ``spec(args_of=("core_method", KIND))``: the field's schema is the one the component named by
  the sibling ``core_method`` registered (``@FUSIONS.register(name, args=...)``, next to its
  class), and an open mapping for a component registered without one or not registered;
* ``spec(registered=KIND)``: the value must be a registered name of ``KIND``;
* ``KIND`` ("model", "fusion", "loss", "fusion method") is looked up in the ``registered``
  mapping that :func:`parse` is given (``opencood.config`` passes the registries'); without it
  no name is checked and every ``args_of`` field is an open mapping;
* ``Dict[str, S]`` with ``S`` a section: a mapping of any names, each value parsed as ``S``;
* ``ALIASES``: an accepted other spelling of a key, rewritten to the key on load, so the
  resolved config has one spelling;
* ``problems()``: cross-field errors, as (key, what is wrong) pairs;
* ``completed()``: the section with the defaults of the form it was given in (e.g. a model's
  OpenCOOD-form pillar keys), so the resolved config stays complete.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Callable, Dict, Iterator, Literal, Mapping, Optional, Tuple, Union, \
    get_args, get_origin, get_type_hints

MISSING = dataclasses.MISSING
Problems = Iterator[Tuple[str, str]]
# kind ("model", "fusion", ...) -> {registered name: its arguments' schema, or None}
Registered = Mapping[str, Mapping[str, Optional[type]]]

# -- defaults the code shares with the schema, named once ---------------------------------------
# OpenCOOD's OPV2V crop: the range the data sets used when a config named none.
DEFAULT_LIDAR_RANGE = (-140.8, -40.0, -3.0, 140.8, 40.0, 1.0)
DEFAULT_COMM_RANGE = 70.0           # metres; CAVs farther from the ego are dropped
# The anchor: a mid-size car (OPV2V), sizes in metres in (h, w, l) order, its centre height in the
# lidar frame, and its yaws in degrees; one head cell per FEATURE_STRIDE pillar cells.
ANCHOR_HWL = (1.56, 1.6, 3.9)
ANCHOR_Z = -1.0
ANCHOR_YAWS_DEG = (0.0, 90.0)
FEATURE_STRIDE = 2
# Weight of DiscoNet's distillation term: HEAL's lidar_disco.yaml (the loss is a mean over
# channels too, opencood.losses.distillation).
DEFAULT_KD_WEIGHT = 1e4


# -- read-only mapping access -------------------------------------------------------------------
# The loaded config is carried through the program typed (``load_config`` returns a ``Config``),
# while most code reads it as the plain nested dict it used to be (``cfg["model"]["args"]``).
# A section therefore also reads as a read-only mapping: a key gives what the plain dict held
# (a tuple reads as a fresh list, a nested section stays typed), and writing is a TypeError.

READ_ONLY = ("the loaded config is read-only: change a copy (opencood.config.replaced, "
             "apply_overrides) or take schema.to_plain for plain data")


def plain_reading(value: Any) -> Any:
    """What a stored value reads as through mapping access: a tuple as a new list (of such
    readings), anything else (scalar, section, FrozenDict) as it is."""
    if isinstance(value, tuple):
        return [plain_reading(item) for item in value]
    return value


def _refuse_write(self, *args) -> None:
    raise TypeError(f"{type(self).__name__}: {READ_ONLY}")


class FrozenDict(collections.abc.Mapping):
    """A read-only open mapping: what an open section (``optimizer.args``, the ``args`` of a
    component registered without a schema) holds. Nested mappings are FrozenDicts and lists are
    tuples (:func:`freeze`); reading gives lists back, like a section's keys."""

    def __init__(self, items: Mapping = ()):
        self._items = dict(items)

    def __getitem__(self, key: Any) -> Any:
        return plain_reading(self._items[key])

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"FrozenDict({self._items!r})"

    __setitem__ = __delitem__ = _refuse_write


def freeze(value: Any) -> Any:
    """Plain data -> its read-only form: mappings -> FrozenDict, lists -> tuples."""
    if isinstance(value, collections.abc.Mapping):
        return FrozenDict({key: freeze(item) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(item) for item in value)
    return value


def _section_keys(self) -> Tuple[str, ...]:
    return type(self).__section_keys__


def _section_getitem(self, key: Any) -> Any:
    if key not in type(self).__section_keys__:
        raise KeyError(key)
    return plain_reading(getattr(self, key))


def _section_eq(self, other: Any) -> bool:
    """Mapping equality (``collections.abc.Mapping``'s): a section equals a section or a plain
    dict of the same keys and values, as the plain config's dicts did."""
    if not isinstance(other, collections.abc.Mapping):
        return NotImplemented
    return dict(self.items()) == dict(other.items())


_MAPPING_METHODS = {
    "__getitem__": _section_getitem, "__eq__": _section_eq,
    "__iter__": lambda self: iter(type(self).__section_keys__),
    "__len__": lambda self: len(type(self).__section_keys__),
    "__contains__": lambda self, key: key in type(self).__section_keys__,
    "get": collections.abc.Mapping.get, "keys": collections.abc.Mapping.keys,
    "items": collections.abc.Mapping.items, "values": collections.abc.Mapping.values,
    "__setitem__": _refuse_write, "__delitem__": _refuse_write,
}


def section(cls: type) -> type:
    """Decorator of a schema section: a frozen, keyword-only dataclass that also reads as a
    read-only mapping of its fields (see READ_ONLY above)."""
    cls = dataclass(frozen=True, kw_only=True)(cls)
    cls.__section_keys__ = tuple(item.name for item in fields(cls))
    clash = set(cls.__section_keys__) & set(_MAPPING_METHODS)
    if clash:
        raise TypeError(f"{cls.__name__}: a field may not be named {', '.join(sorted(clash))}")
    for name, method in _MAPPING_METHODS.items():
        setattr(cls, name, method)
    collections.abc.Mapping.register(cls)
    return cls


class SchemaError(ValueError):
    """A config value that the schema refuses; the message names the dotted key (the loader
    adds the file)."""


def spec(default: Any = MISSING, *, check: Callable[[Any], Optional[str]] | None = None,
         args_of: Tuple[str, str] | None = None, registered: str | None = None):
    """A field with a value check, a schema chosen by a sibling key and/or a registered name
    (see module doc)."""
    return field(default=default, metadata={"check": check, "args_of": args_of,
                                            "registered": registered})


# -- value checks: what is wrong, or None ------------------------------------------------------

def positive(value) -> Optional[str]:
    return None if value > 0 else "must be > 0"


def non_negative(value) -> Optional[str]:
    return None if value >= 0 else "must be >= 0"


def probability(value) -> Optional[str]:
    return None if 0 < value < 1 else "must be in (0, 1)"


def non_empty(value) -> Optional[str]:
    return None if len(value) else "must not be empty"


def all_positive(value) -> Optional[str]:
    return None if all(v > 0 for v in value) else "must be numbers > 0"


def box_range(value) -> Optional[str]:
    """[xmin, ymin, zmin, xmax, ymax, zmax] with min < max."""
    if len(value) == 6 and all(value[i] < value[i + 3] for i in range(3)):
        return None
    return "must be 6 numbers [xmin, ymin, zmin, xmax, ymax, zmax] with min < max"


# -- sections ----------------------------------------------------------------------------------

@section
class FusionArgs:
    """``fusion.args`` (OpenCOOD's keys)."""

    # Intermediate fusion: True projects every agent's cloud into the ego frame before
    # pillarisation; False keeps it in its own frame and the model warps its BEV features into
    # the ego frame with ``transforms_to_ego`` (CoAlign, and pose correction before fusion).
    proj_first: bool = True


@section
class FusionSection:
    core_method: str = spec(registered="fusion method")     # no, early, late, intermediate
    args: FusionArgs
    # The format of the data folders (HEAL's key): a name of opencood.data.formats.
    dataset: str = spec("opv2v", registered="data set format")
    # DAIR-V2X-C's GT: "cooperative" (cooperative/label_world; CoAlign's DAIR tables),
    # "single_side" (the two single-side label sets merged in the ego frame; HEAL's LiDAR
    # tables). opencood.data.dairv2x; other formats have one GT.
    gt_source: Literal["cooperative", "single_side"] = "cooperative"
    # V2X-Real's collaboration mode (its ``dataset_mode``; opencood.data.v2xreal): vc (a vehicle
    # is the ego, every agent helps), ic (a roadside unit is the ego), v2v (vehicles only), i2i
    # (roadside units only).
    dataset_mode: Literal["vc", "ic", "v2v", "i2i"] = "vc"

    def problems(self) -> Problems:
        if self.gt_source != "cooperative" and self.dataset != "dairv2x":
            yield "gt_source", (f"{self.gt_source!r} is a DAIR-V2X-C GT (fusion.dataset: "
                                f"dairv2x); {self.dataset!r} has one GT, 'cooperative'")
        if self.dataset_mode != "vc" and self.dataset != "v2xreal":
            yield "dataset_mode", (f"{self.dataset_mode!r} is a V2X-Real collaboration mode "
                                   f"(fusion.dataset: v2xreal), not one of {self.dataset!r}")


@section
class TrainParams:
    batch_size: int = spec(check=positive)          # global: micro x world x accumulation
    epoches: int = spec(check=positive)             # OpenCOOD's spelling
    max_steps: int = spec(0, check=non_negative)    # > 0: stop after N optimizer steps
    max_micro_batch: Optional[int] = spec(None, check=positive)   # None: no per-process cap
    eval_freq: int = spec(1, check=positive)
    save_freq: int = spec(1, check=positive)
    keep_checkpoints: int = spec(3, check=non_negative)
    skip_nonfinite_steps: int = spec(0, check=non_negative)
    checkpoint_every_steps: int = spec(0, check=non_negative)       # 0: epoch ends only
    checkpoint_every_minutes: float = spec(0.0, check=non_negative)  # 0: epoch ends only
    max_cav: int = spec(5, check=positive)
    num_workers: int = spec(2, check=non_negative)
    grad_clip: Optional[float] = None               # None: no gradient-norm clipping
    # Parameter-name prefixes kept fixed (HEAL's backward alignment; opencood.engine.freeze)
    fix_modules: Tuple[str, ...] = ()


@section
class PreprocessArgs:
    voxel_size: Tuple[float, float, float] = spec(check=all_positive)
    max_points_per_voxel: int = spec(32, check=positive)
    max_voxel_train: Optional[int] = spec(None, check=positive)   # pillars kept; None: all
    max_voxel_test: Optional[int] = spec(None, check=positive)


@section
class PreprocessSection:
    core_method: Literal["SpVoxelPreprocessor"] = "SpVoxelPreprocessor"   # pillars only
    args: PreprocessArgs
    cav_lidar_range: Tuple[float, ...] = spec(DEFAULT_LIDAR_RANGE, check=box_range)


@section
class BevGridSection:
    """``bev_grid``: the BEV map every encoder writes, the backbone and heads run on and the
    anchors sit on (a cell of ``cell_size`` metres over ``range``). Unset: the pillar grid of
    ``preprocess`` (``cav_lidar_range`` and the first two of ``voxel_size``), so a LiDAR config
    need not name it; a camera encoder writes it without pillars."""

    range: Optional[Tuple[float, ...]] = spec(None, check=box_range)
    cell_size: Optional[Tuple[float, float]] = spec(None, check=all_positive)


@section
class Augmentation:
    """One ``data_augment`` entry; its ``NAME`` picks the subclass (``AUGMENTATIONS``)."""

    NAME: str

    @classmethod
    def choose(cls, value: Any, key: str) -> type:
        name = value.get("NAME") if isinstance(value, collections.abc.Mapping) else None
        if name not in AUGMENTATIONS:
            raise SchemaError(f"key {key + '.NAME'!r} is {name!r}; expected one of "
                              f"{', '.join(AUGMENTATIONS)}")
        return AUGMENTATIONS[name]


@section
class WorldFlip(Augmentation):
    NAME: Literal["random_world_flip"]
    ALONG_AXIS_LIST: Tuple[Literal["x", "y"], ...] = ("x",)


@section
class WorldRotation(Augmentation):
    NAME: Literal["random_world_rotation"]
    WORLD_ROT_ANGLE: Tuple[float, float] = (-math.pi / 4, math.pi / 4)     # radians


@section
class WorldScaling(Augmentation):
    NAME: Literal["random_world_scaling"]
    WORLD_SCALE_RANGE: Tuple[float, float] = spec((0.95, 1.05), check=all_positive)


AUGMENTATIONS: Dict[str, type] = {"random_world_flip": WorldFlip,
                                  "random_world_rotation": WorldRotation,
                                  "random_world_scaling": WorldScaling}


@section
class AnchorArgs:
    l: float = ANCHOR_HWL[2]        # noqa: E741  (OpenCOOD's key)
    w: float = ANCHOR_HWL[1]
    h: float = ANCHOR_HWL[0]
    z: float = ANCHOR_Z
    r: Tuple[float, ...] = spec(ANCHOR_YAWS_DEG, check=non_empty)     # yaws, degrees
    feature_stride: int = spec(FEATURE_STRIDE, check=positive)
    # "cell_centre": every anchor at its feature cell's centre; "reference": OpenCOOD's
    # linspace(min + voxel, max - voxel) over the range, which weights trained there expect
    # (the same at stride 2, up to 0.4 m off at stride 4; opencood.postprocess.anchors)
    placement: Literal["cell_centre", "reference"] = "cell_centre"


@section
class TargetArgs:
    pos_threshold: float = 0.6
    neg_threshold: float = 0.45
    score_threshold: float = 0.2

    def problems(self) -> Problems:
        if self.neg_threshold > self.pos_threshold:
            yield "neg_threshold", f"({self.neg_threshold}) must be <= pos_threshold"


@section
class DetectionClass:
    """One class of a multi-class detector (``postprocess.classes``): its anchor and its target
    thresholds, V2X-Real's ``anchor_generator_config`` entry (its ``anchor_sizes`` are
    ``[l, w, h]``; its ``anchor_bottom_heights`` are used as the anchor's centre z)."""

    name: str = spec(check=non_empty)
    l: float = spec(check=positive)     # noqa: E741  (anchor size, metres)
    w: float = spec(check=positive)
    h: float = spec(check=positive)
    z: float                            # anchor centre height in the lidar frame
    pos_threshold: float = 0.6          # standup BEV IoU making an anchor of this class positive
    neg_threshold: float = 0.45         # ... and below which it is negative

    def problems(self) -> Problems:
        if self.neg_threshold > self.pos_threshold:
            yield "neg_threshold", f"({self.neg_threshold}) must be <= pos_threshold"


def distinct_names(classes) -> Optional[str]:
    if classes is None:
        return None
    if not classes:
        return "must list at least one class (or be left out: one class)"
    names = [entry.name for entry in classes]
    return None if len(set(names)) == len(names) else f"names a class twice: {names}"


@section
class PostprocessSection:
    core_method: str = "VoxelPostprocessor"
    gt_range: Optional[Tuple[float, ...]] = spec(None, check=box_range)   # None: cav_lidar_range
    anchor_args: AnchorArgs
    target_args: TargetArgs
    # Multi-class detection (docs/DESIGN.md §5.1): class id k is entry k; each has its own anchor
    # (sizes, z) on the shared yaws ``anchor_args.r`` and its own pos / neg thresholds, which
    # replace anchor_args' l / w / h / z and target_args' pos / neg thresholds. None: one class.
    classes: Optional[Tuple[DetectionClass, ...]] = spec(None, check=distinct_names)
    order: Literal["hwl", "lwh"] = "hwl"
    max_num: int = spec(100, check=positive)
    nms_thresh: float = 0.15
    pre_nms_max: int = spec(500, check=positive)    # candidates kept before the rotated NMS
    # "ours": the pre_nms_max best enter NMS, at most max_num are kept. "reference": OpenCOOD's
    # post_process: boxes wider than 6 m along x or y or with a corner's z outside [-3, 1] are
    # dropped first, the pre_nms_max best enter NMS (OpenCOOD's 1000: set by an import and
    # hypes_yaml/opv2v/reference), every box NMS keeps is kept (its max_num only pads the GT),
    # as weights trained there were evaluated (opencood.postprocess).
    # "v2xreal": V2X-Real's (and QuantV2X's) post_process: no box dropped before NMS (its 100 m
    # filters), the pre_nms_max best (its 1000) enter one class-agnostic NMS, every survivor kept.
    filters: Literal["ours", "reference", "v2xreal"] = "ours"


@section
class ModelSection:
    core_method: str
    args: Any = spec(args_of=("core_method", "model"))     # the model's own schema


@section
class LossSection:
    core_method: str
    args: Any = spec(args_of=("core_method", "loss"))      # the loss's own schema


@section
class OptimizerSection:
    core_method: Literal["Adam", "AdamW", "SGD"] = "Adam"
    lr: float = spec(check=positive)
    args: Dict[str, Any]                             # torch.optim keyword arguments

    def problems(self) -> Problems:
        """Refuse a keyword the torch optimiser does not take (checked here, not at step 0)."""
        import inspect

        import torch
        accepted = set(inspect.signature(getattr(torch.optim, self.core_method)).parameters)
        accepted -= {"self", "params", "lr"}
        for name in self.args:
            if name not in accepted:
                yield f"args.{name}", (f"is not an argument of torch.optim.{self.core_method} "
                                       f"(accepted: {', '.join(sorted(accepted))})")


@section
class LrSchedulerSection:
    core_method: Literal["cosine", "multistep", "constant"] = "constant"
    warmup_epochs: float = spec(0.0, check=non_negative)
    warmup_start_ratio: float = spec(0.01, check=non_negative)
    min_lr_ratio: float = spec(0.0, check=non_negative)     # cosine floor, fraction of lr
    step_size: Tuple[int, ...] = ()                  # multistep milestones, epochs
    gamma: float = spec(0.1, check=positive)


@section
class InitSection:
    method: Literal["xavier_uniform", "xavier_normal", "kaiming", "default"] = "xavier_uniform"
    cls_prior: float = spec(0.01, check=probability)
    # A new run's starting weights, by name (HEAL's stage two from its base; engine.freeze)
    checkpoint: Optional[str] = None


@section
class EmaSection:
    enabled: bool = False
    decay: float = spec(0.999, check=probability)
    tau: float = spec(200.0, check=non_negative)     # warm-up steps of the decay


@section
class AmpSection:
    enabled: bool = False                            # CUDA only
    dtype: Literal["bf16", "bfloat16", "fp16", "float16"] = "bf16"


@section
class DistributedSection:
    backend: Optional[Literal["nccl", "gloo"]] = None    # None: nccl on CUDA, else gloo
    timeout_minutes: float = spec(30.0, check=positive)
    find_unused_parameters: bool = False


@section
class PerformanceSection:
    tf32: bool = True
    cudnn_benchmark: bool = True
    # The fast training step (docs/gpu_and_speed.md "Fast step path"); off by default, results stay equal.
    # > 0: pillar slots per agent in training steps (fixed shapes; see pillarize_static).
    static_pillars: int = spec(0, check=non_negative)
    sync_free_step: bool = False        # one host read per optimizer step (engine.loop)
    compile: bool = False               # torch.compile the model for training steps
    # BEV maps and conv weights channels-last (NHWC) in training: what cudnn computes in, so no
    # NCHW<->NHWC transposes around each conv; fp32 gradients differ by float rounding
    channels_last: bool = False
    # The whole training step captured once as a CUDA graph and replayed (engine.cuda_graph):
    # needs CUDA, static_pillars and sync_free_step; a batch or run it cannot take runs eagerly
    cuda_graph: bool = False
    # Fixed sizes a batch is padded to for the graph (0: the first captured batch's own):
    cuda_graph_max_points: int = spec(0, check=non_negative)   # point rows of a whole batch
    cuda_graph_max_gt: int = spec(0, check=non_negative)       # GT boxes per sample


@section
class WildSetting:
    """Pose noise and latency of the non-ego agents (opencood.data.wild applies them)."""

    seed: int = 25                  # draws are a pure function of (seed, sample index[, epoch])
    loc_err: bool = False           # enable pose noise
    xyz_std: float = 0.0            # metres, gaussian, on the x and y of a non-ego lidar pose
    yaw_std: float = 0.0            # degrees, gaussian, on the yaw of a non-ego lidar pose
    latency_frames: int = 0         # non-ego agents report the frame this many timestamps earlier

    @classmethod
    def from_config(cls, section: dict | None) -> "WildSetting":
        """From a ``wild_setting`` section; missing keys take the defaults above, unknown keys
        and negative spreads are refused."""
        return parse(cls, section, "wild_setting")

    def problems(self) -> Problems:
        for key in ("xyz_std", "yaw_std", "latency_frames"):
            if getattr(self, key) < 0:
                yield key, f"must be >= 0, got {getattr(self, key)}"

    @property
    def has_pose_noise(self) -> bool:
        return self.loc_err and (self.xyz_std > 0 or self.yaw_std > 0)


@section
class BoxAlignArgs:
    """``box_align.args``: CoAlign's pose-graph settings, with the authors' names and values
    (``opencood.ops.pose_graph`` uses them)."""
    cluster_radius: float = spec(1.5, check=positive)        # m, the authors' ``thres``
    yaw_var_thres: float = spec(0.2, check=positive)         # rad^2: a cluster's yaws disagree
    max_iterations: int = spec(1000, check=positive)         # LM iterations (g2o's optimize(n))
    use_uncertainty: bool = True                            # information from the log variances
    abandon_hard_cases: bool = True                         # keep input poses for hard samples
    drop_hard_boxes: bool = True                            # no edges for yaw-disagreeing clusters
    min_landmarks: int = spec(3, check=non_negative)        # "3 or fewer landmarks" is hard
    relative_tolerance: float = spec(1e-12, check=non_negative)  # see opencood.ops.pose_graph
    # A box is the same box turned by pi: a clustered box whose heading is opposite its seed's
    # is turned before the yaw check and its edge (False: the authors', headings as detected)
    half_turn_symmetric: bool = True
    # The authors' other switches, their defaults (``opencood.ops.pose_graph``): SE(2) landmarks
    # (False: x / y points, edges without yaw), point landmarks only for yaw-disagreeing
    # clusters (their information doubled), sqrt of the information, no edge for a box whose
    # information sums below 100
    landmark_SE2: bool = True
    adaptive_landmark: bool = False
    normalize_uncertainty: bool = False
    drop_unsure_edge: bool = False


@section
class BoxAlignSection:
    """CoAlign's pose correction at evaluation (the authors' ``box_align`` key): stage-1
    detections of every agent in its own frame -> pose graph -> corrected agent -> ego
    transforms (``opencood.eval.pose_correction``).

    ``stage1_model_dir``: the run folder of a single-agent model (``point_pillar``, ideally with
    the uncertainty head) that detects in each agent's own frame, as the authors' stage-1
    result; needed by intermediate-fusion runs (own-frame data, ``fusion.args.proj_first:
    false``). None: the run's own model is stage 1 (late fusion: ``late_box_align``)."""
    stage1_model_dir: Optional[str] = None
    args: BoxAlignArgs


@section
class KdSection:
    """Knowledge distillation from a frozen early-fusion teacher (DiscoNet)."""

    teacher: str = spec(check=non_empty)         # run folder or .pth; its file checked on load
    weight: float = spec(DEFAULT_KD_WEIGHT, check=positive)


@section
class DataAugConf:
    """``camera.data_aug_conf``: HEAL's image augmentation (opencood.data.cameras). Defaults:
    HEAL's OPV2V camera yamls."""

    H: int = spec(600, check=positive)              # the camera images' size (pixels)
    W: int = spec(800, check=positive)
    final_dim: Tuple[int, int] = spec((384, 512), check=all_positive)   # (fH, fW) model input
    resize_lim: Tuple[float, float] = spec((0.65, 0.7), check=all_positive)   # training draw
    bot_pct_lim: Tuple[float, float] = (0.0, 0.05)  # part of the bottom cut off (training draw)
    rot_lim: Tuple[float, float] = (-3.6, 3.6)      # degrees (training draw)
    rand_flip: bool = False
    # HEAL's keys, informative: the datasets read every camera of a frame (OPV2V 4,
    # DAIR-V2X-C 1; HEAL's DAIR camera yamls say Ncams: 4 too).
    Ncams: int = spec(4, check=positive)
    cams: Optional[Tuple[str, ...]] = None

    def problems(self) -> Problems:
        for key in ("resize_lim", "bot_pct_lim", "rot_lim"):
            low, high = getattr(self, key)
            if low > high:
                yield key, f"[{low}, {high}]: the low end is above the high end"
        if self.cams is not None and len(self.cams) != self.Ncams:
            yield "cams", f"names {len(self.cams)} cameras, Ncams is {self.Ncams}"


@section
class CameraSection:
    """``camera``: the camera inputs, read when ``input_source`` has "camera"."""

    data_aug_conf: DataAugConf


def input_sources(value) -> Optional[str]:
    if not {"lidar", "camera"} & set(value):
        return "must name at least one of lidar, camera"
    if len(set(value)) != len(value):
        return "names an input twice"
    if "depth" in value and "camera" not in value:
        return "has 'depth' (the cameras' depth images) without 'camera'"
    return None


# The LiDARs of HEAL's OPV2V-H beside OPV2V's 64-beam one (opencood.data.heter reads them).
LIDAR_CHANNELS = (16, 32, 64)


@section
class ModalitySetting:
    """``heter.modality_setting.<name>`` (HEAL's keys): the sensor an agent of this modality
    carries and what its data set reads for it (opencood.data.heter)."""

    sensor_type: Literal["lidar", "camera"]
    # HEAL's encoder name (point_pillar, lift_splat_shoot, second, ...): kept as HEAL's yamls
    # have it; the model builds the modality's encoder from its own section.
    core_method: str = spec(check=non_empty)
    # lidar: the modality's pillar grid and crop (HEAL's per-modality preprocess); None: the
    # top-level ``preprocess``.
    preprocess: Optional[PreprocessSection] = None
    # camera: the modality's image augmentation (required) and HEAL's lift-splat grid (read by
    # the model's encoder, not by the data set).
    data_aug_conf: Optional[DataAugConf] = None
    grid_conf: Optional[Dict[str, Any]] = None

    def problems(self) -> Problems:
        if self.sensor_type == "camera":
            if self.data_aug_conf is None:
                yield "data_aug_conf", ("is missing: a camera modality needs its image "
                                        "augmentation (HEAL's keys: H, W, final_dim, ...)")
            if self.preprocess is not None:
                yield "preprocess", "is a LiDAR setting; this modality's sensor_type is camera"
        else:
            for key in ("data_aug_conf", "grid_conf"):
                if getattr(self, key) is not None:
                    yield key, "is a camera setting; this modality's sensor_type is lidar"


@section
class HeterSection:
    """``heter``: a modality per agent, HEAL's section read as HEAL reads it
    (opencood.data.heter; docs/DESIGN.md §4.4).

    ``assignment_path``: a json {scenario: {cav id: modality}} (HEAL's
    ``heter_modality_assign``; the synthetic world writes one, ``--heter``).
    Evaluation: each agent's modality is ``mapping_dict[assigned]``; training draws them (the
    ego from ``ego_modality``, the others by ``cav_preference``). Agents whose modality is not
    in ``modality_setting`` take no part; ``lidar_channels_dict`` picks OPV2V-H's 32- or
    16-beam LiDAR of a modality."""

    assignment_path: Optional[str] = None            # required by the OPV2V layout
    ego_modality: str = spec(check=non_empty)        # "m1", or "m1&m2": one of them
    # assigned modality -> the model's; one outside modality_setting: its agents take no part
    mapping_dict: Dict[str, str]
    # lidar modality -> beams (HEAL's yamls also name modalities they leave out: ignored)
    lidar_channels_dict: Optional[Dict[str, int]] = None     # None: all read <ts>.pcd (64)
    cav_preference: Optional[Dict[str, float]] = None        # None: uniform (training draws)
    modality_setting: Dict[str, ModalitySetting] = spec(check=non_empty)

    def problems(self) -> Problems:
        names = set(self.modality_setting)
        known = f"modality_setting has {', '.join(sorted(names))}"
        for name in self.ego_modalities:
            if name not in names:
                yield "ego_modality", f"names {name!r}; {known}"
        for name, channels in (self.lidar_channels_dict or {}).items():
            if name in names and self.modality_setting[name].sensor_type != "lidar":
                yield f"lidar_channels_dict.{name}", "names a camera modality"
            elif channels not in LIDAR_CHANNELS:
                yield f"lidar_channels_dict.{name}", (f"is {channels}; OPV2V-H has LiDARs of "
                                                      f"{', '.join(map(str, LIDAR_CHANNELS))} "
                                                      f"beams")
        for name, weight in (self.cav_preference or {}).items():
            if name not in names:
                yield f"cav_preference.{name}", f"is not a modality; {known}"
            elif weight < 0:
                yield f"cav_preference.{name}", f"is {weight}; weights must be >= 0"
        if self.cav_preference is not None and sum(self.cav_preference.values()) <= 0:
            yield "cav_preference", "has no positive weight"

    @property
    def ego_modalities(self) -> Tuple[str, ...]:
        """``ego_modality`` split at '&' (HEAL's "m1&m2")."""
        return tuple(self.ego_modality.split("&"))


@section
class Config:
    name: str
    root_dir: Optional[str] = None                   # the train split
    validate_dir: Optional[str] = None               # None: no validation
    test_dir: Optional[str] = None
    seed: int = 0
    comm_range: float = spec(DEFAULT_COMM_RANGE, check=positive)   # metres
    fusion: FusionSection
    # HEAL's key: the inputs the datasets read ("camera": the camera keys, camera.data_aug_conf;
    # "depth": the cameras' depth images too; without "lidar" no .pcd is read).
    input_source: Tuple[Literal["lidar", "camera", "depth"], ...] = spec(
        ("lidar",), check=input_sources)
    # HEAL's key: which labels a sample's GT is made of. "lidar": the agents' ``vehicles``
    # (what their LiDARs see; heter camera agents: their bev_visibility map's in training);
    # "camera": what each agent's bev_visibility map shows, in training and evaluation (a heter
    # config's intermediate fusion ignores it, as HEAL's; opencood.data.datasets).
    label_type: Literal["lidar", "camera"] = "lidar"
    camera: Optional[CameraSection] = None           # with input_source camera
    heter: Optional[HeterSection] = None             # a modality per agent (HEAL's)
    train_params: TrainParams
    preprocess: PreprocessSection
    bev_grid: BevGridSection
    data_augment: Tuple[Augmentation, ...] = ()
    postprocess: PostprocessSection
    model: ModelSection
    loss: LossSection
    optimizer: OptimizerSection
    lr_scheduler: LrSchedulerSection
    init: InitSection
    ema: EmaSection
    amp: AmpSection
    distributed: DistributedSection
    performance: PerformanceSection
    wild_setting: WildSetting
    kd: Optional[KdSection] = None                   # None: no distillation
    box_align: Optional[BoxAlignSection] = None      # None: no pose correction at evaluation

    def problems(self) -> Problems:
        if self.heter is not None:
            yield from self._heter_problems()
            return
        if "camera" in self.input_source and self.camera is None:
            yield "camera", ("is missing: input_source has 'camera' (give at least "
                             "camera: {data_aug_conf: {H: ..., W: ...}})")
        if self.camera is not None and "camera" not in self.input_source:
            yield "camera", (f"is set but input_source is {list(self.input_source)}: add "
                             f"'camera' to read the cameras")
        # kd needs an intermediate-fusion student: the run's strategy checks it
        # (opencood.strategies.choose_strategy).
        yield from self._head_size_problems()

    def _head_size_problems(self) -> Problems:
        """A class list sizes the head (``derive``): model args that name other sizes."""
        post = self.postprocess
        if post.classes is None:
            return
        args = self.model.args
        given = vars(args) if is_dataclass(args) else \
            (args if isinstance(args, collections.abc.Mapping) else {})
        expected = {"num_class": num_classes(post),
                    "anchor_number": num_classes(post) * len(post.anchor_args.r)}
        for key, value in expected.items():
            if given.get(key) is not None and given[key] != value:
                yield f"model.args.{key}", (f"is {given[key]}, but postprocess.classes and "
                                            f"anchor_args.r make it {value} (leave it out)")

    def _heter_problems(self) -> Problems:
        """A heter config: its modalities' sensors are inputs, their settings replace the
        ``camera`` section, the assignment is named (the data set's reader must read it:
        opencood.data.datasets checks)."""
        for name, setting in self.heter.modality_setting.items():
            if setting.sensor_type not in self.input_source:
                yield "input_source", (f"is {list(self.input_source)}; heter modality {name!r} "
                                       f"is a {setting.sensor_type} one")
        if self.camera is not None:
            yield "camera", ("is set with heter: each camera modality gives its data_aug_conf "
                             "(heter.modality_setting.<name>.data_aug_conf)")
        if self.heter.assignment_path is None:
            yield "heter.assignment_path", ("is not set: each agent's modality comes from "
                                            "this json (scenario -> cav id -> modality)")


# -- parsing -------------------------------------------------------------------------------------

def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _unknown_key(cls: type, prefix: str, key: str) -> SchemaError:
    names = [f.name for f in fields(cls)]
    close = difflib.get_close_matches(str(key), names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    where = f"in {prefix}" if prefix else "at the top level"
    return SchemaError(f"unknown key {_join(prefix, str(key))!r} ({hint}known {where}: "
                       f"{', '.join(names)})")


def _unalias(cls: type, data: dict, prefix: str) -> dict:
    """Rewrite the accepted other spellings of ``cls`` to its keys (both given: an error)."""
    data = dict(data)
    for alias, key in getattr(cls, "ALIASES", {}).items():
        if alias in data:
            if key in data:
                raise SchemaError(f"keys {_join(prefix, alias)!r} and {_join(prefix, key)!r} "
                                  f"are the same setting: give one")
            data[key] = data.pop(alias)
    return data


def _field_type(cls: type, item: dataclasses.Field, parsed: dict,
                registered: Registered | None) -> Any:
    if item.metadata.get("args_of"):
        sibling, kind = item.metadata["args_of"]
        schemas = registered[kind] if registered is not None else {}
        return schemas.get(parsed[sibling]) or Dict[str, Any]
    return get_type_hints(cls)[item.name]


def _registered_problem(item: dataclasses.Field, value: Any,
                        registered: Registered | None) -> Optional[str]:
    """What is wrong with a ``spec(registered=KIND)`` value: not a registered name of KIND."""
    kind = item.metadata.get("registered")
    if kind is None or registered is None or value in registered[kind]:
        return None
    return f"is not a registered {kind}; expected one of {', '.join(sorted(registered[kind]))}"


def _is_section(hint: Any) -> bool:
    return is_dataclass(hint) or hint == Dict[str, Any]


def parse(cls: type, data: Any, prefix: str = "", registered: Registered | None = None) -> Any:
    """``data`` (a mapping; None reads as empty) -> a ``cls`` with every default filled in.
    ``registered``: the names and argument schemas of the registries (module doc)."""
    data = {} if data is None else data
    if isinstance(data, collections.abc.Mapping) and not isinstance(data, dict):
        data = to_plain(data)       # a section or FrozenDict given again
    if not isinstance(data, dict):
        raise SchemaError(f"key {prefix!r} must be a mapping, got {data!r}")
    data = _unalias(cls, data, prefix)
    known = {f.name for f in fields(cls)}
    for key in data:
        if key not in known:
            raise _unknown_key(cls, prefix, key)
    parsed: dict = {}
    for item in fields(cls):
        key = _join(prefix, item.name)
        hint = _field_type(cls, item, parsed, registered)
        parsed[item.name] = _field_value(item, hint, data, key, registered)
    obj = cls(**parsed)
    for name, problem in getattr(obj, "problems", lambda: ())():
        raise SchemaError(f"key {_join(prefix, name)!r} {problem}")
    # A section whose defaults depend on which of its forms was given completes itself.
    return obj.completed() if hasattr(obj, "completed") else obj


def _field_value(item: dataclasses.Field, hint: Any, data: dict, key: str,
                 registered: Registered | None) -> Any:
    if item.name in data:
        value = convert(hint, data[item.name], key, registered)
    elif item.default is not MISSING:
        value = item.default
    elif _is_section(hint):
        value = convert(hint, {}, key, registered)
    else:
        raise SchemaError(f"missing required key {key!r}")
    check = item.metadata.get("check")
    problem = check(value) if check is not None and value is not None else None
    problem = problem or _registered_problem(item, value, registered)
    if problem:
        raise SchemaError(f"key {key!r} {problem}, got {to_plain(value)!r}")
    return value


_SCALARS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


def _scalar(hint: type, value: Any, key: str) -> Any:
    """bool, int, str or float (an int is a float too; a bool is neither: yaml's yes/no)."""
    if isinstance(value, bool):
        fits = hint is bool
    elif hint is float:
        fits = isinstance(value, (int, float))
    else:
        fits = isinstance(value, hint)
    if not fits:
        raise SchemaError(f"key {key!r} must be {_SCALARS[hint]}, got {value!r}{_bool_hint(value)}")
    return float(value) if hint is float else value


def _bool_hint(value: Any) -> str:
    return " (yaml reads a bare no/yes/off as a boolean: quote it, 'no')" \
        if isinstance(value, bool) else ""


def _sequence(params: tuple, value: Any, key: str, registered: Registered | None) -> tuple:
    if not isinstance(value, (list, tuple)):
        raise SchemaError(f"key {key!r} must be a list, got {value!r}")
    if len(params) == 2 and params[1] is Ellipsis:
        params = (params[0],) * len(value)
    elif len(value) != len(params):
        raise SchemaError(f"key {key!r} must be a list of {len(params)}, got {value!r}")
    return tuple(convert(hint, item, f"{key}[{index}]", registered)
                 for index, (hint, item) in enumerate(zip(params, value)))


def convert(hint: Any, value: Any, key: str, registered: Registered | None = None) -> Any:
    """Check ``value`` against the type ``hint`` (int -> float where a float is expected)."""
    origin, params = get_origin(hint), get_args(hint)
    if hint is Any:
        return freeze(value)
    if isinstance(hint, type) and "choose" in vars(hint):
        return parse(hint.choose(value, key), value, key, registered)
    if is_dataclass(hint):
        return parse(hint, value, key, registered)
    if origin is Union:
        if value is None and type(None) in params:
            return None
        inner = [p for p in params if p is not type(None)]
        return convert(inner[0], value, key, registered)
    if origin is Literal:
        if not any(type(value) is type(option) and value == option for option in params):
            raise SchemaError(f"key {key!r} is {value!r}; expected one of "
                              f"{', '.join(map(str, params))}{_bool_hint(value)}")
        return value
    if origin is tuple:
        return _sequence(params, value, key, registered)
    if origin is dict:
        if not isinstance(value, collections.abc.Mapping) or \
                not all(isinstance(k, str) for k in value):
            raise SchemaError(f"key {key!r} must be a mapping, got {value!r}")
        if params[1] is Any:
            return freeze(value)
        # a typed mapping (heter's per-modality sections, its name -> name tables), read-only
        return FrozenDict({name: convert(params[1], item, f"{key}.{name}", registered)
                           for name, item in value.items()})
    return _scalar(hint, value, key)


def to_plain(value: Any) -> Any:
    """Sections -> dicts (keys in schema order), FrozenDicts -> dicts, tuples -> lists: plain
    data, for what leaves the program (yaml, json, checkpoints, hashes) or is to be changed."""
    if is_dataclass(value):
        return {item.name: to_plain(getattr(value, item.name)) for item in fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_plain(item) for item in value]
    if isinstance(value, collections.abc.Mapping):
        return {key: to_plain(item) for key, item in value.items()}
    return value


# -- derived values --------------------------------------------------------------------------

def num_classes(post: PostprocessSection) -> int:
    """Classes the detector tells apart: ``len(postprocess.classes)``, 1 without a list."""
    return 1 if post.classes is None else len(post.classes)


def derive(config: Config) -> Config:
    """Fill what the data sections determine and a config left out: ``postprocess.gt_range``
    (the crop range), ``bev_grid`` (the pillar grid) and the model's ``lidar_range``,
    ``voxel_size``, ``max_points_per_voxel``, ``anchor_number`` (one anchor per yaw and
    class), ``num_class``, ``bev_range`` and ``bev_cell_size``. Computed here, never by
    ``eval`` of a yaml string; a value the config gives wins."""
    pre = config.preprocess
    post = config.postprocess
    if post.gt_range is None:
        post = dataclasses.replace(post, gt_range=pre.cav_lidar_range)
    grid = config.bev_grid
    grid = dataclasses.replace(
        grid, range=grid.range if grid.range is not None else pre.cav_lidar_range,
        cell_size=grid.cell_size if grid.cell_size is not None else pre.args.voxel_size[:2])
    derived = {"lidar_range": pre.cav_lidar_range, "voxel_size": pre.args.voxel_size,
               "max_points_per_voxel": pre.args.max_points_per_voxel,
               "anchor_number": len(post.anchor_args.r) * num_classes(post),
               "num_class": num_classes(post),
               "bev_range": grid.range, "bev_cell_size": grid.cell_size}
    args = config.model.args
    if is_dataclass(args):      # the model's schema: its fields of these names left at None
        args = dataclasses.replace(args, **{key: value for key, value in derived.items()
                                            if getattr(args, key, MISSING) is None})
        if hasattr(args, "derived_from"):   # what else a model reads of the data sections
            args = args.derived_from(config)
    else:       # a model without a schema: its open mapping gets what it lacks
        args = freeze({**to_plain(derived), **to_plain(args)})
    model = dataclasses.replace(config.model, args=args)
    return dataclasses.replace(config, postprocess=post, model=model, bev_grid=grid)


def section_schema(name: str) -> type:
    """The schema of the top-level key ``name`` (e.g. "optimizer" -> OptimizerSection)."""
    hints = get_type_hints(Config)
    if name not in hints:
        raise _unknown_key(Config, "", name)
    return hints[name]
