#!/usr/bin/env python
"""Build ``tests/fixtures/parity/lift_splat.pt`` by running HEAL's lift-splat-shoot
(github.com/yifanlu0227/HEAL, ``opencood/models/lift_splat_shoot.py`` and the encoder of the same
name in ``opencood/models/heter_encoders.py``, their ``CamEncode`` / ``CamEncode_Resnet101`` /
``BevEncode`` in ``sub_modules/lss_submodule.py``, ``QuickCumsum`` and the depth bins in
``utils/camera_utils.py``, the depth loss in ``loss/point_pillar_depth_loss.py``). CI never runs
this script; ``tests/test_parity_lss.py`` reads what it wrote.

Three cases, each HEAL's own class built from the arguments its yamls give (``encoder_args`` of
m2_LSSeff48 / m4_LSSres48, shrunk: 64 x 128 images, a 32 x 32 m grid of 1 m cells, 10-12 depth
bins from 1 to 25 m, 8 image channels):

* ``eff_lid_full``: the single-agent ``LiftSplatShoot``, EfficientNet-b0 at stride 8, LID bins,
  depth supervision (a depth channel appended to the images, as HEAL's dataset does), its
  ResNet-18 ``BevEncode`` (16 channels) and cls / reg / dir heads; also the depth loss;
* ``eff_ud_heter``: the heterogeneous encoder, EfficientNet-b0 at stride 16, UD bins;
* ``res_ud_heter``: the heterogeneous encoder, ResNet-101, UD bins, two height cells (the
  splat's heights stacked as channels).

Inputs: 2 agents x 2 cameras (front / left, back / right: OPV2V's 800 x 600, 90-degree intrinsics,
its UE4-to-OpenCV axis change in the camera-to-agent matrix, cameras pitched and shifted), the
image augmentation by HEAL's own ``img_transform`` (resize 0.16, a crop, a rotation per camera, one
flip). Images, depth maps and every weight are generated (``tests/parity_weights.py``), so the
file holds recipes, matrices and outputs only. HEAL's ``EfficientNet.from_pretrained`` is replaced
by ``from_name`` (the same network; the weights are generated anyway), its hard-coded
``.to("cuda")`` by the CPU, the ``resnet18`` that ``lss_submodule.py`` calls without
importing it (a NameError at HEAD) supplied from torchvision, and the imports its forward never
reaches are stubbed. Eval mode, fp32, CPU, one thread. Also stored: the gradients of a probe
(``gradient_probe``) for the depth / image heads (and BevEncode's first conv).

Run (side environment: torch, torchvision, efficientnet_pytorch; from outside the checkout)::

    git --git-dir=/work/.mirror/yifanlu0227+HEAL/repo archive HEAD opencood | tar -x -C /tmp/heal
    cd /tmp && env -u PYTHONPATH /work/side/venv-lss/bin/python \\
        /path/to/checkout/tools/reference/make_lss_parity_fixture.py --heal /tmp/heal \\
        --commit <HEAL commit> --out /path/to/checkout/tests/fixtures/parity

Deterministic: rerunning it rewrites identical tensors.
"""
from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import math
import sys
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_env import load_by_path  # noqa: E402  (tools/reference/side_env.py)

REPO_ROOT = Path(__file__).resolve().parents[2]
IMAGE_SIZE = (64, 128)
ORIGINAL_SIZE = (600, 800)          # OPV2V's camera images (H, W)
INTRINSIC = [[400.0, 0.0, 400.0], [0.0, 400.0, 300.0], [0.0, 0.0, 1.0]]
UE4_TO_OPENCV = [[0, 0, 1, 0], [1, 0, 0, 0], [0, -1, 0, 0], [0, 0, 0, 1]]
# per agent, per camera: (yaw deg, pitch deg, x, y, z), augmentation (rotate deg, flip)
CAMERAS = [[((0.0, -4.0, 2.2, 0.0, 1.6), (3.0, False)), ((90.0, -2.0, 0.0, 1.0, 1.5), (-2.0, False))],
           [((180.0, -3.0, -2.0, 0.1, 1.6), (1.5, True)), ((-90.0, 0.0, 0.2, -1.0, 1.4), (0.0, False))]]
RESIZE = 0.16                        # 800 x 600 -> 128 x 96, then 64 rows cropped
CROP_TOP = 24
SMALL_GRID = {"xbound": [-16.0, 16.0, 1.0], "ybound": [-16.0, 16.0, 1.0],
              "zbound": [-10.0, 10.0, 20.0]}
