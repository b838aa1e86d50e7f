"""`replay bisect GOOD BAD`: find the first commit that broke convergence, like `git bisect run` for a
noisy, expensive oracle, without touching the user's repository.

How it works
1. The user's repository is only read. Trials run in worktrees of a private `git clone --shared` in the
   cache (gitops.PrivateClone), one worktree per worker, each trial a subprocess with the worktree first on
   PYTHONPATH: `python -m replaybisect train ...` (or the user's `--cmd`).
2. Both endpoints are measured first over the same seeds (mozregression and Chromium bisect-builds verify the range first,
   as mozregression and Chromium's `--verify-range` do). GOOD must pass and BAD must fail.
3. Verdict per commit (`judge`): a non-finite loss is `bad` at once; a commit that cannot be trained
   (bad config, `_target_` that does not import, crash) is `skip`. Otherwise, with seeds as blocks (the
   commit runs the endpoints' seeds, so init and data order are shared):

   a. Reproduction: a metric equal to GOOD's (or BAD's) at the same seed within 1e-3 relative
      (Megatron-Core rerun state machine's replay tolerance) while 10x that far from the other endpoint's means the
      commit trains like that endpoint: decided on one seed. On CPU most commits land here.
   b. Otherwise the statistical test, stated: u_s = x_s - (g_s + b_s) / 2 (the commit's metric minus the
      midpoint of GOOD and BAD at the same seed); z = mean(u) / (sigma_u / sqrt(n)) with
      sigma_u = sqrt(3/4) * sd(b_s - g_s) from the endpoints (floored at 5% of the endpoint gap).
      |z| >= 2.576 (two-sided p <= 0.01, Chromium Pinpoint's bar for "different") decides: bad above the
      midpoint, good below. Otherwise the commit gets one more seed, up to --max-seeds; then the nearer side
      wins, marked `undecided`. With --threshold X the midpoint is X and sigma the endpoints' pooled seed spread.

   The endpoints pass with a one-sided paired t-test (scipy.stats.ttest_rel, p <= 0.01) of BAD against
   GOOD; when p is unclear (<= 0.2) both endpoints get more seeds before BAD is declared passing (Pinpoint
   adds repeats when a comparison is unknown).
4. Search over BAD's first-parent history: W workers test W commits per round, at the W points that split
   the unknown range into W+1 equal parts (ceil(log_{W+1} N) rounds). Skipped commits are
   handled as `git bisect skip` does: the nearest untested commit is tried instead, and when only skipped
   commits are left the answer is the list of commits the first bad one could be.
5. Every trial is an MLflow run (child of one `kind=bisect` run) tagged with a key of (tree hash, config
   hash, seed): a later bisect reuses it instead of training again.

The engine writes to MLflow only the trial cache: the parent `kind=bisect` run (its params, and its status
on the way out) and the trial runs under it with their cache tags. These are data the engine reads back
(`_Bisector._lookup` finds earlier trials by key), not reports: the report of a bisect (bisect.md,
bisect.json, bisect.png and the summary tags on the parent run) is written by bisect/report.py `publish`.
"""

from __future__ import annotations

import math
import os
import queue
import signal
import subprocess
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable, Sequence

from replaybisect.errors import GitError, ReplayError
from replaybisect.verbs.bisect.gitops import PrivateClone, UserRepo, clean_git_env
from replaybisect.verbs.bisect.trial_process import JobLauncher, Launcher, signal_group
from replaybisect.verbs.bisect.results import Baseline, BisectAborted, BisectResult, SeedRun, Trial
from replaybisect.verbs.bisect.runners import (CommandRunner, LAYER_METRICS, TRAIN_METRICS, TRIAL_THREADS,
    TrainRunner, content_hash, store_outside_repo, output_tail, absolute_tracking_uri, is_train_metric, tail_mean)
from replaybisect.verbs.bisect.search import Search, endpoint_baseline, judge
from replaybisect.verbs.bisect.numerics import first_changed_op

__all__ = ["BisectResult", "Trial", "SeedRun", "bisect", "Search", "Baseline", "judge", "endpoint_baseline", "BisectAborted"]
CRASH_RETRIES = 1  # a trial that crashed (exit 1) or was killed runs once more before its commit is skipped


class _Cancelled(Exception):
    """The bisect is being interrupted: a trial's result must not be used or cached."""


