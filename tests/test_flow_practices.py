"""Each practice of the training flow (tools/train.py, docs/DESIGN.md §6) pinned through the flow
itself: a test here fails when the practice is removed or weakened in the flow, not only in its
helper.

* a new shuffle every epoch: ``train_sampler.set_epoch(epoch)`` on a shuffling sampler;
* validation (and best.pth) on the EMA's weights when the EMA is enabled;
* Xavier initialisation of the model the flow trains;
* the process-group timeout reaches ``init_process_group`` (a missing peer ends the job).
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from dist_helpers import free_port, run_on_ranks
from opv2v_factory import frame_stamps, write_simple_split
from process_state import preserved_opencood_logger, preserved_torch_switches
from opencood.config import load_config
from opencood.data.pipeline import BatchPreparer
from opencood.engine import recipe, trainer
from opencood.engine.hooks import TrainHooks
from opencood.engine.task import DetectionTask
from opencood.losses import build_loss
from opencood.models.build import build_model
from opencood.strategies import choose_strategy
from opencood.utils.checkpoint import load_checkpoint
from opencood.utils.dist import DistInfo
from opencood.utils.init import init_weights

REPO_ROOT = Path(__file__).resolve().parents[1]
SMOKE_YAML = REPO_ROOT / "hypes_yaml" / "synthetic" / "smoke.yaml"
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _restore_process_state(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with preserved_torch_switches(), preserved_opencood_logger():
        yield


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    """train8 (4 steps of batch 2), validate3."""
    root = tmp_path_factory.mktemp("practices")
    for split, count in (("train8", 8), ("validate3", 3)):
        write_simple_split(root / split, num_cavs=2,
                           timestamps=frame_stamps(count))
    return root


def run_args(root: Path, run_dir: Path, *settings: str, validate: bool = False) -> list:
    args = ["--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(run_dir),
            "--set", f"root_dir={root / 'train8'}",
            "--set", f"validate_dir={root / 'validate3'}" if validate else "validate_dir=null",
            "--set", "test_dir=null"]
    for setting in settings:
        args += ["--set", setting]
    return args


class RecordingDataset:
    """The training split, recording (epoch, index) of every sample the loader asks for."""

    def __init__(self, dataset, reads: list):
        self.dataset, self.reads, self.epoch = dataset, reads, None

    def __len__(self):
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.dataset.set_epoch(epoch)

    def __getitem__(self, index):
        self.reads.append((self.epoch, index))
        return self.dataset[index]

    def __getattr__(self, name):
        return getattr(self.dataset, name)


def test_every_epoch_reads_its_own_shuffle_of_the_training_split(data_root, tmp_path):
    """Epoch e reads DistributedSampler(seed, shuffle=True).set_epoch(e)'s order, whole batches.
    Fails if the flow stops calling set_epoch(epoch), calls it with a constant, or trains
    without shuffling."""
    reads = []
    recording = TrainHooks(wrap_train_set=lambda dataset: RecordingDataset(dataset, reads))
    trainer.main(run_args(data_root, tmp_path / "run", "train_params.epoches=3",
                             "train_params.batch_size=2", "seed=7"), hooks=recording)
    for epoch in (1, 2, 3):
        sampler = torch.utils.data.DistributedSampler(range(8), num_replicas=1, rank=0,
                                                      shuffle=True, seed=7)
        sampler.set_epoch(epoch)
        assert [index for seen, index in reads if seen == epoch] == list(sampler), epoch
    orders = [[index for seen, index in reads if seen == epoch] for epoch in (1, 2, 3)]
    assert orders[0] != orders[1] != orders[2]


def test_validation_and_best_checkpoint_use_the_ema_weights(data_root, tmp_path):
    """With the EMA on, the logged validation loss is the EMA model's, not the raw model's."""
    run_dir = tmp_path / "run"
    result = trainer.main(run_args(data_root, run_dir, "train_params.epoches=2",
                                      "train_params.eval_freq=100", "ema.enabled=true",
                                      "ema.tau=1", "ema.decay=0.5", validate=True))
    cfg = load_config(run_dir / "config.yaml")
    checkpoint = load_checkpoint(run_dir / "last.pth")
    info = DistInfo(0, 1, 0, False, None, CPU)
    val_loaders = recipe.build_validation_loaders(cfg, info, micro_batch=2,
                                              strategy=choose_strategy(cfg))
    task = DetectionTask(BatchPreparer.from_config(cfg, CPU), build_loss(cfg["loss"]),
                         strategy=choose_strategy(cfg))

    def loss_of(weights):
        model, _, _ = recipe.prepare_model(cfg, info, None, None)
        model.load_state_dict(weights)
        return recipe.validate(model, val_loaders, task, info, None, cfg, 1)[0]["loss"]

    ema_loss, raw_loss = loss_of(checkpoint["ema"]["module"]), loss_of(checkpoint["model"])
    assert abs(ema_loss - raw_loss) > 1e-4          # the two are told apart
    assert result["history"][2]["loss"] == pytest.approx(ema_loss, rel=1e-9, abs=1e-12)
    assert checkpoint["best_val_loss"] == pytest.approx(min(
        result["history"][epoch]["loss"] for epoch in (1, 2)), rel=1e-12)


def test_the_flow_trains_the_xavier_initialised_model(data_root, tmp_path):
    """At lr 1e-30 (the schema refuses 0) the weights stay where the flow initialised them: the
    seeded model after ``init_weights`` (Xavier, classification prior) to within 1e-20, not
    PyTorch's default initialisation."""
    run_dir = tmp_path / "run"
    trainer.main(run_args(data_root, run_dir, "train_params.epoches=1", "optimizer.lr=1e-30",
                             "seed=3"))
    cfg = load_config(run_dir / "config.yaml")
    trained = load_checkpoint(run_dir / "last.pth")["model"]
    torch.manual_seed(3)
    reference = build_model(cfg["model"])
    init_weights(reference, **recipe.init_settings(cfg["init"]))
    torch.manual_seed(3)
    default_init = build_model(cfg["model"])
    for name, value in reference.named_parameters():
        torch.testing.assert_close(trained[name], value.detach(), rtol=0, atol=1e-20, msg=name)
    assert any(not torch.equal(trained[name], value.detach())
               for name, value in default_init.named_parameters())


