"""Processes writing one store at once: two `replay train` on a fresh SQLite store, processes creating one at once,
verbs answering about one run.

MLflow creates a new store's schema on first use; two processes doing that on one new file collided
("table experiments already exists") until open_store serialized creation with a lock beside the database.
"""

from __future__ import annotations

import subprocess

from tests.helpers import REPLAY, Workspace

TINY = ("train.steps=2", "train.batch_size=8", "snapshot.every=0", "snapshot.layer_stats_every=0", "train.val_every=0", "model.hidden=16")
ROUNDS, CREATORS = 3, 3  # without the lock the race was lost in 3 rounds of 3
WRITERS, RACED_RUNS = 4, 6  # with set_tag the race was lost in 4 tries of 4


def test_two_trainers_on_a_fresh_store_are_both_recorded(tmp_path):
    workspace = Workspace(tmp_path)
    assert not (tmp_path / "mlflow.db").exists()
    trainers = [
        subprocess.Popen([REPLAY, "train", "--json", f"--run-name=racer-{index}", *TINY], cwd=tmp_path, env=workspace.env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for index in range(2)
    ]
    outputs = [trainer.communicate(timeout=120) for trainer in trainers]
    for trainer, (stdout, stderr) in zip(trainers, outputs):
        assert trainer.returncode == 0, f"exit {trainer.returncode}\n{stderr}"
    runs = workspace.store().search_runs("")
    assert sorted(run.info.run_name for run in runs) == ["racer-0", "racer-1"]
    assert all(run.info.status == "FINISHED" for run in runs)


def _create_and_record(tracking_uri: str, barrier, index: int) -> None:
    from replaybisect.store import open_store

    barrier.wait(timeout=20)  # every creator opens the new store at once
    open_store(tracking_uri).create_run("train", run_name=f"creator-{index}")


def test_processes_creating_one_fresh_store_at_once_each_record_a_run(tmp_path):
    """What a `replay train` does first, raced harder than two trainers can in a test's time: CREATORS processes
    opening one new store at the same moment (MLflow creating its schema), ROUNDS times; every one records its run."""
    import multiprocessing

    from replaybisect.store import open_store

    context = multiprocessing.get_context("fork")  # the store's modules are imported already: the creators start at once
    for round_ in range(ROUNDS):
        uri = f"sqlite:///{tmp_path / f'round-{round_}.db'}"
        barrier = context.Barrier(CREATORS)
        creators = [context.Process(target=_create_and_record, args=(uri, barrier, index)) for index in range(CREATORS)]
        for creator in creators:
            creator.start()
        for creator in creators:
            creator.join(timeout=120)
            creator.kill()
        assert [creator.exitcode for creator in creators] == [0] * CREATORS, round_
        runs = open_store(uri).search_runs("")
        assert sorted(run.info.run_name for run in runs) == [f"creator-{index}" for index in range(CREATORS)], round_


def _answer_at_once(tracking_uri: str, run_ids: list[str], barrier, index: int) -> None:
    from replaybisect.store import open_store

    store = open_store(tracking_uri)
    for run_id in run_ids:
        barrier.wait(timeout=20)  # every writer's first write of this run's description at once
        store.record_answer(run_id, "diagnose", f"answer {index}")


def test_verbs_answering_about_one_run_at_once_all_succeed(tmp_path):
    """Verbs answering about one run at the same moment (`diagnose` twice, or `watch` beside a user) all write the
    run's description; MLflow's set_tag inserted it twice and one verb failed with a UNIQUE constraint error."""
    import multiprocessing

    workspace = Workspace(tmp_path)
    store = workspace.store()
    run_ids = [store.create_run("train", run_name=f"examined-{index}") for index in range(RACED_RUNS)]
    context = multiprocessing.get_context("fork")  # the store's modules are imported already: the writers start at once
    barrier = context.Barrier(WRITERS)
    writers = [context.Process(target=_answer_at_once, args=(workspace.tracking_uri, run_ids, barrier, index))
               for index in range(WRITERS)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=120)
        writer.kill()
    assert [writer.exitcode for writer in writers] == [0] * WRITERS
    for run_id in run_ids:
        assert store.get_run(run_id).data.tags["mlflow.note.content"].startswith("diagnose: answer ")
