"""Multi-rank correctness of training and evaluation (issue 17, docs/DESIGN.md §6.4, 6.6, 6.10,
§7).

Real ``torch.distributed`` ranks (gloo, CPU, spawned by dist_helpers) running the real trainer and
evaluator on tiny OPV2V-format data. Each spawn imports torch (seconds), so every check that can
share a session does.
"""
from __future__ import annotations

import os
import random
import shutil
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dist_helpers import free_port, run_on_ranks
from opv2v_factory import frame_stamps, write_simple_split
from process_state import preserved_opencood_logger
from opencood.config import load_config
from opencood.data.collate import collate_samples
from opencood.data.datasets import build_dataset
from opencood.data.pipeline import BatchPreparer
from opencood.engine import recipe, state as train_state, trainer
from opencood.engine.hooks import NO_HOOKS, TrainHooks
from opencood.engine.loop import validation_loss
from opencood.engine.task import DetectionTask
from opencood.losses import build_loss
from opencood.strategies import choose_strategy
from opencood.utils import dist as dist_utils
from opencood.utils.dist import DistInfo
from opencood.utils.samplers import InferenceSampler

REPO_ROOT = Path(__file__).resolve().parents[1]
SMOKE_YAML = REPO_ROOT / "hypes_yaml" / "synthetic" / "smoke.yaml"
CPU = torch.device("cpu")
VAL_BATCHES = (1, 2, 3)
VAL_SAMPLES = 5   # divisible by neither 2 nor 3: shards of 3+2 and 2+2+1


@pytest.fixture(autouse=True)
def _restore_opencood_logger():
    """In-process trainer runs reconfigure the "opencood" logger: put it back afterwards."""
    with preserved_opencood_logger():
        yield


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    """train4 (2 steps of global batch 2) and validate5, whose middle frame has no vehicle."""
    root = tmp_path_factory.mktemp("multirank")
    write_simple_split(root / "train4", num_cavs=2, timestamps=frame_stamps(4))
    validate = frame_stamps(VAL_SAMPLES)
    write_simple_split(root / "validate5", num_cavs=2, timestamps=validate,
                       no_vehicles_at=validate[2])
    return root


def _data_args(root: Path):
    return ["--set", f"root_dir={root / 'train4'}", "--set", f"validate_dir={root / 'validate5'}",
            "--set", f"test_dir={root / 'validate5'}"]


def _rank_env(rank: int, world_size: int, port: int) -> dict:
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _capture(results: dict, key: str, function) -> None:
    try:
        results[key] = function()
    except BaseException:  # the test reports it; one failing part must not hide the others
        results[key] = {"capture_error": traceback.format_exc()}


def _part(session: list, key: str) -> list:
    parts = [rank_results[key] for rank_results in session]
    for rank, part in enumerate(parts):
        if isinstance(part, dict) and "capture_error" in part:
            pytest.fail(f"rank {rank} failed in {key}:\n{part['capture_error']}")
    return parts


def _outcome(main, argv) -> dict:
    """{"result"}, {"exit": the one-line error} or {"raised": a traceback}."""
    try:
        return {"result": main(argv)}
    except SystemExit as error:
        return {"exit": str(error.code)}
    except BaseException:
        return {"raised": traceback.format_exc()}


def _finished(outcomes: list) -> list:
    for rank, outcome in enumerate(outcomes):
        assert "result" in outcome, f"rank {rank}: {outcome.get('exit') or outcome['raised']}"
    return [outcome["result"] for outcome in outcomes]


def _run_trainer_on_rank(rank, world_size, port, argv, hooks: TrainHooks = NO_HOOKS) -> dict:
    """trainer.main as torchrun would start it on ``rank`` (see _outcome), with ``hooks``."""
    os.environ.update(_rank_env(rank, world_size, port))
    return _outcome(lambda arguments: trainer.main(arguments, hooks), argv)


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
    recipe.use_sync_batchnorm = lambda info: info.world_size > 1
    torch.nn.SyncBatchNorm.forward = _sync_batchnorm_on_cpu
    # DDP refuses SyncBatchNorm in a CPU module; the stand-in runs on CPU.
    DistributedDataParallel._passing_sync_batchnorm_handle = lambda self, module: None
    calls, sync_bn_layers = [], []

    def count_sync_bn(parts, info):
        sync_bn_layers.append(sum(isinstance(m, torch.nn.SyncBatchNorm)
                                  for m in parts.model_without_ddp.modules()))

    def step_marker(step):
        calls.append(("optimizer_step", ()))

    _spy_on_collectives(calls)
    outcome = _run_trainer_on_rank(rank, world_size, port, argv,
                                   TrainHooks(on_parts=count_sync_bn, before_step=step_marker))
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
        f"{[(rank.get('exit') or rank.get('raised') or 'ok')[-300:] for rank in ranks]}")
    for rank, outcome in enumerate(ranks):
        assert "result" in outcome, f"rank {rank}: {outcome.get('exit') or outcome['raised']}"
        assert outcome["result"]["step"] == 2
        assert outcome["sync_bn_layers"][0] > 0  # the SyncBN path really ran
    names = [name for name, _ in calls[0]]
    first_step = names.index("optimizer_step")
    # Not vacuous: DDP's start-up checks precede the first step, SyncBN communicated in it.
    assert "_verify_params_across_processes" in names[:first_step]
    assert "all_gather" in names[first_step:]
    assert "model: " in (run_dir / "train.log").read_text()  # the summary still runs


