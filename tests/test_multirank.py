"""Multi-rank correctness of training and evaluation (issue 17, DESIGN §6.4, 6.6, 6.10, §7).

Real ``torch.distributed`` ranks (gloo, CPU, spawned by dist_helpers) running the real trainer and
evaluator on tiny OPV2V-format data. Each spawn imports torch (seconds), so every check that can
share a session does.
"""
from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dist_helpers import free_port, run_on_ranks
from opv2v_factory import write_simple_split
from opencood.engine import trainer

REPO_ROOT = Path(__file__).resolve().parents[1]
SMOKE_YAML = REPO_ROOT / "hypes_yaml" / "synthetic" / "smoke.yaml"


def _stamps(count):
    return tuple(f"{2 * i:06d}" for i in range(count))


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    """train4 (2 steps of global batch 2) and validate5, whose middle frame has no vehicle."""
    root = tmp_path_factory.mktemp("multirank")
    write_simple_split(root / "train4", num_cavs=2, timestamps=_stamps(4))
    validate = _stamps(5)
    write_simple_split(root / "validate5", num_cavs=2, timestamps=validate,
                       no_vehicles_at=validate[2])
    return root


def _data_args(root: Path, validate: str | None = "validate5"):
    return ["--set", f"root_dir={root / 'train4'}",
            "--set", f"validate_dir={root / validate}" if validate else "validate_dir=null",
            "--set", f"test_dir={root / 'validate5'}"]


def _run_trainer_on_rank(rank, world_size, port, argv) -> dict:
    """trainer.main as torchrun would start it on ``rank``: {"result"} or {"error"}."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        return {"result": trainer.main(argv)}
    except SystemExit as error:
        return {"error": str(error.code)}
    except BaseException:  # reported by the test
        return {"error": traceback.format_exc()}


# ----------------------------------------------------------------------------------------------
# 1. every rank enters the same collectives, in the same order
# ----------------------------------------------------------------------------------------------

# The torch.distributed entry points library code calls (DDP's start-up checks included). Calls
# made inside torch.distributed itself bypass these names, so each call is recorded once.
SPIED_COLLECTIVES = ("broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "gather",
                     "scatter", "reduce", "reduce_scatter", "barrier", "broadcast_object_list",
                     "all_gather_object", "gather_object", "_broadcast_coalesced",
                     "_verify_params_across_processes")


def _tensor_shapes(args) -> tuple:
    """Shapes of the tensor arguments (a list of tensors counts as its length)."""
    shapes = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            shapes.append(tuple(arg.shape))
        elif isinstance(arg, (list, tuple)) and arg and isinstance(arg[0], torch.Tensor):
            shapes.append(("tensors", len(arg)))
    return tuple(shapes)


def _spy_on_collectives(calls: list) -> None:
    """Record (name, tensor shapes) of every collective this process enters, in order."""
    for name in SPIED_COLLECTIVES:
        real = getattr(dist, name)

        def spy(*args, _name=name, _real=real, **kwargs):
            calls.append((_name, _tensor_shapes(args)))
            return _real(*args, **kwargs)

        setattr(dist, name, spy)


def _sync_batchnorm_on_cpu(self, input):
    """Stand-in for torch's SyncBatchNorm forward on CPU (torch's refuses non-GPU input): the same
    decision as torch's (communicate in training mode with a world > 1) and the same collective,
    an all_gather of each rank's (mean, invstd, count), then plain batch norm."""
    if self.training and dist.is_initialized() and dist.get_world_size() > 1:
        stats = torch.zeros(2 * input.shape[1] + 1)
        dist.all_gather([torch.empty_like(stats) for _ in range(dist.get_world_size())], stats)
    return torch.nn.modules.batchnorm._BatchNorm.forward(self, input)


def _collective_order_on_rank(rank, world_size, port, argv):
    """The trainer with SyncBN forced on CPU, recording its collectives up to the end."""
    trainer.use_sync_batchnorm = lambda info: info.world_size > 1
    torch.nn.SyncBatchNorm.forward = _sync_batchnorm_on_cpu
    # DDP refuses SyncBatchNorm in a CPU module; the stand-in runs on CPU.
    DistributedDataParallel._passing_sync_batchnorm_handle = lambda self, module: None
    calls, sync_bn_layers = [], []
    real_prepare, real_step = trainer.prepare_model, trainer.optimizer_step

    def prepare_spy(*args):
        model, bare, ema = real_prepare(*args)
        sync_bn_layers.append(sum(isinstance(m, torch.nn.SyncBatchNorm) for m in bare.modules()))
        return model, bare, ema

    def step_marker(*args, **kwargs):
        calls.append(("optimizer_step", ()))
        return real_step(*args, **kwargs)

    trainer.prepare_model, trainer.optimizer_step = prepare_spy, step_marker
    _spy_on_collectives(calls)
    outcome = _run_trainer_on_rank(rank, world_size, port, argv)
    return dict(outcome, calls=calls, sync_bn_layers=sync_bn_layers)


def test_every_rank_enters_the_same_collectives_in_the_same_order(data_root, tmp_path):
    """From start-up (model summary included) through the first steps and validation, both
    ranks make the same collective calls with the same shapes: a call one rank makes alone is a
    hang on GPUs. SyncBN is forced on CPU with a stand-in that communicates as torch's does."""
    run_dir = tmp_path / "run"
    argv = ["--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(run_dir),
            "--set", "train_params.epoches=1", "--set", "train_params.max_micro_batch=1",
            # a mismatch fails in seconds rather than after the default 30 minutes
            "--set", "distributed.timeout_minutes=0.25", *_data_args(data_root)]
    ranks = run_on_ranks(_collective_order_on_rank, world_size=2, init_group=False,
                         timeout_s=120, args=(free_port(), argv))
    calls = [rank["calls"] for rank in ranks]
    diverge = next((i for i, (a, b) in enumerate(zip(*calls)) if a != b), None)
    assert diverge is None and len(calls[0]) == len(calls[1]), (
        f"ranks diverge at collective {diverge}: rank 0 {calls[0][:(diverge or 0) + 2]}, "
        f"rank 1 {calls[1][:(diverge or 0) + 2]}; outcomes "
        f"{[rank.get('error', 'ok')[-300:] for rank in ranks]}")
    for rank, outcome in enumerate(ranks):
        assert "result" in outcome, f"rank {rank}: {outcome['error']}"
        assert outcome["result"]["step"] == 2
        assert outcome["sync_bn_layers"][0] > 0  # the SyncBN path really ran
    names = [name for name, _ in calls[0]]
    first_step = names.index("optimizer_step")
    # Not vacuous: DDP's start-up checks precede the first step, SyncBN communicated in it.
    assert "_verify_params_across_processes" in names[:first_step]
    assert "all_gather" in names[first_step:]
    assert "model: " in (run_dir / "train.log").read_text()  # the summary still runs
