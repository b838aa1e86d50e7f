"""Distributed data-parallel jobs started as users start them (torchrun, 2 processes, gloo on CPU) with the same
Recorder lines as one process: the run recorded per rank, replayed on one process bit for bit, the rank and row of a
planted NaN named, a diverging lr found and fixed by `ablate lr`, a killed rank named on the run."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import EXAMPLES, TESTS, Workspace, in_folder, wait_until

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone"]


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Workspace:
    workspace = Workspace(tmp_path_factory.mktemp("ddp"))
    shutil.copy(TESTS / "user_loop" / "ddp_loop.py", workspace.path)
    shutil.copy(TESTS / "user_loop" / "lightning_ddp.py", workspace.path)
    return workspace


STOPPING = ("diverge", "fp16", "mean-loss", "none")  # 20 steps, a NaN row on rank 1 at step 12 (diverge: inf at 13)
PLANTS = {"none": (None, None), "seed": ("replicas-drifted", 0), "hook": ("replicas-drifted", 1),
          "loss-count": ("rank-loss-scale", 0)}
HEALTHY = {plant: f"{plant}:steps=12:nan-step=-1" for plant in PLANTS}  # 12 steps, no NaN row: diagnose's asymmetries
SHARDED = ("none:fsdp", "diverge:fsdp")  # fully_shard: a NaN row on rank 1 at step 12, then an lr that diverges
AT_STEP_0 = "mean-loss:steps=3:nan-step=0"  # a NaN row at the first step: no snapshot before it


@pytest.fixture(scope="module")
def job(shared) -> tuple[dict[str, str], subprocess.CompletedProcess]:
    """One torchrun job recording every run of this module's plants, one after another (a job's process group and
    imports are paid once): the healthy plants, the sharded runs, a NaN at step 0, then the runs that stop at a
    non-finite step: an lr that diverges (inf at step 13), fp16 with a GradScaler, a step returning the ranks' mean
    loss and plain DDP, each with a NaN row in rank 1's batch at step 12. The job ends with the last run's
    NonFiniteStep, as a user's script does; each run before it says its stop in a line on stdout."""
    specs = (*HEALTHY.values(), *SHARDED, AT_STEP_0, *STOPPING)
    done = subprocess.run([*TORCHRUN, "ddp_loop.py", "--steps", "20", "--nan-step", "12", "--plant", ",".join(specs)],
                          cwd=shared.path, env=shared.env(), capture_output=True, text=True, timeout=600)
    assert done.returncode != 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    run_ids = re.findall(r"recording run ([0-9a-f]{32})", done.stderr)
    assert len(set(run_ids)) == len(specs), done.stderr[-3000:]
    return dict(zip(specs, run_ids)), done


def test_a_nan_row_on_rank_1_is_named_with_its_rank_and_row(shared, job):
    run_ids, done = job
    run_id = run_ids["none"]
    # every rank stopped at the failing step before its update, each with one line (no rank hung in an all-reduce)
    assert done.stderr.count("replaybisect.NonFiniteStep: ") == 2 and "[rank1]: Traceback" not in done.stderr
    assert "loss is nan at step 12" in done.stderr and "the loss on another rank went non-finite at step 12" in done.stderr
    assert "rank 1 none step 11 loss" in done.stdout and "none step 12 loss" not in done.stdout
    store = shared.store()
    tags = store.tags(run_id)
    assert tags["status"] == "nonfinite" and tags["first_nonfinite_step"] == "12"
    losses_1 = dict(store.metric_history(run_id, "loss/rank1"))
    assert sorted(losses_1) == list(range(13)) and losses_1[12] != losses_1[12]  # rank 1's NaN, logged by rank 0
    checksums = [dict(store.metric_history(run_id, f"param_checksum/rank{rank}")) for rank in (0, 1)]
    assert checksums[0] == checksums[1] and len(checksums[0]) == 13  # DDP kept the replicas identical
    config = (Path(store.local_artifact_dir(run_id)) / "config.yaml").read_text()
    assert "world_size: 2" in config and "backend: gloo" in config

    report = shared.answer_here("find_nan", run_id)  # `replay nan --json` (its command: the --nproc 2 test), in this process
    assert report["reproduced"] == "exact" and report["replay"]["ranks_compared"] == 2
    assert report["state_match"].startswith("bit-identical")
    assert report["category"] == "data" and report["failing_step"] == 12
    [finding] = report["batch"]
    assert finding["rank"] == 1 and finding["rows"] == [5] and finding["field"].startswith("rank 1's batch[0]")

    # healthy ranks before the NaN: no asymmetry found, only the failure, on rank 1's loss
    [failure] = _findings_beside_timing(shared, run_id)
    assert failure["pattern"] == "nan-after-k" and failure["evidence"]["ranks_nonfinite_loss"] == [1]
    assert "non-finite loss on rank 1 at step 12" in failure["summary"]