# ----------------------------------------------------------------------------------------------
# The 2-rank session shared by the checks below
# ----------------------------------------------------------------------------------------------

def _trainer_job(rank, world_size, port, argv) -> dict:
    """trainer.main on this rank, recording the model each validation evaluates and this
    rank's generator states when a checkpoint is taken and right after a resume restores
    them. Rank 1 draws from its global generators at every step (as a model with per-rank
    randomness would), so its states differ from rank 0's."""
    from opencood.utils.checkpoint import capture_rng_state
    validated, at_save, after_restore, first_step_rng = [], [], [], []
    real_loss, real_validation_loss = DetectionTask.training_loss, DetectionTask.validation_loss
    real_capture, real_restore = train_state.capture_rng_state, train_state.restore_rng_state

    def validation_spy(task, model_for_eval, batch):     # the model of every validation batch
        validated.append({key: value.detach().clone()
                          for key, value in model_for_eval.state_dict().items()})
        return real_validation_loss(task, model_for_eval, batch)

    def drawing_loss(task, model, batch):
        if not first_step_rng:          # the stream a dropout mask of step 1 draws from
            first_step_rng.append(torch.get_rng_state())
        if rank == 1:
            torch.rand(3), random.random(), np.random.rand()
        return real_loss(task, model, batch)

    def capture_spy():           # the states a checkpoint takes of this rank
        at_save.append(real_capture())
        return at_save[-1]

    def restore_spy(state):      # a resume restoring this rank's states
        real_restore(state)
        after_restore.append(capture_rng_state())

    DetectionTask.training_loss, DetectionTask.validation_loss = drawing_loss, validation_spy
    train_state.capture_rng_state, train_state.restore_rng_state = capture_spy, restore_spy
    try:
        outcome = _run_trainer_on_rank(rank, world_size, port, argv)
    finally:
        DetectionTask.training_loss, DetectionTask.validation_loss = (real_loss,
                                                                      real_validation_loss)
        train_state.capture_rng_state, train_state.restore_rng_state = real_capture, real_restore
    return dict(outcome, validated=validated, rng_at_save=at_save,
                rng_after_restore=after_restore, first_step_rng=first_step_rng)


def _session_body(rank, world_size, root, work, ports):
    results = {}

    def validation():
        with dist_utils.distributed_session(env=_rank_env(rank, world_size, ports["validation"])):
            return validation_losses(root, rank, world_size)

    _capture(results, "validation", validation)
    _capture(results, "train", lambda: _trainer_job(rank, world_size, ports["train"],
                                                    _train_argv(root, work / "run")))
    eval_argv = ["--model_dir", str(work / "run"), "--num_workers", "0", "--batch_size", "1",
                 "--set", "distributed.timeout_minutes=0.25"]
    _capture(results, "eval_ap_error", lambda: _evaluator_job(
        rank, world_size, ports["eval_ap_error"], eval_argv, fail_ap_on_rank_0=True))
    _capture(results, "eval_corrupt", lambda: _evaluator_job(
        rank, world_size, ports["eval_corrupt"],
        eval_argv + ["--set", f"test_dir={work / CORRUPT_SPLIT}"]))
    # Last: it turns the 1-epoch run into a 2-epoch one.
    _capture(results, "resume", lambda: _trainer_job(
        rank, world_size, ports["resume"],
        ["--model_dir", str(work / "run"), "--set", "train_params.epoches=2"]))
    return results


def _injected_ap_failure(self):
    raise ValueError("injected AP failure")