CASES = {
    "eff_lid_full": {"module": "lift_splat_shoot", "camera_encoder": "EfficientNet",
                     "img_downsample": 8, "ddiscr": [1, 25, 12], "mode": "LID",
                     "depth_supervision": True, "bevout_feature": 16},
    "eff_ud_heter": {"module": "heter_encoders", "camera_encoder": "EfficientNet",
                     "img_downsample": 16, "ddiscr": [1, 25, 12], "mode": "UD",
                     "depth_supervision": False},
    "res_ud_heter": {"module": "heter_encoders", "camera_encoder": "Resnet101",
                     "img_downsample": 8, "ddiscr": [1, 25, 10], "mode": "UD",
                     "depth_supervision": False, "zbound": [-4.0, 4.0, 4.0]},
}
IMAGE_FEATURES = 8
# parameters whose gradient of gradient_probe the fixture keeps (those the model has)
GRADIENT_KEYS = ("camencode.depth_head.weight", "camencode.depth_head.bias",
                 "camencode.image_head.weight", "camencode.image_head.bias",
                 "bevencode.conv1.weight")
# depth maps: 8 + 32 u metres, u in [-1, 1): some below the first bin, some past the last
DEPTH_RECIPE = {"scale": 32.0, "offset": 8.0}
ABOUT = ("Made by tools/reference/make_lss_parity_fixture.py from HEAL (github.com/yifanlu0227/"
         "HEAL {commit}): its LiftSplatShoot (single-agent, with BevEncode and heads) and its "
         "heterogeneous encoder of the same name, EfficientNet-b0 and ResNet-101 camera "
         "encoders, UD and LID bins, generated weights and images, its img_transform for "
         "post_rots / post_trans, eval mode, fp32, CPU.")


STUBBED = []        # the modules stub_missing_modules stood in for, printed at the end
# top-level packages HEAL's imported files name and the lift-splat forward never calls
STUB_PACKAGES = {"icecream", "matplotlib", "cv2", "shapely", "pyquaternion", "spconv", "einops",
                 "timm", "scipy", "open3d", "skimage", "numba", "termcolor"}


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on ``sys.meta_path``: a module of :data:`STUB_PACKAGES` that nothing else finds
    becomes an empty stand-in whose attributes fail when called."""

    def find_spec(self, name, path, target=None):
        # box_overlaps: HEAL's Cython extension (training targets), not built in a source tree
        if name.split(".")[0] not in STUB_PACKAGES and name != "opencood.utils.box_overlaps":
            return None
        return importlib.util.spec_from_loader(name, self, is_package=True)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{module.__name__} is stubbed by make_lss_parity_fixture.py")

        def stub_attribute(attr: str):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return unavailable

        module.__getattr__ = stub_attribute
        STUBBED.append(module.__name__)


def stub_missing_modules() -> None:
    """Imports of HEAL's modules that the lift-splat forward never calls (plotting, debug
    printing, OpenCV / shapely / pyquaternion helpers of other code, SECOND's sparse
    convolutions): stand-ins, so HEAL's files run unedited."""
    sys.meta_path.append(_StubFinder())


def import_heal(source: Path):
    """HEAL's modules (its ``opencood``), refusing ours."""
    sys.path.insert(0, str(source.resolve()))
    stub_missing_modules()
    import opencood
    location = Path(opencood.__file__).resolve()
    if source.resolve() not in location.parents:
        raise SystemExit(f"error: 'opencood' resolves to {location.parent}, not HEAL's {source}")
    import torch
    from efficientnet_pytorch import EfficientNet
    # the network of from_pretrained without the download (weights are generated)
    EfficientNet.from_pretrained = classmethod(lambda cls, name, **kw: cls.from_name(name, **kw))
    submodule = __import__("opencood.models.sub_modules.lss_submodule", fromlist=["BevEncode"])
    # HEAL's BevEncode calls resnet18, which lss_submodule.py never imports (a NameError at
    # HEAD): the torchvision function its sibling lift_splat_shoot.py imports
    from torchvision.models.resnet import resnet18
    submodule.resnet18 = resnet18
    modules = {}
    for name in ("lift_splat_shoot", "heter_encoders"):
        module = __import__(f"opencood.models.{name}", fromlist=["LiftSplatShoot"])
        module.torch = cpu_torch(torch)         # their hard-coded .to(torch.device("cuda"))
        modules[name] = module
    camera_utils = __import__("opencood.utils.camera_utils", fromlist=["img_transform"])
    # its FocalLoss alone: the detection loss it subclasses pulls in the post-processor
    detection_loss = types.ModuleType("opencood.loss.point_pillar_loss")
    detection_loss.PointPillarLoss = torch.nn.Module
    sys.modules["opencood.loss.point_pillar_loss"] = detection_loss
    depth_loss = __import__("opencood.loss.point_pillar_depth_loss", fromlist=["FocalLoss"])
    return modules, camera_utils, depth_loss


