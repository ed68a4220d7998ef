"""tools/bench.py, the benchmark suite: its JSON figures, presets, figure selection and errors.

The model's size is checked against counts derived by hand from the config's widths (below),
which are first shown to agree exactly with what the bench's ``profile`` figure measures on the
small configs, then evaluated at the OPV2V geometry (a full-size forward on CPU takes tens of
seconds; the measured version of that check is marked slow).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opv2v_factory import write_simple_split
from tool_modules import load_tool, run_script

REPO_ROOT = Path(__file__).resolve().parents[1]
TOOLS = REPO_ROOT / "tools"
OPV2V_YAML = REPO_ROOT / "hypes_yaml" / "opv2v" / "point_pillar_attfuse.yaml"
SMOKE_YAML = REPO_ROOT / "hypes_yaml" / "synthetic" / "smoke.yaml"
SYNTHETIC_YAML = REPO_ROOT / "hypes_yaml" / "synthetic" / "point_pillar_attfuse.yaml"

BENCH_FIGURES = {"pillarise", "targets", "profile", "train_step_model_only",
                 "train_step_no_pillarise", "peak_gpu_memory", "ema_update",
                 "eval_postprocess_per_frame", "eval_inference_per_frame", "dataloader",
                 "dataloader_by_fusion", "train_step_end_to_end", "bev_iou", "ap",
                 "visibility_count", "pcd", "host_syncs_per_step", "pose_graph_solve_ms",
                 "loader_cpu_ms", "loader_by_format", "operators_per_step", "camera_loader_ms",
                 "lss_forward_backward_ms"}
DATA_FIGURES = {"dataloader", "dataloader_by_fusion", "train_step_end_to_end", "loader_cpu_ms"}
# Figures timing ours against a reference on the same input.
RATIO_FIGURES = {"pillarise", "targets", "bev_iou", "ap", "visibility_count"}

# docs/DESIGN.md §3: one training step of the OPV2V AttFuse model (704 x 200, batch 2, 3 CAVs).
OPV2V_TRAIN_FLOPS = 0.88e12
OPV2V_PARAMS = 6_585_876  # hand-derived below (6.586 M)


def parse_json_lines(text: str) -> list:
    lines = text.splitlines()
    assert lines, "no output on stdout"
    records = []
    for line in lines:
        record = json.loads(line)      # every stdout line is one JSON object
        assert isinstance(record, dict) and "figure" in record, line
        records.append(record)
    return records


# ----------------------------------------------------------------------------------------------
# Hand-derived model size (PointPillars + BaseBEVBackbone + anchor head, AttFuse)
# ----------------------------------------------------------------------------------------------

def hand_model_counts(cfg: dict, batch: int, agents: int, pillars: int,
                      points_per_pillar: int) -> tuple:
    """(parameters, forward FLOPs) of the AttFuse PointPillars model, counted as
    FlopCounterMode does: 2 per multiply-add of linear/conv layers (norms, activations, the
    parameter-free attention and scatters are not counted).

    VFE: one Linear(10 -> C, no bias) + BN on every real point. Backbone per agent: scale i has
    a stride-s_i 3x3 conv c_{i-1} -> c_i and n_i 3x3 convs c_i -> c_i (no bias, + BN), at
    ceil(H / prod s) x ceil(W / prod s). AttFuse fuses each scale to one map per sample, so the
    up blocks (transposed conv, kernel = stride = u_i, + BN) and the head (three 1x1 convs with
    bias: A scores, 7A residuals, 2A direction bins) run once per sample.
    """
    args = cfg["model"]["args"]
    (vfe_channels,) = args["pillar_vfe"]["num_filters"]
    backbone = args["base_bev_backbone"]
    lidar_range = cfg["preprocess"]["cav_lidar_range"]
    voxel = cfg["preprocess"]["args"]["voxel_size"]
    nx = round((lidar_range[3] - lidar_range[0]) / voxel[0])
    ny = round((lidar_range[4] - lidar_range[1]) / voxel[1])
    max_points = cfg["preprocess"]["args"]["max_points_per_voxel"]
    num_anchors = len(cfg["postprocess"]["anchor_args"]["r"])
    point_channels = 4 + 6
    num_agents = batch * agents

    params = point_channels * vfe_channels + 2 * vfe_channels
    points = num_agents * min(pillars, nx * ny) * min(points_per_pillar, max_points)
    flops = 2 * points * point_channels * vfe_channels

    channels_in, height, width = args["point_pillar_scatter"]["num_features"], ny, nx
    for convs, stride, channels, up_stride, up_channels in zip(
            backbone["layer_nums"], backbone["layer_strides"], backbone["num_filters"],
            backbone["upsample_strides"], backbone["num_upsample_filter"]):
        height, width = math.ceil(height / stride), math.ceil(width / stride)
        down_macs = 9 * channels_in * channels + convs * 9 * channels * channels
        params += down_macs + (1 + convs) * 2 * channels
        flops += num_agents * 2 * height * width * down_macs
        up_macs = channels * up_channels * up_stride * up_stride
        params += up_macs + 2 * up_channels
        flops += batch * 2 * height * width * up_macs
        channels_in = channels
    head_in = sum(backbone["num_upsample_filter"])
    head_out = num_anchors * (1 + 7 + 2)
    params += head_in * head_out + head_out
    flops += batch * 2 * (ny // 2) * (nx // 2) * head_in * head_out
    return params, flops


def profile_record(yaml_path: Path, preset: str, *extra: str) -> dict:
    bench = load_tool("bench")
    (record,) = bench.main(["--figures", "profile", "--preset", preset, "--device", "cpu",
                            "--hypes_yaml", str(yaml_path), *extra])
    return record


@pytest.mark.parametrize("yaml_path,pillars", [(SMOKE_YAML, 300), (SYNTHETIC_YAML, 2000)])
def test_profile_figure_matches_hand_counts(yaml_path, pillars, capsys):
    from opencood.config import load_config
    record = profile_record(yaml_path, "quick", "--pillars", str(pillars))
    params, hand_flops = hand_model_counts(load_config(yaml_path), batch=2, agents=3,
                                           pillars=pillars, points_per_pillar=6)
    assert record["parameters"] == record["trainable_parameters"] == params
    assert record["forward_flops"] == hand_flops
    assert record["train_step_tflops_approx"] == round(3 * hand_flops / 1e12, 4)
    assert parse_json_lines(capsys.readouterr().out) == [record]


def test_opv2v_attfuse_size_matches_design():
    """docs/DESIGN.md §3: 6.586 M parameters and 0.88 TFLOP per training step (3 x forward)."""
    from opencood.config import load_config
    from opencood.models.build import build_model
    from opencood.utils.model_stats import count_parameters
    cfg = load_config(OPV2V_YAML)
    params, flops = hand_model_counts(cfg, batch=2, agents=3, pillars=16000,
                                      points_per_pillar=6)
    assert params == OPV2V_PARAMS
    assert count_parameters(build_model(cfg["model"])) == (OPV2V_PARAMS, OPV2V_PARAMS)
    assert f"{params / 1e6:.3f}" == "6.586"
    assert abs(3 * flops - OPV2V_TRAIN_FLOPS) <= 0.10 * OPV2V_TRAIN_FLOPS, 3 * flops


@pytest.mark.slow
def test_profile_figure_opv2v_full_geometry():
    """The measured version of the check above: a full-size forward on CPU (tens of seconds)."""
    from opencood.config import load_config
    record = profile_record(OPV2V_YAML, "opv2v")
    assert record["parameters"] == OPV2V_PARAMS
    flops = record["forward_flops"]
    assert abs(3 * flops - OPV2V_TRAIN_FLOPS) <= 0.10 * OPV2V_TRAIN_FLOPS, 3 * flops
    assert flops == hand_model_counts(load_config(OPV2V_YAML), batch=2, agents=3,
                                      pillars=16000, points_per_pillar=6)[1]
    assert record["grid"] == "704x200" and record["pillars_per_agent"] == 16000


# ----------------------------------------------------------------------------------------------
# tools/bench.py
# ----------------------------------------------------------------------------------------------

def check_figure(record: dict) -> None:
    if "skipped" in record:
        assert record["skipped"]
        return
    assert "error" not in record, record
    assert record["device"] == "cpu"
    if record["figure"] in ("peak_gpu_memory", "profile", "pcd", "dataloader_by_fusion",
                            "host_syncs_per_step", "loader_cpu_ms", "loader_by_format",
                            "operators_per_step"):
        return
    assert record["ms"] > 0, record
    if record["figure"] in RATIO_FIGURES:
        # the ratio is of the two times printed beside it, measured in this run
        assert record["reference_ms"] > 0, record
        assert record["speedup"] == pytest.approx(record["reference_ms"] / record["ms"],
                                                  rel=0.05, abs=0.1), record
    if record["figure"] in ("bev_iou", "ap", "visibility_count", "pose_graph_solve_ms",
                            "camera_loader_ms", "lss_forward_backward_ms"):
        return
    for key in ("batch_per_gpu", "agents", "amp", "grid"):
        assert key in record, (key, record)
    if record["figure"] != "dataloader":
        assert record["pillars_per_agent"] > 0, record


@pytest.fixture
def run_bench(tmp_path, monkeypatch, capsys):
    """``run_bench(*argv)``: ``python tools/bench.py argv...`` from the checkout with its own
    cache, as a fresh interpreter runs it, in this process (tool_modules.run_script)."""
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setenv("OPENCOOD_CACHE", str(tmp_path / "cache"))
    return lambda *argv: run_script(TOOLS / "bench.py", argv, monkeypatch, capsys)


def test_bench_quick_cpu_prints_only_json_lines(run_bench):
    result = run_bench("--quick", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    records = parse_json_lines(result.stdout)
    by_name = {record["figure"]: record for record in records}
    assert len(by_name) == len(records), "a figure was printed twice"
    assert set(by_name) == BENCH_FIGURES
    for record in records:
        check_figure(record)
    for name in DATA_FIGURES:
        assert "--data" in by_name[name]["skipped"]
    assert "CUDA" in by_name["peak_gpu_memory"]["skipped"]
    step = by_name["train_step_model_only"]
    assert {"pillarise", "targets", "forward", "backward", "optimizer_step"} <= set(
        step["includes"])
    assert not {"pillarise", "targets"} & set(by_name["train_step_no_pillarise"]["includes"])
    assert step["grid"] == "64x32" and step["batch_per_gpu"] == 2 and step["agents"] == 3
    assert step["amp"] == "off" and step["preset"] == "quick"
    assert 0 < by_name["ema_update"]["share_of_step_pct"] < 100
    post = by_name["eval_postprocess_per_frame"]
    # The synthetic head maps decode to boxes on the GT: NMS keeps about one per object.
    assert post["ap_50"] > 0.9
    assert post["ms"] == pytest.approx(post["decode_nms_ms"] + post["ap_ms"], abs=2e-3)
    # the fake batch: 2 samples x 3 agents x 300 pillars x 6 points, 5 GT per sample
    assert by_name["pillarise"]["points"] == 2 * 3 * 300 * 6
    assert by_name["pillarise"]["pillars"] == 2 * 3 * 300
    assert by_name["targets"]["gt_boxes"] == 10
    assert by_name["ap"]["frames"] == 4 and by_name["ap"]["detection_gt_pairs"] == 4 * 50 * 30
    methods = by_name["pcd"]["methods"]
    assert set(methods) == {"loadtxt", "read_pcd_ascii", "read_pcd_general_ascii",
                            "read_pcd_binary", "cache_miss", "cache_hit"}
    assert methods["loadtxt"]["speedup_vs_loadtxt"] == 1.0
    assert by_name["profile"]["parameters"] > 0
    formats = by_name["loader_by_format"]["formats"]
    assert set(formats) == {"opv2v", "v2v4real", "dairv2x", "v2xreal"}
    for figures in formats.values():      # tiny: 3 splits x 1 scenario x 3 frames
        for path in ("reader", "dataset"):
            assert figures[path]["samples"] == 9 and figures[path]["samples_per_s"] > 0
    assert step["static_pillars"] == 0 and not step["sync_free_step"] and not step["compile"]
    # the camera path: quick writes the tiny test split's 1 frame with cameras (3 agents of 4
    # cameras, one sample) and runs camera_small's encoder on 2 x 3 agents
    cameras = by_name["camera_loader_ms"]
    assert (cameras["agent_frames"], cameras["samples"], cameras["cameras_per_agent"]) == (3, 1, 4)
    assert cameras["read_ms"] > 0 and cameras["augment_ms"] > 0
    assert cameras["image_size"] == [800, 600] and cameras["final_dim"] == [32, 256]
    lss = by_name["lss_forward_backward_ms"]
    assert (lss["agents"], lss["cameras"], lss["image_size"]) == (6, 4, [32, 256])
    assert lss["grid"] == "128x64x1" and lss["depth_bins"] == 24 and lss["forward_ms"] > 0
    syncs = by_name["host_syncs_per_step"]
    assert syncs["syncs"] == sum(syncs["by_kind"].values()) and syncs["by_kind"]["unique"] >= 1
    count = len(BENCH_FIGURES)
    plan = [line for line in result.stderr.splitlines()
            if f"bench plan: {count} of {count}" in line]
    assert len(plan) == 1 and "preset quick" in plan[0], result.stderr
    assert result.stderr.index("bench plan:") < result.stderr.index("measuring")   # said first


def test_bench_on_cpu_defaults_to_the_lite_preset_and_says_so(run_bench):
    result = run_bench("--device", "cpu", "--figures", "visibility_count")
    assert result.returncode == 0, result.stderr
    (record,) = parse_json_lines(result.stdout)
    assert record["figure"] == "visibility_count" and record["preset"] == "lite"
    assert record["points"] == 105_000 and record["boxes"] == 60
    plan = next(line for line in result.stderr.splitlines() if "bench plan: 1 of" in line)
    assert "(visibility_count)" in plan and "preset lite" in plan and "--preset opv2v" in plan
    assert " s on a 2-core CPU" in plan                       # the estimate


def test_bench_figures_selects_and_keeps_measuring_order(capsys):
    bench = load_tool("bench")
    records = bench.main(["--quick", "--device", "cpu", "--figures", "pcd, ap"])
    assert [record["figure"] for record in records] == ["ap", "pcd"]
    assert parse_json_lines(capsys.readouterr().out) == json.loads(json.dumps(records))


def test_bench_fast_step_flags_set_the_performance_keys_and_leave_one_host_read(capsys):
    bench = load_tool("bench")
    records = bench.main(["--quick", "--device", "cpu", "--figures",
                          "pillarise,host_syncs_per_step", "--static_pillars", "320",
                          "--sync_free", "--cuda_graph"])
    by_name = {record["figure"]: record for record in records}
    syncs = by_name["host_syncs_per_step"]
    assert (syncs["static_pillars"], syncs["sync_free_step"], syncs["compile"]) == (320, True,
                                                                                   False)
    assert syncs["syncs"] == 1 and syncs["by_kind"] == {"tolist": 1}
    assert syncs["cuda_graph"] is True           # stated; on CPU the step runs eagerly
    assert by_name["pillarise"]["pillars"] == 2 * 3 * 300       # real pillars, not slots


def test_bench_operators_per_step_by_phase(capsys):
    bench = load_tool("bench")
    (record,) = bench.main(["--quick", "--device", "cpu", "--figures", "operators_per_step"])
    phases = record["by_phase"]
    assert list(phases) == ["pillarise_targets", "forward_loss", "backward_clip", "optimizer",
                            "after_step_ema"]
    assert record["kernels"] == sum(phases.values()) < record["operators"]
    assert phases["after_step_ema"] == 2                 # ModelEMA.update: lerp + copy
    assert min(phases.values()) > 0
    # CPU keeps torch's per-tensor loop (no fused default off CUDA): ~9 kernels per parameter
    assert record["optimizer"] == "AdamW (for-loop)" and phases["optimizer"] > 100
    # ...which the CUDA-comparable count replaces by the fused step's (the step counters' add
    # and one fused kernel)
    fused = record["kernels_with_fused_optimizer"] - (record["kernels"] - phases["optimizer"])
    assert 1 <= fused <= 3


def test_bench_keeps_the_frozen_parts_batchnorms_in_eval_as_the_trainer(monkeypatch, capsys):
    """``train_params.fix_modules``: after building the parts and after each figure that
    switches to eval (profile, eval inference), the bench's train mode is the trainer's
    (opencood.engine.freeze.train_keeping_frozen), not a plain ``model.train()``."""
    bench = load_tool("bench")
    modes, record = {}, bench.ModelBench.record

    def record_modes(self, figure, **values):      # the BatchNorms' modes as each figure ends
        modes[figure] = {name: module.training for name, module in
                         self.parts.model_without_ddp.named_modules()
                         if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)}
        return record(self, figure, **values)

    monkeypatch.setattr(bench.ModelBench, "record", record_modes)
    bench.main(["--quick", "--device", "cpu", "--steps", "1", "--figures",
                "pillarise,profile,eval_inference_per_frame",
                "--set", "train_params.fix_modules=[backbone]"])
    assert list(modes) == ["pillarise", "profile", "eval_inference_per_frame"]
    for figure, training in modes.items():
        frozen = [name for name in training if name.startswith("backbone.")]
        assert frozen and len(frozen) < len(training), figure
        assert training == {name: name not in frozen for name in training}, figure


def test_bench_list_names_every_figure_and_measures_nothing(capsys):
    bench = load_tool("bench")
    assert bench.main(["--list"]) == []
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert sorted(listed) == sorted(BENCH_FIGURES)
    # listed in the order a run measures them
    assert listed == [name for group in bench.GROUPS for name in group.figures]


def test_bench_ratios_time_the_references_the_tests_check(monkeypatch, capsys):
    """The ratio is against opencood.testing.reference_impls, the definition the tests prove
    our code equal to (not a copy in the bench): one reference call per box pair."""
    from opencood.testing import reference_impls
    pairs, real_reference = [], reference_impls.reference_bev_iou

    def counted(box_a, box_b):
        pairs.append(1)
        return real_reference(box_a, box_b)

    monkeypatch.setattr(reference_impls, "reference_bev_iou", counted)
    bench = load_tool("bench")
    (record,) = bench.main(["--quick", "--device", "cpu", "--figures", "bev_iou"])
    assert record["ms"] > 0 and record["reference_ms"] > 0 and record["speedup"] > 0
    assert len(pairs) == record["pairs"]


def test_bench_with_a_data_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OPENCOOD_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "opv2v"
    write_simple_split(root / "train", num_cavs=3,
                       timestamps=("000000", "000002", "000004", "000006"))
    bench = load_tool("bench")
    records = bench.main(["--quick", "--device", "cpu", "--steps", "1", "--warmup", "1",
                          "--data", str(root), "--num_workers", "0",
                          "--figures", ",".join(DATA_FIGURES)])
    printed = parse_json_lines(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(records))
    by_name = {record["figure"]: record for record in records}
    assert set(by_name) == DATA_FIGURES
    for record in records:
        check_figure(record)
    loader = by_name["dataloader"]
    assert loader["samples_per_s"] > 0 and loader["num_workers"] == 0
    assert loader["dataset_samples"] == 4 and loader["agents"] == 3
    by_fusion = by_name["dataloader_by_fusion"]["samples_per_s"]
    assert set(by_fusion) == {"no", "early", "late", "late_box_align", "intermediate"}
    assert all(rate > 0 for rate in by_fusion.values())
    cpu = by_name["loader_cpu_ms"]             # issue 28: per strategy, ours vs the old path
    assert set(cpu["ms"]) == set(cpu["reference_ms"]) == {"no", "early", "late", "intermediate"}
    assert all(cpu["ms"][name] > 0 and cpu["first_epoch_ms"][name] > 0 for name in cpu["ms"])
    assert cpu["speedup"]["early"] == pytest.approx(
        cpu["reference_ms"]["early"] / cpu["ms"]["early"], rel=0.05, abs=0.1)
    assert cpu["agents_per_sample"]["intermediate"] == 3 and cpu["samples"]["early"] >= 12
    end_to_end = by_name["train_step_end_to_end"]
    assert end_to_end["agents"] == 3           # measured on the real batches
    assert "data_wait" in end_to_end["includes"]
    assert 0 <= end_to_end["data_wait_ms"] <= end_to_end["ms"]


@pytest.mark.parametrize("argv,named", [
    (["--hypes_yaml", "{tmp}/missing.yaml"], "missing.yaml"),
    (["--set", "model.core_method=no_such_model"],
     "model.core_method: unknown model 'no_such_model'"),
    (["--figures", "pillarise,no_such_figure"], "no_such_figure"),
    (["--data", "{tmp}/no_such_folder"], "no_such_folder"),
])
def test_bench_bad_input_is_one_error_line(tmp_path, run_bench, argv, named):
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    result = run_bench("--quick", "--device", "cpu", *argv)
    assert result.returncode != 0
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], lines
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("argv,message", [
    (["--data", "{tmp}"], "no OPV2V frames"),
    (["--steps", "0"], "--steps"),
    (["--warmup", "-1"], "--warmup"),
])
def test_bench_rejects_bad_arguments_before_measuring(tmp_path, capsys, argv, message):
    bench = load_tool("bench")
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    with pytest.raises(SystemExit) as excinfo:
        bench.main(["--quick", "--device", "cpu", *argv])
    text = str(excinfo.value.code)
    assert text.startswith("error: ") and message in text and "\n" not in text
    assert capsys.readouterr().out == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_bench_cuda_without_cuda_is_an_error(capsys):
    bench = load_tool("bench")
    with pytest.raises(SystemExit) as excinfo:
        bench.main(["--quick", "--device", "cuda"])
    assert str(excinfo.value.code).startswith("error: --device cuda")
    assert capsys.readouterr().out == ""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_quick_on_cuda_reports_memory_and_amp(capsys):
    bench = load_tool("bench")
    records = bench.main(["--quick", "--device", "cuda", "--set", "amp.enabled=true",
                          "--set", "amp.dtype=bf16"])
    parse_json_lines(capsys.readouterr().out)
    by_name = {record["figure"]: record for record in records}
    assert set(by_name) == BENCH_FIGURES
    for record in records:
        assert "error" not in record, record
    assert by_name["peak_gpu_memory"]["mib"] > 0
    assert by_name["train_step_model_only"]["device"] == "cuda"
    assert by_name["train_step_model_only"]["amp"] == "bf16"
    assert by_name["pillarise"]["amp"] == "off"
    assert by_name["eval_postprocess_per_frame"]["ap_50"] > 0.9
    for name in RATIO_FIGURES:
        assert by_name[name]["speedup"] > 0, by_name[name]


@pytest.mark.slow
def test_gpu_checks_rehearsal_runs_every_step(tmp_path):
    # QUICK=1 runs the same steps as on a GPU, small and on CPU: the script a short GPU session
    # relies on must not rot unnoticed. A step that fails must fail the script too.
    script = str(REPO_ROOT / "tools" / "gpu_checks.sh")

    def run(data_dir, python_dir=Path(sys.executable).parent):
        # The script runs "python": this interpreter's, whether or not its venv is activated.
        path = os.pathsep.join([str(python_dir), os.environ.get("PATH", "")])
        env = {**os.environ, "QUICK": "1", "OUT": str(tmp_path / "out"), "DATA": str(data_dir),
               "PYTHONPATH": str(REPO_ROOT), "PATH": path}
        return subprocess.run(["bash", script], env=env, capture_output=True, text=True,
                              timeout=300)

    done = run(tmp_path / "data")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("\nok ") == 5 and "FAILED" not in done.stdout
    copies = (tmp_path / "out" / "prefetch_copies.txt").read_text()
    assert "2/5 tests collected" in copies or "2 tests collected" in copies, copies
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in summary] == ["bench.jsonl", "bench_fast.jsonl"]
    assert "kernels/step" in summary[1] and "Traceback" not in "".join(summary)
    assert (tmp_path / "out" / "gpu_checks.tar.gz").stat().st_size > 0
    records = parse_json_lines((tmp_path / "out" / "bench.jsonl").read_text())
    assert {record["figure"] for record in records} == BENCH_FIGURES
    measured = {record["figure"] for record in records if "ms" in record or "methods" in record}
    assert {"pillarise", "train_step_model_only", "dataloader", "ap", "pcd"} <= measured
    collected = (tmp_path / "out" / "pytest_cuda.txt").read_text()
    assert int(collected.split(" tests collected")[0].split()[-1].split("/")[0]) >= 1
    # One real failure among passing steps: the generator, for real, on a path it cannot
    # write; every other "python" call a stand-in that passes at once (the steps above showed
    # they work; here only the script's verdict is under test).
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("the generator cannot write here")
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "python").write_text(
        '#!/usr/bin/env bash\n'
        f'case " $* " in *generate_synthetic.py*) exec "{sys.executable}" "$@" ;; esac\n')
    (shim / "python").chmod(0o755)
    broken = run(blocker, python_dir=shim)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    verdicts = [line.split("  ")[0] for line in broken.stdout.splitlines()
                if line.startswith(("ok ", "FAILED "))]
    assert verdicts == ["ok", "FAILED", "ok", "ok", "ok"], broken.stdout
    assert "FAILED  synthetic opv2v data" in broken.stdout