def _evaluator_job(rank, world_size, port, argv, fail_ap_on_rank_0=False) -> dict:
    """evaluator.main on this rank, recording the process-group timeout it asks for; with
    ``fail_ap_on_rank_0``, rank 0's AP computation (rank 0 alone runs it) raises."""
    from opencood.engine import evaluator
    from opencood.eval.ap import APAccumulator
    os.environ.update(_rank_env(rank, world_size, port))
    timeouts = []
    real_init, real_compute = dist.init_process_group, APAccumulator.compute

    def init_spy(*args, **kwargs):
        timeouts.append(kwargs["timeout"].total_seconds())
        return real_init(*args, **kwargs)

    dist.init_process_group = init_spy
    if fail_ap_on_rank_0 and rank == 0:
        APAccumulator.compute = _injected_ap_failure
    try:
        return dict(_outcome(evaluator.main, argv), timeouts=timeouts)
    finally:
        dist.init_process_group, APAccumulator.compute = real_init, real_compute


CORRUPT_SPLIT = "validate5_corrupt"


def _corrupt_pcd(split_dir: Path) -> Path:
    """The ego cloud of the split's first sample: in rank 0's shard (shards are contiguous)."""
    return split_dir / "2021_01_01_00_00_00" / "1000" / "000000.pcd"


def _write_corrupt_split(source: Path, target: Path) -> None:
    shutil.copytree(source, target)
    _corrupt_pcd(target).write_text("# .PCD v0.7\nFIELDS x y z\nnot a pcd\n")


def _train_argv(root: Path, run_dir: Path) -> list:
    """1 epoch, global batch 2 = micro 1 x 2 ranks, no EMA; a low score threshold so an
    untrained model has detections and AP is not 0."""
    return ["--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(run_dir),
            "--set", "train_params.epoches=1", "--set", "train_params.max_micro_batch=1",
            "--set", "ema.enabled=false",
            "--set", "postprocess.target_args.score_threshold=0.005",
            *_data_args(root)]


@pytest.fixture(scope="module")
def two_rank_session(data_root, tmp_path_factory):
    work = tmp_path_factory.mktemp("session")
    ports = {name: free_port() for name in ("validation", "train", "eval_ap_error",
                                            "eval_corrupt", "resume")}
    assert len(set(ports.values())) == len(ports)
    _write_corrupt_split(data_root / "validate5", work / CORRUPT_SPLIT)
    return run_on_ranks(_session_body, world_size=2, init_group=False, timeout_s=180,
                        args=(data_root, work, ports))


# ----------------------------------------------------------------------------------------------
# 2. the validation loss does not depend on the batch size or the number of ranks
# ----------------------------------------------------------------------------------------------

def _config(root: Path) -> dict:
    return load_config(SMOKE_YAML, [f"root_dir={root / 'train4'}",
                                    f"validate_dir={root / 'validate5'}",
                                    f"test_dir={root / 'validate5'}"])


def _fixed_model(cfg: dict) -> torch.nn.Module:
    """The trainer's model, initialised from seed 0: the same weights in every process."""
    torch.manual_seed(0)
    model, _, _ = recipe.prepare_model(cfg, DistInfo(0, 1, 0, False, None, CPU), None, None)
    return model


def validation_losses(root: Path, rank: int, world_size: int) -> list:
    """[(loss, samples)] of fixed weights at each of VAL_BATCHES, all ranks together."""
    cfg = _config(root)
    model = _fixed_model(cfg)
    loss_fn = DetectionTask(BatchPreparer.from_config(cfg, CPU),
                            build_loss(cfg["loss"])).validation_loss
    dataset = build_dataset(cfg, "validate", train=False, strategy=choose_strategy(cfg),
                            count_ego_points=False)
    losses = []
    for batch_size in VAL_BATCHES:
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=batch_size, collate_fn=collate_samples,
            sampler=InferenceSampler(len(dataset), rank, world_size))
        losses.append(validation_loss(model, loader, loss_fn, CPU))
    return losses


def _validation_losses_on_rank(rank, world_size, root):
    return validation_losses(root, rank, world_size)


def _losses_of_samples_alone(root: Path) -> tuple:
    """(training loss of each sample as a micro-batch of its own, training loss at batch 2)."""
    cfg = _config(root)
    model = _fixed_model(cfg).eval()
    loss_fn = DetectionTask(BatchPreparer.from_config(cfg, CPU),
                            build_loss(cfg["loss"])).training_loss
    dataset = build_dataset(cfg, "validate", train=False, strategy=choose_strategy(cfg),
                            count_ego_points=False)
    with torch.no_grad():
        alone = [float(loss_fn(model, collate_samples([dataset[i]]))[0])
                 for i in range(len(dataset))]
        pairs = [(float(loss_fn(model, collate_samples(list(chunk)))[0]), len(chunk))
                 for chunk in _chunks([dataset[i] for i in range(len(dataset))], 2)]
    return alone, sum(loss * n for loss, n in pairs) / len(dataset)