def test_a_step_with_a_collective_of_its_own_replays_exact_over_the_real_collective(shared, job):
    """The step returns the ranks' mean loss (its own all-reduce): one process does not reproduce the logged losses and
    says how to replay it; `--nproc 2` replays every rank in its own process over gloo, exact, and names rank 1's row."""
    run_ids, done = job
    run_id = run_ids["mean-loss"]
    assert "rank 1 mean-loss: loss is nan at step 12" in done.stdout
    alone = shared.answer_here("find_nan", run_id)
    assert alone["reproduced"] == "diverged", alone["evidence"]
    assert any(f"replay nan --run-id {run_id} --nproc 2" in warning for warning in alone["warnings"]), alone["warnings"]
    ablated = shared.answer_here("ablate", run_id, arms=["lr"], workers=1)  # its arms replay on one process too: said
    assert any(f"replay nan --run-id {run_id} --nproc 2" in warning and "ablate has no --nproc" in warning
               for warning in ablated["warnings"]), ablated["warnings"]

    result = shared.replay("nan", "--run-id", run_id, "--nproc", "2", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    report = result.json()  # the ranks' own output went to stderr: the step's print of the mean loss, each replayed step
    assert "rank 1 mean loss" in result.stderr and "mean loss" not in result.stdout
    assert (report["reproduced"], report["replay"]["processes"], report["replay"]["ranks_compared"]) == ("exact", 2, 2), report["evidence"]
    assert report["evidence"][0].startswith("replayed steps 10..11 from the snapshot of step 10 over the real collective (2 processes, gloo)")
    assert report["category"] == "data" and report["failing_step"] == 12, report["headline"]
    [finding] = report["batch"]
    assert finding["rank"] == 1 and finding["rows"] == [5] and "rank 1's batch[0]" in report["headline"]
    assert report["evidence"][1] == "the failure starts on rank 1: its batch went non-finite"

    import replaybisect as rb
    from replaybisect.errors import ConfigError, ReplayError

    with in_folder(shared.path), pytest.raises(ConfigError, match="recorded with 2 ranks; pass --nproc 2"):
        rb.find_nan(run_id, tracking_uri=shared.tracking_uri, publish=False, nproc=3)
    with in_folder(shared.path), pytest.raises(ReplayError, match=r"^rank 0: step 5 of run \w+ was finite"):  # a rank's own
        rb.find_nan(run_id, 5, tracking_uri=shared.tracking_uri, publish=False, nproc=2)  # refusal, raised by the launcher

    # at step 0 (no snapshot before it: the step is reproduced from the config, every rank building its DDP module)
    report = shared.answer_here("find_nan", run_ids[AT_STEP_0], nproc=2)
    assert (report["failing_step"], report["category"], report["replay"]["failure_starts_on_rank"]) == (0, "data", 1), report["evidence"]
    replay = report["replay"]  # rank 0's Python and NumPy streams are the script's own, not rebuilt: close, as on one process
    assert (replay["reproduced_from"], replay["same_outcome"], replay["as_logged"]) == ("config", True, True), report["evidence"]


def test_a_diverging_lr_is_a_divergence_and_ablate_fixes_it_by_lr(shared, job):
    run_ids, done = job
    run_id = run_ids["diverge"]
    assert "diverge: loss is inf at step 13" in done.stdout
    report = shared.answer_here("find_nan", run_id)
    assert report["reproduced"] == "exact" and report["category"] == "divergence"
    answer = shared.answer_here("ablate", run_id, arms=["lr"], workers=1)
    verdicts = {arm["name"]: arm["verdict"] for arm in answer["arms"]}
    assert answer["baseline"]["verdict"] == "fails-again" and verdicts["lr"] == "fixes"


def test_a_killed_rank_is_named_on_the_failed_run(shared):
    trainer = subprocess.Popen([*TORCHRUN, "ddp_loop.py", "--steps", "200", "--sleep", "0.05"], cwd=shared.path,
                               env=shared.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = ""
    for line in trainer.stdout:  # the ranks share the pipe: one rank's text may land inside another's line
        seen += line
        if "rank 1 none step 8 " in seen:
            break
    pid = int(re.search(r"rank 1 pid (\d+)", seen).group(1))
    os.kill(pid, signal.SIGKILL)
    _, stderr = trainer.communicate(timeout=120)
    assert trainer.returncode != 0
    run_id = re.search(r"recording run ([0-9a-f]{32})", stderr).group(1)
    store = shared.store()
    wait_until(lambda: store.get_run(run_id).info.status != "RUNNING", timeout=30)
    run = store.get_run(run_id)
    assert run.info.status == "FAILED", stderr[-3000:]
    tags = store.tags(run_id)
    assert tags["failed_ranks"] == "1" and "killed" in tags["failure"]
    assert "5" in tags["snapshot_steps"].split(",")  # what was recorded before stays, and replays
    from replaybisect.replay import restore as restore_mod

    with in_folder(shared.path):
        restored = restore_mod.restore(store, run_id, snapshot=restore_mod.load_snapshot(store, run_id, 5))
        replayed = restore_mod.replay(restored, 8, logged=restore_mod.logged_losses(store, run_id))
    assert replayed.reproduced == "exact" and replayed.ranks_compared == 2 and sorted(replayed.losses) == [5, 6, 7]


def _findings_beside_timing(shared, run_id):
    """diagnose's findings less input-pipeline-bound, which a loaded machine may add to these runs: the toy model's
    step is quicker than the loop's own work between steps, so it says nothing about the ranks."""
    findings = shared.answer_here("diagnose", run_id)["findings"]
    return [finding for finding in findings if finding["pattern"] != "input-pipeline-bound"]


def test_diagnose_names_each_planted_rank_asymmetry(shared, job):
    """One job records a run per plant, one after another: each run's ranks find each other's keys, not the last run's."""
    run_ids, _ = job
    for plant, (pattern, step) in PLANTS.items():
        run_id = run_ids[HEALTHY[plant]]
        assert len(shared.store().metric_history(run_id, "loss/rank1")) == 12, plant
        findings = _findings_beside_timing(shared, run_id)
        assert [(f["pattern"], f["step"]) for f in findings] == ([(pattern, step)] if pattern else []), plant
        if plant == "seed":
            assert findings[0]["evidence"]["at_start"] and "init" in findings[0]["summary"]
        if plant == "loss-count":
            assert findings[0]["evidence"]["rank"] == 1 and 0.4 < findings[0]["evidence"]["median_ratio"] < 0.6


def test_check_reads_a_distributed_steps_batch_as_its_step_does_and_flags_nothing_on_a_healthy_job(shared, job):
    """The overfit probe slices each rank's batch (not the RNG states stored beside it, which made it say 'its tensors
    differ in their first dimension' and train on the whole step); a healthy DDP job gets no warning or failure."""
    import replaybisect as rb

    run_ids, _ = job
    with in_folder(shared.path):
        report = rb.check(run_id=run_ids[HEALTHY["none"]], tracking_uri=shared.tracking_uri, publish=False)
    statuses = {check.name: check.status for check in report.checks}
    assert set(statuses.values()) <= {"pass", "skip"}, [(c.name, c.status, c.detail) for c in report.checks if c.status not in ("pass", "skip")]
    overfit = next(check for check in report.checks if check.name == "overfit.one_batch")
    assert statuses["overfit.one_batch"] == "pass" and "differ in their first dimension" not in overfit.detail, overfit.detail
    assert re.search(r"\((\d+) samples", overfit.detail), overfit.detail


def test_fp16_with_a_grad_scaler_every_rank_stops_at_the_nan_row_and_it_replays(shared, job):
    """Rank 1's fp16 loss is NaN: its GradScaler would skip the update without calling the optimizer, so the ranks
    agree right after the backward (not at the optimizer step, which the scaler never reaches) and all stop there."""
    run_ids, done = job
    run_id = run_ids["fp16"]
    assert "rank 1 fp16: loss is nan at step 12" in done.stdout
    assert "rank 0 fp16: the loss on another rank went non-finite at step 12" in done.stdout
    assert "fp16 step 11 loss" in done.stdout and "fp16 step 12 loss" not in done.stdout
    report = shared.answer_here("find_nan", run_id)
    assert report["reproduced"] == "exact" and report["replay"]["ranks_compared"] == 2 and report["precision"] == "fp16"
    [finding] = report["batch"]
    assert finding["rank"] == 1 and finding["rows"] == [5]


def _lightning(workspace: Workspace, *args: str) -> tuple[str, subprocess.CompletedProcess]:
    """A Lightning DDP job as users start one: `python script.py` (Lightning starts the second process itself)."""
    done = subprocess.run([sys.executable, "lightning_ddp.py", *args], cwd=workspace.path, env=workspace.env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0, f"the planted failure did not stop the run\n{done.stdout}\n{done.stderr[-3000:]}"
    return re.search(r"recording run ([0-9a-f]{32})", done.stderr).group(1), done


def test_lightning_ddp_a_nan_row_on_rank_1_is_named_and_a_high_lr_is_a_divergence_fixed_by_lr(shared):
    run_id, done = _lightning(shared, "0.05", "20", "nan")
    assert "loss is nan at step 6" in done.stderr and "the loss on another rank went non-finite at step 6" in done.stderr  # rank 1, 0
    assert "Traceback" not in done.stderr
    report = shared.answer_here("find_nan", run_id)
    assert report["reproduced"] == "exact" and report["replay"]["ranks_compared"] == 2
    assert report["category"] == "data" and report["failing_step"] == 6
    [finding] = report["batch"]
    assert finding["rank"] == 1 and finding["rows"] == [5]
    import replaybisect as rb
    from replaybisect.errors import ConfigError

    with in_folder(shared.path), pytest.raises(ConfigError, match="is a Lightning run: its replay averages"):
        rb.find_nan(run_id, tracking_uri=shared.tracking_uri, publish=False, nproc=2)

    run_id, done = _lightning(shared, "1.0", "60")
    assert "loss is inf at step 25" in done.stderr
    report = shared.answer_here("find_nan", run_id)
    assert report["reproduced"] == "exact" and report["category"] == "divergence"
    answer = shared.answer_here("ablate", run_id, arms=["lr"], workers=1)
    assert answer["baseline"]["verdict"] == "fails-again"
    assert {arm["name"]: arm["verdict"] for arm in answer["arms"]}["lr"] == "fixes"


def test_a_killed_rank_0_is_named_by_the_rank_that_survives_it(shared):
    """Rank 0 owns the run: killed, it cannot end it. Rank 1 sees it gone (the launcher's SIGTERM, or the broken
    all-reduce) and ends the run FAILED naming rank 0, within the launcher's grace period."""
    trainer = subprocess.Popen([*TORCHRUN, "ddp_loop.py", "--steps", "200", "--sleep", "0.05"], cwd=shared.path,
                               env=shared.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = ""
    for line in trainer.stdout:
        seen += line
        if "rank 0 none step 8 " in seen:
            break
    os.kill(int(re.search(r"rank 0 pid (\d+)", seen).group(1)), signal.SIGKILL)
    _, stderr = trainer.communicate(timeout=120)
    run_id = re.search(r"recording run ([0-9a-f]{32})", stderr).group(1)
    run = shared.store().get_run(run_id)
    assert run.info.status == "FAILED", stderr[-3000:]
    tags = shared.store().tags(run_id)
    assert tags["failed_ranks"] == "0" and "rank 0: process" in tags["failure"]


# ---- replay train as a DDP job ----------------------------------------------------------------------------------
def _lr_explosion_config(workspace: Workspace) -> Path:
    folder = workspace.path / "lr_explosion"
    if not folder.is_dir():
        shutil.copytree(EXAMPLES / "ablate_lr_explosion", folder)
    return folder


def test_replay_train_nproc_2_records_one_ddp_run_that_replays_exact_and_ablate_fixes_by_lr(shared):
    """`replay train train.nproc=2` starts both ranks itself: each trains its half of the step's batch in DDP; the run
    is one DDP run (every rank's loss and checksum), replayed on one process bit for bit, and too high an lr is a
    divergence fixed by `ablate lr`."""
    folder = _lr_explosion_config(shared)
    done = shared.replay("train", "--config-dir", str(folder), "train.nproc=2", "--json")
    assert done.returncode == 3, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["status"] == "nonfinite" and result["first_nonfinite_step"] == 58 and result["stopped"]
    assert "starting 2 processes" in done.stderr and "Traceback" not in done.stderr
    run_id, store = result["run_id"], shared.store()
    config = (Path(store.local_artifact_dir(run_id)) / "config.yaml").read_text()
    assert "world_size: 2" in config and "backend: gloo" in config and "nproc: 2" in config
    assert len(store.metric_history(run_id, "loss/rank1")) == 59
    checksums = [dict(store.metric_history(run_id, f"param_checksum/rank{rank}")) for rank in (0, 1)]
    assert checksums[0] == checksums[1]

    report = shared.answer_here("find_nan", run_id)
    assert report["reproduced"] == "exact" and report["replay"]["ranks_compared"] == 2
    assert report["category"] == "divergence" and report["failing_step"] == 58
    answer = shared.answer_here("ablate", run_id, arms=["lr"], workers=1)
    assert answer["baseline"]["verdict"] == "fails-again"
    assert {arm["name"]: arm["verdict"] for arm in answer["arms"]}["lr"] == "fixes"


def test_replay_train_under_torchrun_records_one_run_and_bad_nproc_is_one_line(shared):
    """torchrun starts the ranks of `replay train` itself: rank 0 prints the one result, the other rank nothing."""
    replay = shutil.which("replay", path=os.path.dirname(sys.executable))
    done = subprocess.run([*TORCHRUN, replay, "train", "train.steps=6", "snapshot.every=3", "--json"], cwd=shared.path,
                          env=shared.env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)  # one JSON document: rank 1 printed nothing on stdout
    assert result["status"] == "ok" and result["steps_completed"] == 6 and result["snapshot_steps"] == [0, 3]
    config = (Path(shared.store().local_artifact_dir(result["run_id"])) / "config.yaml").read_text()
    assert "world_size: 2" in config

    runs_before = len(shared.store().search_runs())
    done = shared.replay("train", "train.nproc=0")
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].endswith("train.nproc=0 must be between 1 and 64")
    # as one of the processes torchrun starts (its variables: the refusal comes before any process group)
    done = shared.replay("train", "train.nproc=3", env=shared.env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0"))
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].endswith(
        "train.nproc=3 but the launcher started 2 processes; leave train.nproc out under torchrun"), done.stderr[-3000:]
    assert len(shared.store().search_runs()) == runs_before


def test_fsdp_runs_replay_exact_on_one_process_name_the_rank_and_row_and_ablate_fixes_the_lr(shared, job):
    """Every rank gathers the shards at a periodic snapshot, rank 0 writes them whole; one process replays the ranks
    through a one-process group's fully_shard (the reduce-scatter stood in for), exact; no replica checksums (shards
    differ by design), so diagnose finds no drift; --nproc is refused for it."""
    run_ids, done = job
    nan_row, diverged = (run_ids[spec] for spec in SHARDED)
    assert "rank 0 none:fsdp: the loss on another rank went non-finite at step 12" in done.stdout
    assert "diverge:fsdp: loss is inf at step 13" in done.stdout
    store = shared.store()
    config = (Path(store.local_artifact_dir(nan_row)) / "config.yaml").read_text()
    assert "world_size: 2" in config and "sharding: fsdp" in config
    assert store.metric_history(nan_row, "param_checksum/rank1") == [] and len(store.metric_history(nan_row, "loss/rank1")) == 13
    assert store.tags(nan_row)["snapshot_steps"] == "0,5,10"

    report = shared.answer_here("find_nan", nan_row)
    assert (report["reproduced"], report["category"], report["failing_step"]) == ("exact", "data", 12), report["evidence"]
    assert "gradients averaged as FSDP's reduce-scatter does): the losses of all 2 ranks exact" in report["evidence"][0]
    [finding] = report["batch"]
    assert finding["rank"] == 1 and finding["rows"] == [5]
    findings = shared.answer_here("diagnose", nan_row)["findings"]
    assert not [finding for finding in findings if finding["pattern"] == "replicas-drifted"], findings

    report = shared.answer_here("find_nan", diverged)
    assert (report["reproduced"], report["category"], report["failing_step"]) == ("exact", "divergence", 13), report["evidence"]
    answer = shared.answer_here("ablate", diverged, arms=["lr"], workers=1)
    assert answer["baseline"]["verdict"] == "fails-again" and {arm["name"]: arm["verdict"] for arm in answer["arms"]} == {"lr": "fixes"}

    import replaybisect as rb
    from replaybisect.errors import ConfigError

    with in_folder(shared.path), pytest.raises(ConfigError, match="sharded with fully_shard.*leave --nproc out"):
        rb.find_nan(nan_row, tracking_uri=shared.tracking_uri, publish=False, nproc=2)
    with in_folder(shared.path), pytest.raises(ConfigError, match="replay check does not check a sharded run's state yet"):
        rb.check(run_id=nan_row, tracking_uri=shared.tracking_uri, publish=False)


def test_a_sharding_a_replay_cannot_rebuild_is_refused_before_a_run_exists(tmp_path):
    """HSDP (fully_shard over a 2-D mesh) and fully_shard over one process are refused by the Recorder in one line."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import replaybisect as rb
    from replaybisect.errors import ConfigError

    ours = not dist.is_initialized()  # a replay in this process may have made its one-process group already
    if ours:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        fully_shard(model, mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
        with pytest.raises(ConfigError, match=r"cannot record this sharded model: 0.weight is placed as .* 2-D mesh \(HSDP"):
            rb.Recorder(model, optimizer, step_fn=lambda model, batch: model(batch).sum(), build=lambda config: None,
                        tracking_uri=uri)
        alone = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        fully_shard(alone)  # over this one process: a replay would have no ranks to average
        with pytest.raises(ConfigError, match=r"cannot record this sharded model: fully_shard over one process"):
            rb.Recorder(alone, torch.optim.SGD(alone.parameters(), lr=0.1), step_fn=lambda model, batch: model(batch).sum(),
                        build=lambda config: None, tracking_uri=uri)
        assert not (tmp_path / "mlflow.db").exists()
    finally:
        if ours:
            dist.destroy_process_group()