def cpu_torch(torch):
    """``torch`` as the module sees it, with ``torch.device(...)`` always the CPU."""
    shim = types.ModuleType("torch")
    shim.__getattr__ = lambda attr: getattr(torch, attr)
    shim.device = lambda *args, **kwargs: torch.device("cpu")
    return shim


def heal_args(case: dict) -> dict:
    """``encoder_args`` as HEAL's m2_LSSeff48 / m4_LSSres48 yamls give them, shrunk."""
    grid = dict(SMALL_GRID, ddiscr=case["ddiscr"], mode=case["mode"])
    if "zbound" in case:
        grid["zbound"] = case["zbound"]
    args = {"grid_conf": grid,
            "data_aug_conf": {"final_dim": list(IMAGE_SIZE), "H": ORIGINAL_SIZE[0],
                              "W": ORIGINAL_SIZE[1]},
            "img_downsample": case["img_downsample"], "img_features": IMAGE_FEATURES,
            "use_depth_gt": False, "depth_supervision": case["depth_supervision"],
            "camera_encoder": case["camera_encoder"], "anchor_number": 2}
    if "bevout_feature" in case:
        args.update(bevout_feature=case["bevout_feature"], dir_args={"num_bins": 2})
    return args


def camera_to_agent(yaw: float, pitch: float, x: float, y: float, z: float) -> np.ndarray:
    """4x4 camera (OpenCV axes) -> agent, as HEAL's get_ext_int composes it: the camera's
    UE4-axes pose times the UE4-to-OpenCV axis change."""
    cy, sy = math.cos(math.radians(yaw)), math.sin(math.radians(yaw))
    cp, sp = math.cos(math.radians(pitch)), math.sin(math.radians(pitch))
    yaw_matrix = np.array([[cy, -sy, 0], [sy, cy, 0], [0, 0, 1]])
    pitch_matrix = np.array([[cp, 0, sp], [0, 1, 0], [-sp, 0, cp]])
    pose = np.eye(4)
    pose[:3, :3] = yaw_matrix @ pitch_matrix
    pose[:3, 3] = (x, y, z)
    return (pose.astype(np.float32) @ np.array(UE4_TO_OPENCV, dtype=np.float32)).astype(np.float32)


def make_geometry(camera_utils) -> dict:
    """(2, 2, ...) intrinsics, extrinsics, rots, trans, post_rots, post_trans (float32)."""
    import torch
    fields = {key: [] for key in ("intrins", "extrinsics", "rots", "trans", "post_rots",
                                  "post_trans")}
    for agent in CAMERAS:
        rows = {key: [] for key in fields}
        for pose, (rotate, flip) in agent:
            extrinsic = torch.from_numpy(camera_to_agent(*pose))
            resize_dims = (int(ORIGINAL_SIZE[1] * RESIZE), int(ORIGINAL_SIZE[0] * RESIZE))
            crop = (0, CROP_TOP, IMAGE_SIZE[1], CROP_TOP + IMAGE_SIZE[0])
            _, rot2, tran2 = camera_utils.img_transform(
                [], torch.eye(2), torch.zeros(2), resize=RESIZE, resize_dims=resize_dims,
                crop=crop, flip=flip, rotate=rotate)
            post_rot, post_tran = torch.eye(3), torch.zeros(3)       # HEAL's dataset: 3x3
            post_rot[:2, :2], post_tran[:2] = rot2, tran2
            rows["intrins"].append(torch.tensor(INTRINSIC))
            rows["extrinsics"].append(extrinsic)
            rows["rots"].append(extrinsic[:3, :3])
            rows["trans"].append(extrinsic[:3, 3])
            rows["post_rots"].append(post_rot)
            rows["post_trans"].append(post_tran)
        for key in fields:
            fields[key].append(torch.stack(rows[key]))
    return {key: torch.stack(value).float() for key, value in fields.items()}


def image_recipes() -> dict:
    batch, cams = len(CAMERAS), len(CAMERAS[0])
    return {"images": {"shape": [batch, cams, 3, *IMAGE_SIZE], "scale": 1.0, "offset": 0.0},
            "depth_maps": {"shape": [batch, cams, *IMAGE_SIZE], **DEPTH_RECIPE}}