def _chunks(items: list, size: int) -> list:
    return [items[start:start + size] for start in range(0, len(items), size)]


def test_validation_loss_is_the_same_for_every_batch_size_and_rank_count(two_rank_session,
                                                                       data_root):
    """Fixed weights, 5 samples (one without vehicles): validation batch 1, 2, 3 on 1, 2 and 3
    ranks all give the mean over samples of each sample's loss alone."""
    three_ranks = run_on_ranks(_validation_losses_on_rank, world_size=3, timeout_s=120,
                               args=(data_root,))
    per_world = {1: validation_losses(data_root, 0, 1),
                 2: _part(two_rank_session, "validation")[0], 3: three_ranks[0]}
    for ranks in (_part(two_rank_session, "validation"), three_ranks):
        assert all(rank == ranks[0] for rank in ranks)  # all-reduced: one number everywhere
    alone, batch_2_training_loss = _losses_of_samples_alone(data_root)
    expected = sum(alone) / len(alone)
    # Not vacuous: the empty frame's loss differs from the others, and the micro-batch
    # normalisation of the training loss moves the mean when samples are batched in pairs.
    assert max(alone) - min(alone) > 0.5
    assert abs(batch_2_training_loss - expected) > 0.1
    for world_size, losses in per_world.items():
        for batch_size, (loss, samples) in zip(VAL_BATCHES, losses):
            assert samples == VAL_SAMPLES, (world_size, batch_size)
            assert loss == pytest.approx(per_world[1][0][0], abs=1e-6), (world_size, batch_size)
            assert loss == pytest.approx(expected, rel=1e-5), (world_size, batch_size)


# ----------------------------------------------------------------------------------------------
# 3. without EMA, every rank validates rank 0's model
# ----------------------------------------------------------------------------------------------

def _validate_in_one_process(run_dir: Path, checkpoint_name: str) -> dict:
    """recipe.validate of a saved checkpoint in this (single) process, micro-batch 1."""
    from opencood.utils.checkpoint import load_checkpoint
    cfg = load_config(run_dir / "config.yaml")
    info = DistInfo(0, 1, 0, False, None, CPU)
    val_loaders = recipe.build_validation_loaders(cfg, info, micro_batch=1,
                                              strategy=choose_strategy(cfg))
    path = run_dir / checkpoint_name
    _, model, _ = recipe.prepare_model(cfg, info, load_checkpoint(path), path)
    preparer = BatchPreparer.from_config(cfg, CPU)
    task = DetectionTask(preparer, build_loss(cfg["loss"]), strategy=choose_strategy(cfg))
    results, count, _ = recipe.validate(model, val_loaders, task, info, None, cfg, 1)
    assert count == VAL_SAMPLES
    return results


def test_ranks_validate_the_same_model_without_ema(two_rank_session):
    ranks = _part(two_rank_session, "train")
    _finished(ranks)
    states = [outcome["validated"][0] for outcome in ranks]
    assert any("running_mean" in key for key in states[0])  # BatchNorm statistics included
    different = [key for key in states[0] if not torch.equal(states[0][key], states[1][key])]
    assert not different, f"ranks validated different models: {different[:3]}"

    history = [outcome["result"]["history"][1] for outcome in ranks]
    assert history[0]["loss"] == history[1]["loss"]
    # The 2-rank validation (each rank half of the samples) equals one process validating the
    # weights rank 0 saved: loss and AP.
    single = _validate_in_one_process(Path(ranks[0]["result"]["run_dir"]), "epoch_1.pth")
    assert single["ap_30"] > 0  # not vacuous: there are detections to agree on
    assert history[0]["loss"] == pytest.approx(single["loss"], abs=1e-6)
    for key in ("ap_30", "ap_50", "ap_70", "ap_50_ego_occluded"):
        assert history[0][key] == pytest.approx(single[key], abs=1e-12), key


# ----------------------------------------------------------------------------------------------
# 4. an error on one rank during evaluation ends every rank, with its message
# ----------------------------------------------------------------------------------------------

def test_an_error_in_rank_0s_ap_ends_every_rank_with_the_message(two_rank_session):
    """Rank 0 alone merges and computes AP: its failure must reach rank 1, which otherwise
    waits at the next collective until the timeout."""
    ranks = _part(two_rank_session, "eval_ap_error")
    assert "ValueError: injected AP failure" in ranks[0].get("raised", ""), ranks[0]
    # A bug keeps its traceback on rank 0; rank 1 stops too, exit status 1 without a line of its
    # own (rank 0's traceback tells the job why).
    assert ranks[1] == {"exit": "1", "timeouts": [15.0]}
    assert ranks[0]["timeouts"] == [15.0]  # distributed.timeout_minutes reaches the group