# ---------------------------------------------------------------------------------------------
# the bisector
# ---------------------------------------------------------------------------------------------
class _Bisector:
    def __init__(self, *, store, clone: PrivateClone, runner, history: list[str], subjects: dict[str, str],
                 parent_run_id: str, seeds: int, max_seeds: int, workers: int, threshold: float | None,
                 use_cache: bool, on_event: Callable[..., None], launcher: Launcher):
        self.store = store
        self.clone = clone
        self.runner = runner
        self.history = history
        self.subjects = subjects
        self.parent_run_id = parent_run_id
        self.seeds = seeds
        self.max_seeds = max_seeds
        self.workers = workers
        self.threshold = threshold
        self.use_cache = use_cache
        self.emit = on_event
        self.trees = clone.trees(history)
        self.free_worktrees: "queue.Queue[Path]" = queue.Queue()
        for worktree in clone.worktrees:
            self.free_worktrees.put(worktree)
        self.checked_out: dict[Path, str] = {}
        self.measured: dict[tuple[str, int], SeedRun] = {}
        self.in_flight: dict[tuple[str, int], threading.Event] = {}
        self.lock = threading.Lock()
        self.launcher = launcher
        self.processes: set = set()  # running trial processes (trial_process.PlainProcess / ForkedProcess)
        self.cancelled = threading.Event()
        self.n_runs = 0
        self.n_cached = 0
        self.stop_endpoint: set[str] = set()

    # ---- one (commit, seed) --------------------------------------------------------------
    def measure(self, sha: str, seed: int, worktree: Path) -> SeedRun:
        """The run of `sha` with `seed`: from this bisect, else from the MLflow cache, else trained now."""
        key = (sha, seed)
        while True:
            with self.lock:
                if key in self.measured:
                    return self.measured[key]
                if self.cancelled.is_set():
                    raise _Cancelled()
                event = self.in_flight.get(key)
                if event is None:
                    self.in_flight[key] = threading.Event()
                    break
            event.wait()  # another worker is measuring it; if that fails, this one tries
        try:
            run = self._lookup(sha, seed) if self.use_cache else None
            if run is None:
                run = self._execute(sha, seed, worktree)
            with self.lock:
                self.measured[key] = run
                if run.cached:
                    self.n_cached += 1
                else:
                    self.n_runs += 1
            self.emit("run", sha=sha, position=self.history.index(sha), seed=seed, run=run)
            return run
        finally:
            with self.lock:
                self.in_flight.pop(key).set()

    def cache_key(self, sha: str, seed: int) -> str:
        return content_hash([self.trees[sha], self.runner.config_hash, seed])[:40]

    def _lookup(self, sha: str, seed: int) -> SeedRun | None:
        key = self.cache_key(sha, seed)
        # the key is set last, once the trial's run is complete (_record): a tagged run is a finished trial
        found = self.store.search_runs(f"tags.`replaybisect.bisect_key` = '{key}'", max_results=1)
        if not found:
            return None
        cached = found[0]
        tags = cached.data.tags
        outcome = tags.get("replaybisect.bisect_outcome", "")
        metric = None
        if outcome == "ok":
            metric = tail_mean(self.store.metric_history(cached.info.run_id, self.runner.metric))
            if metric is None:  # trained, but without this --metric: training again would not log it either
                return SeedRun(seed, "skip", run_id=cached.info.run_id, cached=True,
                               detail=f"the run logged no `{self.runner.metric}` metric")
            if not math.isfinite(metric):
                return SeedRun(seed, "nonfinite", run_id=cached.info.run_id, cached=True,
                               detail=f"{self.runner.metric} is {metric}")
        return SeedRun(seed, outcome, metric=metric, run_id=cached.info.run_id, cached=True,
                       detail=tags.get("replaybisect.bisect_detail", ""))

    def _execute(self, sha: str, seed: int, worktree: Path) -> SeedRun:
        if self.cancelled.is_set():
            raise _Cancelled()
        env = self.trial_env(worktree, sha, seed)
        started = time.monotonic()
        for _ in range(1 + CRASH_RETRIES):
            # A session of its own: Ctrl-C reaches the bisect only, which stops its trials itself (cancel()).
            with self.lock:
                if self.cancelled.is_set():
                    raise _Cancelled()
                process = self.launcher.start(self.runner.command(worktree, seed, self.parent_run_id, sha), worktree, env)
                self.processes.add(process)
            try:
                returncode, stdout, stderr = process.communicate()
            finally:
                with self.lock:
                    self.processes.discard(process)
            if self.cancelled.is_set():
                raise _Cancelled()
            run, cacheable = self.runner.interpret(self.store, returncode, stdout, stderr, seed)
            if cacheable or run.outcome != "skip":
                break
            # a crash or a kill may be the machine's (a locked SQLite store, memory): try once more before `skip`
            self.emit("phase", text=f"  {sha[:10]} seed {seed}: {run.detail}; trying once more")
        run.seconds = time.monotonic() - started
        self._record(sha, run, cacheable, stdout, stderr, returncode)
        return run

    def trial_env(self, worktree: Path, sha: str, seed: int) -> dict[str, str]:
        """`sha` checked out in `worktree`, and the environment a trial of it runs with."""
        if self.checked_out.get(worktree) != sha:
            self.clone.checkout(worktree, sha)
            self.checked_out[worktree] = sha
        env = clean_git_env()  # a bisect started from a git hook must not point the trial's git at the user's repo
        env["PYTHONPATH"] = os.pathsep.join([str(worktree)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        # One intra-op thread per trial unless the user says otherwise: the workers are the parallelism, and
        # every trial (and every cached one) runs with the same thread count, so results stay comparable.
        env.setdefault("OMP_NUM_THREADS", TRIAL_THREADS)
        env.update({"PYTHONDONTWRITEBYTECODE": "1", "REPLAYBISECT_SHA": sha, "REPLAYBISECT_SEED": str(seed),
                    "REPLAYBISECT_WORKTREE": str(worktree), "MLFLOW_TRACKING_URI": self.store.uri})
        return env

    def _record(self, sha: str, run: SeedRun, cacheable: bool, stdout: str, stderr: str, returncode: int) -> None:
        """Tag the trial's MLflow run (creating one when the trial made none) with its cache key and outcome."""
        if run.run_id is None:
            run.run_id = self.store.create_run("bisect-trial", run_name=f"{sha[:10]} seed {run.seed}",
                                               parent_run_id=self.parent_run_id)
            self.store.log_text(run.run_id, f"$ exit status {returncode}\n--- stdout\n{output_tail(stdout)}\n--- stderr\n{output_tail(stderr)}",
                                "trial.log")
            self.store.finish_run(run.run_id, "ok" if run.outcome in ("good", "bad") else "crashed")
        tags = {"bisect_sha": sha, "bisect_tree": self.trees[sha], "bisect_config_hash": self.runner.config_hash,
                # a run that trained is remembered as trained: the metric is read again from it by each lookup
                "bisect_seed": run.seed, "bisect_outcome": "ok" if self.runner.mode == "train" and returncode == 0 else run.outcome,
                "bisect_detail": run.detail[:500],
                "bisect_exit_status": returncode}
        if run.metric is not None:
            tags["bisect_metric"] = repr(run.metric)
        if cacheable:  # written with the outcome, once the trial has finished: a keyed run is a complete trial
            tags["bisect_key"] = self.cache_key(sha, run.seed)
        self.store.set_tags(run.run_id, tags)

    # ---- worker jobs -------------------------------------------------------------------
    def with_worktree(self, job: Callable[[Path], object]):
        worktree = self.free_worktrees.get()
        try:
            return job(worktree)
        finally:
            self.free_worktrees.put(worktree)

    def _endpoint_job(self, sha: str, seed: int) -> SeedRun | None:
        def job(worktree: Path):
            if sha in self.stop_endpoint:  # already decided (BAD non-finite at an earlier seed)
                return None
            run = self.measure(sha, seed, worktree)
            if run.outcome in ("nonfinite", "skip"):
                self.stop_endpoint.add(sha)
            return run

        return self.with_worktree(job)

    def _candidate_job(self, sha: str, baseline: Baseline) -> tuple[str, list[SeedRun], float | None, float | None, str]:
        def job(worktree: Path):
            runs: list[SeedRun] = []
            good_sha, bad_sha = self.history[0], self.history[-1]
            for seed in self._seed_order(baseline):
                if baseline.mode == "paired" and seed not in baseline.good:
                    # pair an extra seed with both endpoints at that seed; a seed they cannot run is left out
                    good_run, bad_run = self.measure(good_sha, seed, worktree), self.measure(bad_sha, seed, worktree)
                    if good_run.outcome != "ok" or bad_run.outcome != "ok":
                        continue
                    with self.lock:
                        baseline.good[seed], baseline.bad[seed] = good_run.metric, bad_run.metric
                runs.append(self.measure(sha, seed, worktree))
                verdict, z, p, note = judge(baseline, runs, self.max_seeds)
                if verdict is not None:
                    return verdict, runs, z, p, note
            verdict, z, p, note = judge(baseline, runs, len(runs))
            return verdict or "skip", runs, z, p, note or "no seed could be paired with the endpoints"

        return self.with_worktree(job)

    def _seed_order(self, baseline: Baseline) -> list[int]:
        if baseline.mode == "cmd":
            return [0]
        if baseline.mode == "nonfinite":
            return list(baseline.bad_nonfinite_seeds)
        return list(range(self.max_seeds))

    # ---- orchestration -----------------------------------------------------------------
    def run(self) -> tuple[list[Trial], Baseline, Search]:
        good_sha, bad_sha = self.history[0], self.history[-1]
        n = len(self.history) - 1
        with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="bisect") as pool:
            self.pool = pool
            try:
                baseline, good_trial, bad_trial = self._endpoints(good_sha, bad_sha)
                trials = {0: good_trial, n: bad_trial}
                search = Search(n)
                self.emit("endpoints", baseline=baseline, good=good_trial, bad=bad_trial)
                while not search.done:
                    positions = search.next_round(self.workers)
                    self.emit("round", number=search.rounds, shas=[self.history[p] for p in positions], positions=positions)
                    futures = {self.pool.submit(self._candidate_job, self.history[p], baseline): p for p in positions}
                    for position, (verdict, runs, z, p_value, note) in self._gather(futures):
                        sha = self.history[position]
                        trial = Trial(sha, position, self.subjects.get(sha, ""), verdict, runs, search.rounds, z, p_value, note)
                        trials[position] = trial
                        search.record(position, verdict)
                        self.emit("trial", trial=trial)
            except BaseException:
                self.cancel()
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        return [trials[position] for position in sorted(trials)], baseline, search

    def _gather(self, futures: dict[Future, object]):
        """Yield (key, result) as futures finish; interruptible by Ctrl-C (short waits)."""
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
            for future in done:
                yield futures[future], future.result()

    def _endpoints(self, good_sha: str, bad_sha: str) -> tuple[Baseline, Trial, Trial]:
        n = len(self.history) - 1
        good_runs: dict[int, SeedRun] = {}
        bad_runs: dict[int, SeedRun] = {}
        if self.runner.mode == "cmd":
            seed_batches = [[0]]
        else:
            seed_batches = [list(range(self.seeds))]
            extra = self.seeds
            while seed_batches[-1][-1] + 1 < self.max_seeds:  # more seeds when the endpoints are unclear
                start = seed_batches[-1][-1] + 1
                seed_batches.append(list(range(start, min(start + extra, self.max_seeds))))
        self.emit("phase", text=f"verifying the endpoints: GOOD {good_sha[:10]} must pass, BAD {bad_sha[:10]} must fail")
        baseline = None
        for batch in seed_batches:
            futures = {}
            for seed in batch:  # seed-major order: both endpoints advance together
                futures[self.pool.submit(self._endpoint_job, good_sha, seed)] = (good_sha, seed)
                futures[self.pool.submit(self._endpoint_job, bad_sha, seed)] = (bad_sha, seed)
            for (sha, seed), run in self._gather(futures):
                if run is not None:
                    (good_runs if sha == good_sha else bad_runs)[seed] = run
            good_list = [good_runs[s] for s in sorted(good_runs)]
            bad_list = [bad_runs[s] for s in sorted(bad_runs)]
            if self.runner.mode == "cmd":
                baseline, error = self._cmd_baseline(good_list[0], bad_list[0], good_sha, bad_sha)
            else:
                baseline, error = endpoint_baseline(self.runner.metric, good_list, bad_list, self.threshold, good_sha, bad_sha)
            if error:
                raise ReplayError(error)
            if baseline is not None:
                break
            self.emit("phase", text="the endpoints are not clearly apart yet: more seeds for both")
        if baseline is None:
            raise ReplayError(f"GOOD {good_sha[:10]} and BAD {bad_sha[:10]} are not clearly apart after {self.max_seeds} seeds; "
                              "pass a BAD commit that fails more clearly, more --max-seeds, or --threshold")
        good_trial = Trial(good_sha, 0, self.subjects.get(good_sha, ""), "good", [good_runs[s] for s in sorted(good_runs)],
                           note="GOOD endpoint")
        bad_trial = Trial(bad_sha, n, self.subjects.get(bad_sha, ""), "bad", [bad_runs[s] for s in sorted(bad_runs)],
                          note="BAD endpoint", p=baseline.p_endpoints)
        return baseline, good_trial, bad_trial

    @staticmethod
    def _cmd_baseline(good: SeedRun, bad: SeedRun, good_sha: str, bad_sha: str) -> tuple[Baseline | None, str | None]:
        if good.outcome != "good":
            return None, f"GOOD {good_sha[:10]} does not pass --cmd ({good.detail}); pick a GOOD commit where it exits 0"
        if bad.outcome != "bad":
            return None, f"BAD {bad_sha[:10]} does not fail --cmd ({bad.detail}); pick a BAD commit where it exits 1-127 (not 125)"
        return Baseline("cmd", "exit status", p_endpoints=None, seeds=[0]), None

    def cancel(self) -> None:
        """Stop every running trial (its whole process group) and keep queued ones from starting."""
        self.cancelled.set()
        with self.lock:
            processes = list(self.processes)
        for process in processes:
            signal_group(process, signal.SIGINT)
        deadline = time.monotonic() + 10
        for process in processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_group(process, signal.SIGKILL)
                process.wait(timeout=10)
        # wake workers waiting on another worker's measurement
        with self.lock:
            for event in self.in_flight.values():
                event.set()


def _default_event(kind: str, **data) -> None:
    pass


# ---------------------------------------------------------------------------------------------
# the entry point
# ---------------------------------------------------------------------------------------------
def bisect(
    good: str,
    bad: str,
    *,
    repo: str | Path = ".",
    config_dir: str = "conf",
    config_name: str = "config",
    overrides: Sequence[str] = (),
    steps: int | None = None,
    metric: str = "loss",
    threshold: float | None = None,
    seeds: int = 3,
    max_seeds: int | None = None,
    workers: int = 1,
    cmd: str | None = None,
    tracking_uri: str | None = None,
    use_cache: bool = True,
    executor: str = "local",
    jobs=None,
    on_event: Callable[..., None] | None = None,
) -> BisectResult:
    """Find the first commit on BAD's first-parent history after GOOD that fails (see the module docstring)."""
    started = time.monotonic()
    emit = on_event or _default_event
    if workers < 1:
        raise ReplayError(f"--workers {workers}: must be at least 1")
    if seeds < 1:
        raise ReplayError(f"--seeds {seeds}: must be at least 1")
    max_seeds = max(seeds, max_seeds if max_seeds is not None else 3 * seeds)
    if steps is not None and steps < 1:
        raise ReplayError(f"--steps {steps}: must be at least 1")
    if Path(config_dir).is_absolute() or ".." in Path(config_dir).parts:
        raise ReplayError(f"--config-dir {config_dir}: must be relative to the repository root (it is read at each tried "
                          "commit), e.g. --config-dir conf")
    if cmd is not None and not cmd.strip():
        raise ReplayError("--cmd is empty; pass the command to run at each commit")
    if cmd is None and not is_train_metric(metric):
        raise ReplayError(f"--metric {metric!r} is not a metric `replay train` logs; choose one of {', '.join(TRAIN_METRICS)} "
                          f"or a layer's ({', '.join(prefix + 'LAYER' for prefix in LAYER_METRICS)})")

    # 1. Read-only questions to the user's repository: nothing is written there.
    user = UserRepo.open(repo)
    good_sha = user.resolve(good, "GOOD")
    bad_sha = user.resolve(bad, "BAD")
    if good_sha == bad_sha:
        raise GitError(f"GOOD and BAD are the same commit {good_sha[:10]}; pass a GOOD commit older than BAD")
    if not user.is_ancestor(good_sha, bad_sha):
        raise GitError(f"GOOD {good_sha[:10]} is not an ancestor of BAD {bad_sha[:10]}; "
                       "pass a GOOD commit that BAD's history contains (see `git log --graph`)")
    if cmd is None:  # each trial trains the config as the commit has it: one missing at an endpoint is bad input
        config_file = (Path(config_dir) / config_name).as_posix()
        config_file += "" if config_file.endswith((".yaml", ".yml")) else ".yaml"
        for sha, what in ((good_sha, "GOOD"), (bad_sha, "BAD")):
            if not user.has_file(sha, config_file):
                raise ReplayError(f"--config-dir {config_dir} --config-name {config_name}: {config_file} is not in {what} "
                                  f"{sha[:10]}; pass the config folder (relative to the repository root) and name it trains")

    # 2. Only now, with the input valid, the store (created when new).
    from replaybisect.store import open_store, resolve_tracking_uri

    store = open_store(store_outside_repo(absolute_tracking_uri(resolve_tracking_uri(tracking_uri)), user))
    runner = (CommandRunner(cmd) if cmd is not None else
              TrainRunner(config_dir=config_dir, config_name=config_name, overrides=overrides, steps=steps,
                          metric=metric, tracking_uri=store.uri))

    if executor == "submitit":  # each trial a job (core/jobs.py); its id said as it is queued, runs and ends
        launcher = JobLauncher(jobs, lambda job_id, state, trial: emit("job", job_id=job_id, state=state, trial=trial))
    else:  # its forkserver starts with the first trial run: a fully cached bisect never imports torch
        launcher = Launcher()

    # 3. A private clone in the cache, one worktree per worker; removed on the way out, Ctrl-C included.
    with PrivateClone(user, workers) as clone:
        history = [good_sha] + clone.first_parent_range(good_sha, bad_sha)
        subjects = clone.subjects(history)
        emit("start", history_length=len(history), workers=workers, good=good_sha, bad=bad_sha, mode=runner.mode,
             expected_rounds=math.ceil(math.log(max(len(history) - 1, 1), workers + 1)) if len(history) > 2 else 0)
        parent_run_id = store.create_run(
            "bisect", run_name=f"bisect {good_sha[:8]}..{bad_sha[:8]}",
            tags={"replaybisect.bisect_good": good_sha, "replaybisect.bisect_bad": bad_sha, "replaybisect.git_sha": bad_sha})
        store.log_params(parent_run_id, {
            "repo": str(user.path), "good": good_sha, "bad": bad_sha, "mode": runner.mode, "workers": workers,
            "seeds": seeds, "max_seeds": max_seeds, "metric": runner.metric, "threshold": threshold,
            "config_dir": config_dir, "config_name": config_name, "overrides": " ".join(overrides), "steps": steps,
            "cmd": cmd, "history_length": len(history), "executor": executor})
        bisector = _Bisector(store=store, clone=clone, runner=runner, history=history, subjects=subjects,
                             parent_run_id=parent_run_id, seeds=seeds if runner.mode == "train" else 1,
                             max_seeds=max_seeds if runner.mode == "train" else 1, workers=workers,
                             threshold=threshold, use_cache=use_cache, on_event=emit, launcher=launcher)
        try:
            trials, baseline, search = bisector.run()
            candidates = [history[position] for position in search.candidates()]
            first_bad = candidates[0] if len(candidates) == 1 else None
            commit = clone.commit_info(first_bad) if first_bad else None
            numerics = None
            if first_bad is not None and runner.mode == "train":
                last_good = history[history.index(first_bad) - 1]
                emit("phase", text=f"tracing the first step's ops at {last_good[:10]} and {first_bad[:10]}: what the commit changed in the numbers")
                numerics = first_changed_op(bisector, last_good, first_bad)
        except KeyboardInterrupt:
            store.finish_run(parent_run_id, "interrupted", "KILLED")
            raise
        except ReplayError as error:
            store.set_tags(parent_run_id, {"error": str(error)[:500]})
            store.finish_run(parent_run_id, "failed", "FAILED")
            raise
        except BaseException:
            store.finish_run(parent_run_id, "crashed", "FAILED")
            raise

    result = BisectResult(
        good=good_sha, bad=bad_sha, first_bad=first_bad, candidates=candidates, commit=commit, trials=trials,
        history_length=len(history), n_rounds=search.rounds, workers=workers, mode=runner.mode,
        metric_name=runner.metric, baseline=baseline, n_runs=bisector.n_runs, n_cached=bisector.n_cached,
        seconds=time.monotonic() - started, run_id=parent_run_id, repo=str(user.path), tracking_uri=store.uri, numerics=numerics)
    store.finish_run(parent_run_id, "ok")
    return result