def heal_outputs(model, case: dict, image_inputs: dict, depth_loss) -> dict:
    """HEAL's model on the inputs -> {bev, and for the single-agent model cls_preds, reg_preds,
    dir_preds, depth_logits, depth_target, depth_loss}."""
    if case["module"] == "heter_encoders":
        return {"bev": model({"inputs_m1": image_inputs}, "m1")}
    captured = {}
    hook = model.bevencode.register_forward_pre_hook(
        lambda mod, inp: captured.setdefault("bev", inp[0]))
    out = model({"image_inputs": image_inputs})
    hook.remove()
    logits, target = out["depth_items"]
    focal = depth_loss.FocalLoss(alpha=0.25, gamma=2.0, reduction="none")
    return {"bev": captured["bev"], "cls_preds": out["cls_preds"], "reg_preds": out["reg_preds"],
            "dir_preds": out["dir_preds"], "depth_logits": logits, "depth_target": target,
            "depth_loss": focal(logits, target).mean()}


def heal_image_inputs(case: dict, weights, geometry) -> dict:
    """HEAL's ``image_inputs`` (a fresh tensor each call: its depth clamp works in place)."""
    import torch
    inputs = weights.materialize(image_recipes())
    images = inputs["images"]
    if case["depth_supervision"]:            # HEAL's dataset: depth as a 4th image channel
        images = torch.cat([images, inputs["depth_maps"].unsqueeze(2)], dim=2)
    return {"imgs": images, **{key: geometry[key] for key in
                               ("intrins", "extrinsics", "rots", "trans", "post_rots",
                                "post_trans")}}


def gradient_probe(outputs: dict, weights):
    """sum over the float outputs k of <output_k, G_k>, G_k generated from ``gradient.<k>``
    (the test builds the same scalar from ours)."""
    total = 0
    for key, value in outputs.items():
        if value.is_floating_point():
            total = total + (value * weights.generated_tensor(f"gradient.{key}",
                                                              list(value.shape))).sum()
    return total


def run_case(name: str, case: dict, modules, depth_loss, helpers, weights, geometry) -> dict:
    import torch
    module = modules[case["module"]]
    torch.manual_seed(0)
    args = heal_args(case)
    model = module.LiftSplatShoot(args)
    recipes = helpers.weight_recipes(model, weights)
    model.load_state_dict(weights.materialize(recipes), strict=True)
    model.eval()
    with torch.no_grad():
        outputs = heal_outputs(model, case, heal_image_inputs(case, weights, geometry),
                               depth_loss)
    outputs = {key: value.clone() for key, value in outputs.items()}
    # gradients through the whole chain (splat backward included), eval mode
    probe = gradient_probe(heal_outputs(model, case, heal_image_inputs(case, weights, geometry),
                                        depth_loss), weights)
    probe.backward()
    named = dict(model.named_parameters())
    gradients = {key: named[key].grad.clone() for key in GRADIENT_KEYS if key in named}
    summary = ", ".join(f"{k} {tuple(v.shape)} max {float(v.float().abs().max()):.3g}"
                        for k, v in outputs.items())
    print(f"{name}: {len(recipes)} tensors; {summary}; gradients of {sorted(gradients)}")
    return {"heal_args": args, "state_dict": recipes, "outputs": outputs, "gradients": gradients}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heal", type=Path, required=True, help="HEAL's sources (has opencood/)")
    parser.add_argument("--commit", required=True, help="HEAL commit the sources are from")
    parser.add_argument("--out", type=Path, required=True, help="tests/fixtures/parity")
    options = parser.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    weights = load_by_path("parity_weights", REPO_ROOT / "tests" / "parity_weights.py")
    helpers = load_by_path("model_parity", REPO_ROOT / "tools" / "reference" /
                           "make_model_parity_fixtures.py")
    modules, camera_utils, depth_loss = import_heal(options.heal)
    geometry = make_geometry(camera_utils)
    fixture = {"format": 1, "about": ABOUT.format(commit=options.commit),
               "reference": f"HEAL {options.commit}", "torch": str(torch.__version__),
               "inputs": {"recipes": image_recipes(), **geometry},
               "cases": {name: run_case(name, case, modules, depth_loss, helpers, weights,
                                        geometry)
                         for name, case in CASES.items()}}
    options.out.mkdir(parents=True, exist_ok=True)
    path = options.out / "lift_splat.pt"
    torch.save(fixture, path)
    print(f"stubbed: {', '.join(sorted(set(STUBBED)))}")
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