def test_a_corrupt_file_in_rank_0s_shard_ends_every_rank(two_rank_session):
    broken = str(_corrupt_pcd(Path(CORRUPT_SPLIT)))
    ranks = _part(two_rank_session, "eval_corrupt")
    message = ranks[0].get("exit", "")
    assert message.startswith("error: ") and "\n" not in message, ranks[0]
    assert broken in message, message
    assert not message.startswith("error: rank")  # rank 0 reports its own error
    assert ranks[1]["exit"] == "1"                # once per job: rank 1 stops without a line


# ----------------------------------------------------------------------------------------------
# 6. every rank's generators are saved and each rank resumes its own
# ----------------------------------------------------------------------------------------------

def _same_rng(a: dict, b: dict) -> bool:
    return (torch.equal(a["torch"], b["torch"]) and a["python"] == b["python"]
            and torch.equal(a["numpy"]["keys"], b["numpy"]["keys"])
            and a["numpy"]["pos"] == b["numpy"]["pos"])


def test_each_rank_saves_and_resumes_its_own_generators(two_rank_session):
    from opencood.utils.checkpoint import load_checkpoint
    trained = _part(two_rank_session, "train")
    resumed = _part(two_rank_session, "resume")
    _finished(trained)
    assert [result["step"] for result in _finished(resumed)] == [4, 4]
    at_save = [outcome["rng_at_save"][0] for outcome in trained]  # end of epoch 1
    assert not _same_rng(at_save[0], at_save[1])  # rank 1 drew more: the ranks differ
    run_dir = Path(_finished(trained)[0]["run_dir"])
    saved = load_checkpoint(run_dir / "epoch_1.pth")
    assert len(saved["rng_per_rank"]) == 2
    assert _same_rng(saved["rng"], at_save[0])
    for rank in range(2):
        assert _same_rng(saved["rng_per_rank"][rank], at_save[rank]), rank
        # The resumed rank continues from exactly where it was when epoch 1 was saved.
        assert _same_rng(resumed[rank]["rng_after_restore"][0], at_save[rank]), rank


def test_each_rank_draws_its_own_dropout_masks_from_alike_initialised_weights(
        two_rank_session):
    """Model randomness (dropout) gets a per-rank stream once the model is initialised: the
    ranks' torch generators differ at the first step, while the weights they start from and
    the data they read stay functions of the seed alone (the validated models agree)."""
    from opencood.engine.recipe import rank_seed
    trained = _finished(_part(two_rank_session, "train"))
    first = [outcome["first_step_rng"][0] for outcome in _part(two_rank_session, "train")]
    assert not torch.equal(first[0], first[1])
    seed = load_config(SMOKE_YAML)["seed"]
    for rank in range(2):
        own_stream = torch.Generator().manual_seed(rank_seed(seed, rank))
        assert torch.equal(first[rank], own_stream.get_state())
    assert len({rank_seed(seed, rank) for rank in range(8)} | {seed}) == 9
    assert trained[0]["step"] == trained[1]["step"]


def test_resume_on_another_world_size_restores_rank_0s_generators(two_rank_session, tmp_path,
                                                                  monkeypatch):
    from opencood.utils.checkpoint import load_checkpoint, rng_state_for_rank
    run_dir = Path(_finished(_part(two_rank_session, "resume"))[0]["run_dir"])
    saved = load_checkpoint(run_dir / "last.pth")
    per_rank, rank_0 = saved["rng_per_rank"], saved["rng"]
    assert rng_state_for_rank(saved, 1, 2) is per_rank[1]
    assert rng_state_for_rank(saved, 0, 1) is rank_0 and rng_state_for_rank(saved, 2, 3) is rank_0
    assert rng_state_for_rank({"rng": rank_0}, 1, 2) is rank_0  # saved before rng_per_rank

    copy = tmp_path / "run"
    copy.mkdir()
    for name in ("config.yaml", "last.pth"):
        shutil.copy(run_dir / name, copy / name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    restored = []
    monkeypatch.setattr(train_state, "restore_rng_state", restored.append)
    result = trainer.main(["--model_dir", str(copy), "--set", "train_params.epoches=3"])
    assert result["step"] == 6 and len(restored) == 1
    assert _same_rng(restored[0], rank_0)
    assert "saved by 2 ranks, this run has 1" in (copy / "train.log").read_text()
