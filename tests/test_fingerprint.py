"""tools/fingerprint.py: deterministic per-yaml hashes, and a comparison that names what moved."""
import torch

from opencood.config import load_config
from tests.tool_modules import load_tool

SMOKE = "hypes_yaml/synthetic/smoke.yaml"


def keys_moved_by_nudge(tool, cfg, first: dict, parameter: str) -> set:
    """The fingerprint keys of ``cfg`` that change when ``parameter`` of the built model is
    raised by 1e-6 (tool.build_model patched for one fingerprint, then put back)."""
    real_build = tool.build_model

    def nudged(config):
        model = real_build(config)
        with torch.no_grad():
            model.get_parameter(parameter).add_(1e-6)
        return model

    tool.build_model = nudged
    try:
        moved = tool.model_fingerprint(cfg)
    finally:
        tool.build_model = real_build
    return {key for key in first if first[key] != moved.get(key)}


def test_a_config_fingerprints_alike_twice_and_a_weight_change_shows():
    tool = load_tool("fingerprint")
    cfg = load_config(SMOKE)
    first, second = tool.model_fingerprint(cfg), tool.model_fingerprint(cfg)
    assert first == second and len(first) > 50
    changed = keys_moved_by_nudge(tool, cfg, first, "head.cls_conv.bias")
    assert "init.head.cls_conv.bias" in changed and "loss.cls_loss" in changed
    assert "init.backbone.blocks.0.1.weight" not in changed


def test_compare_renames_moved_parameters_and_names_differences(capsys):
    tool = load_tool("fingerprint")
    before = {"a.yaml": {"init.vfe.layers.0.w": "1", "ap": "x"}}
    after = {"a.yaml": {"init.encoder.vfe.layers.0.w": "1", "ap": "x"}}
    assert tool.compare(before, after, ["vfe.=encoder.vfe."]) == 0
    assert tool.compare(before, after) == 1
    assert "2 of 2 entries differ" in capsys.readouterr().out
    assert tool.compare(before, {"a.yaml": {"init.encoder.vfe.layers.0.w": "2", "ap": "x"}},
                        ["vfe.=encoder.vfe."]) == 1


HETER = "hypes_yaml/synthetic/heter_pyramid_collab.yaml"
CAMERA_BIAS = "branches.m2.encoder.camera_encoder.image_head.bias"


def test_a_heterogeneous_config_fingerprints_alike_twice_and_a_camera_weight_shows():
    """HEAL's pyramid on a fake batch of LiDAR (m1, m3) and camera (m2) agents: deterministic,
    and a 1e-6 change of the camera encoder's image feature bias reaches every gradient and
    the outputs (the images take part) while the LiDAR branches' weights stay as they were."""
    tool = load_tool("fingerprint")
    cfg = load_config(HETER)
    first, second = tool.model_fingerprint(cfg), tool.model_fingerprint(cfg)
    assert "error" not in first and first == second
    assert any(key.startswith("grad.branches.m2.encoder") for key in first)
    assert any(key.startswith("grad.branches.m3.encoder") for key in first)
    changed = keys_moved_by_nudge(tool, cfg, first, CAMERA_BIAS)
    # (tensors, not the loss scalars: a 1e-6 change of a sum can round away)
    assert {f"init.{CAMERA_BIAS}", "grad.head.cls_conv.weight", "grad.branches.m1.encoder."
            "vfe.layers.0.linear.weight", "eval_outputs.cls_preds"} <= changed
    assert not any(key.startswith(("init.branches.m1.", "init.branches.m3.")) for key in changed)


def test_the_fake_heterogeneous_batch_puts_each_agent_on_its_modality():
    """m1 LiDAR on the top grid, m2 cameras, m3 LiDAR on its own 16 x 8 m grid of 2 m cells:
    2 samples of 3 agents are m1 m1 m2 | m3 m3 m1 (egos from m1&m3, the others in turn)."""
    from opencood import batch_keys
    from opencood.utils.fake_batch import fake_collated_batch
    own_range = [-8.0, -4.0, -3.0, 8.0, 4.0, 1.0]
    heter = {"ego_modality": "m1&m3", "modality_setting": {
        "m1": {"sensor_type": "lidar", "preprocess": None},
        "m2": {"sensor_type": "camera", "preprocess": None,
               "data_aug_conf": {"H": 600, "W": 800, "final_dim": [24, 32]}},
        "m3": {"sensor_type": "lidar", "data_aug_conf": None,
               "preprocess": {"cav_lidar_range": own_range, "args": {"voxel_size": [2, 2, 4]}}}}}
    top = {"cav_lidar_range": [-48.0, -24.0, -3.0, 48.0, 24.0, 1.0],
           "args": {"voxel_size": [0.8, 0.8, 4.0]}}
    batch = fake_collated_batch(top, batch_size=2, agents_per_sample=3, pillars_per_agent=10,
                                points_per_pillar=2, max_gt=3, heter=heter, depth=True)
    batch_keys.check_keys("batch", batch, "fake_collated_batch")
    assert batch["agent_modality"] == ["m1", "m1", "m2", "m3", "m3", "m1"]
    counts = torch.bincount(batch["agent_index"], minlength=6)
    assert counts.tolist() == [20, 20, 0, 20, 20, 20]            # the camera agent sends none
    for agent in (3, 4):                     # m3: 10 of its own 8 x 4 cells, 2 points each
        points = batch["points"][batch["agent_index"] == agent]
        assert (points[:, 0].abs() < 8).all() and (points[:, 1].abs() < 4).all()
        cells = torch.floor((points[:, :2] - torch.tensor([-8.0, -4.0])) / 2).unique(dim=0)
        assert cells.shape[0] == 10
    far = batch["points"][batch["agent_index"] == 0][:, :2].abs()
    assert (far[:, 0] > 8).any()             # m1 spreads over the 96 x 48 m grid
    (group,) = batch["modality_cameras"].values()
    assert list(batch["modality_cameras"]) == ["m2"]
    assert group["images"].shape == (1, 4, 3, 24, 32) and group["depth_maps"].shape == (1, 4, 24, 32)
    assert torch.equal(batch["agent_gt_boxes"], batch["gt_boxes"].repeat_interleave(3, dim=0))
    single = fake_collated_batch(top, batch_size=3, single_agent=True, pillars_per_agent=10,
                                 heter=heter)
    assert single["agent_modality"] == ["m1", "m2", "m3"] and "agent_gt_boxes" not in single