def _first_step_stalls_on_rank_1(rank, world_size, port, argv, rank_0_done):
    """tools/train.py on ``rank``; rank 1 arrives at its first optimizer step once rank 0 has
    ended (the file ``rank_0_done``), at the latest 15 s late."""
    import os
    from pathlib import Path
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    waited = {}

    def late_step(step):
        if not waited:
            waited["since"] = time.monotonic()
            while rank == 1 and not Path(rank_0_done).exists() and \
                    time.monotonic() - waited["since"] < 15:
                time.sleep(0.05)

    try:
        trainer.main(argv, hooks=TrainHooks(before_step=late_step))
        outcome = {"finished": True}
    except SystemExit as error:
        outcome = {"exit": str(error.code)}
    outcome["seconds_in_step"] = time.monotonic() - waited.get("since", time.monotonic())
    if rank == 0:
        Path(rank_0_done).touch()
    return outcome


@pytest.mark.slow
def test_the_process_group_timeout_ends_a_step_a_peer_never_joins(data_root, tmp_path):
    """distributed.timeout_minutes (here 3 s) bounds the gradient all-reduce: rank 0 gives up
    on its late peer in seconds, not after torch's default 30 minutes (by which time, 15 s,
    the peer would have arrived and the run finished); the peer waits no longer than that."""
    argv = run_args(data_root, tmp_path / "run", "train_params.epoches=1",
                    "train_params.max_micro_batch=1", "distributed.timeout_minutes=0.05")
    rank0, _ = run_on_ranks(_first_step_stalls_on_rank_1, world_size=2, init_group=False,
                            timeout_s=120, args=(free_port(), argv, str(tmp_path / "rank0.done")))
    assert "exit" in rank0 and "\n" not in rank0["exit"], rank0
    assert rank0["seconds_in_step"] < 12, rank0


def test_max_steps_stops_inside_an_epoch_and_sizes_the_schedule(data_root, tmp_path):
    """train_params.max_steps 6 on 4 steps per epoch: 2 epochs, the second cut after 2 steps;
    the lr schedule spans exactly 6 steps; the final checkpoint says where it stopped, so a
    resume with a larger budget continues inside epoch 2."""
    run_dir = tmp_path / "run"
    result = trainer.main(run_args(data_root, run_dir, "train_params.max_steps=6",
                                      "train_params.epoches=50", "train_params.batch_size=2"))
    last = load_checkpoint(run_dir / "last.pth")
    assert result["step"] == 6
    assert (last["epoch"], last["epoch_steps_done"], last["step"]) == (1, 2, 6)
    assert last["scheduler"]["last_epoch"] == 6
    resumed = trainer.main(["--model_dir", str(run_dir), "--set", "train_params.max_steps=8"])
    assert resumed["step"] == 8
    assert load_checkpoint(run_dir / "last.pth")["epoch"] == 2      # epoch 2 now whole
