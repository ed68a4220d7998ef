"""tools/fingerprint.py: deterministic per-yaml hashes, and a comparison that names what moved."""
import torch

from opencood.config import load_config
from tests.tool_modules import load_tool

SMOKE = "hypes_yaml/synthetic/smoke.yaml"


def test_a_config_fingerprints_alike_twice_and_a_weight_change_shows():
    tool = load_tool("fingerprint")
    cfg = load_config(SMOKE)
    first, second = tool.model_fingerprint(cfg), tool.model_fingerprint(cfg)
    assert first == second and len(first) > 50
    real_build = tool.build_model

    def nudged(config):
        model = real_build(config)
        with torch.no_grad():
            model.head.cls_conv.bias.add_(1e-6)
        return model

    tool.build_model = nudged
    try:
        moved = tool.model_fingerprint(cfg)
    finally:
        tool.build_model = real_build
    changed = {key for key in first if first[key] != moved.get(key)}
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
