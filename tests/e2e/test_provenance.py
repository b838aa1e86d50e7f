"""A run's signature: what picks code in a stored run is the recording user's, or nothing of it runs.

An attacker who can only write to the team's store rewrites a recorded script run's command line (a Hydra app's
`+hydra.callbacks...` that writes a file when Hydra starts, `hydra.run.dir`, flags, `+key` additions), its script's
path or its Hydra flag. Every verb that replays a stored run (`replay nan`, `ablate`, `check`, and `replay watch`)
refuses it in one line, exit 2, with nothing run: the payload's marker file never appears (it does when the payload
runs, so its absence means something), the user's folder is unchanged and no run is created. Behind the signature, a
run the user vouches for (--allow-unsigned) still gets its Hydra command line checked as data.
"""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import STORED_RUN_VERBS, Workspace, assert_one_line_error, folder_tree, record_script, sign_as_recorder
from replaybisect.core import provenance
from replaybisect.core.provenance import KEY_ENV, KEY_FILE_ENV, SIGNED_TAGS, Key, UnsignedRun
from replaybisect.errors import ReplayError, UntrustedConfig
from watch_servers import ALLOW_ROOT

RUN = "0123456789abcdef0123456789abcdef"
HYDRA_ARGS = ("lr=0.3",)  # diverges: inf at step 16
SCRIPT_ARGS = ("--optim=sgd", "--learning_rate=30", "--max_iters=30", "--eval_interval=4")  # NaN at step 9


# ---- the key and what it signs ---------------------------------------------------------------------------------
def _without_keys(monkeypatch, config_home: Path) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config_home))
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)


def test_the_key_is_made_once_on_first_use_readable_by_its_user_only(tmp_path, monkeypatch):
    _without_keys(monkeypatch, tmp_path / "config")
    with pytest.raises(ReplayError, match="does not exist yet .*record a run here"):
        provenance.signing_key()  # a replay makes no key: it would verify nothing
    code = "from replaybisect.core import provenance; print(provenance.signing_key(create=True).id)"
    starters = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(6)]
    ids = {starter.communicate(timeout=120)[0].strip() for starter in starters}
    assert len(ids) == 1 and all(starter.returncode == 0 for starter in starters), ids  # six recorders at once: one key
    key = tmp_path / "config" / "replaybisect" / "key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    assert list(key.parent.iterdir()) == [key]  # no temp file left
    assert provenance.signing_key().id == ids.pop()


def test_a_key_others_can_read_a_short_one_or_a_missing_team_file_is_one_line(tmp_path, monkeypatch):
    _without_keys(monkeypatch, tmp_path / "config")
    key = provenance.default_key_file()
    provenance.signing_key(create=True)
    key.chmod(0o644)
    with pytest.raises(ReplayError, match=r"can be read or written by other users \(mode 644\); run `chmod 600 "):
        provenance.signing_key()
    monkeypatch.setenv(KEY_ENV, "too short")
    with pytest.raises(ReplayError, match="is 9 bytes; use at least 16 random bytes"):
        provenance.signing_key()
    monkeypatch.delenv(KEY_ENV)
    monkeypatch.setenv(KEY_FILE_ENV, str(tmp_path / "team.key"))
    with pytest.raises(ReplayError, match=r"\$REPLAYBISECT_KEY_FILE=.*team.key does not exist"):
        provenance.signing_key(create=True)  # a team's file is given, never made
    (tmp_path / "team.key").write_text("a team secret of enough bytes\n")
    (tmp_path / "team.key").chmod(0o600)
    assert provenance.signing_key().secret == b"a team secret of enough bytes"


def test_the_signature_covers_the_run_its_config_and_each_tag_that_picks_code(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "the recording user's secret")
    key = provenance.signing_key()
    text, tags = "model:\n  _target_: own.Net\n", {name: f"value of {name}" for name in SIGNED_TAGS}
    signed = {**tags, "signature": provenance.signature(key, RUN, text, tags)}
    provenance.verify(RUN, text, signed)
    provenance.verify(RUN, text, {**signed, "status": "nonfinite", "first_nonfinite_step": "7"})  # data tags are free
    changes = [(RUN.replace("0", "1"), text, signed), (RUN, text + "#", signed)]
    changes += [(RUN, text, {**signed, name: "/elsewhere"}) for name in SIGNED_TAGS]
    for run_id, changed_text, changed_tags in changes:
        with pytest.raises(UnsignedRun, match="does not match its signature: its config.yaml or a tag that picks code"):
            provenance.verify(run_id, changed_text, changed_tags)
    with pytest.raises(UnsignedRun, match=f"carries no signature .*pass --allow-unsigned {RUN}"):
        provenance.verify(RUN, text, tags)
    provenance.verify(RUN, text, tags, unsigned_ok=(RUN,))  # the user vouches for this one run
    with pytest.raises(UnsignedRun, match="has a damaged signature tag"):
        provenance.verify(RUN, text, {**tags, "signature": "v0:x"})
    monkeypatch.setenv(KEY_ENV, "someone else's secret!")
    with pytest.raises(UnsignedRun, match=rf"was signed by another key \({key.id}; yours is .*set \$REPLAYBISECT_KEY_FILE"):
        provenance.verify(RUN, text, signed)
    assert Key(b"k" * 16, "").id != Key(b"k" * 17, "").id and len(key.id) == 16


# ---- a recorded script run, tampered ---------------------------------------------------------------------------
class Scripts:
    """A Hydra app's run and an argparse script's run (tests/user_loop), each in its own project folder."""

    def __init__(self, workspace: Workspace):
        self.workspace = workspace
        self.store = workspace.store()
        self.hydra_project, self.hydra_run = record_script(workspace, "hydra-app", "hydra_script.py", *HYDRA_ARGS,
                                                           expect="loss is inf at step 16")
        self.script_project, self.script_run = record_script(workspace, "argparse-script", "script_loop.py",
                                                             *SCRIPT_ARGS, expect="loss is nan at step 9")
        self.original = {run: self.store.read_artifact_text(run, "config.yaml") for run in (self.hydra_run, self.script_run)}
        self.signature = {run: self.store.tags(run)["signature"] for run in (self.hydra_run, self.script_run)}
        self.marker = workspace.path / "MARKER"

    def project(self, run_id: str) -> Path:
        return self.hydra_project if run_id == self.hydra_run else self.script_project

    def tamper(self, run_id: str, **script) -> None:
        """What an attacker with write access to the store does: rewrite the stored train.script."""
        config = yaml.safe_load(self.original[run_id])
        config["train"]["script"].update(script)
        self.store.log_text(run_id, yaml.safe_dump(config), "config.yaml")

    def restore(self, run_id: str) -> None:
        self.store.log_text(run_id, self.original[run_id], "config.yaml")
        self.store.set_tags(run_id, {"signature": self.signature[run_id]})

    def payload(self, marker: Path | None = None) -> list[str]:
        """Hydra builds its callbacks before the app's first line: this one writes the marker file."""
        target = str(marker or self.marker)
        return ["+hydra.callbacks.pwn._target_=pathlib.Path.write_text",
                f"+hydra.callbacks.pwn._args_=[{{_target_:pathlib.Path,_args_:['{target}']}},'pwned']"]

    def runs(self) -> int:
        return len(self.store.search_runs(max_results=1000))


@pytest.fixture(scope="module")
def scripts(tmp_path_factory) -> Scripts:
    return Scripts(Workspace(tmp_path_factory.mktemp("provenance")))


@pytest.fixture(autouse=True)
def fresh(request):
    if "scripts" in request.fixturenames:
        scripts = request.getfixturevalue("scripts")
        scripts.marker.unlink(missing_ok=True)
        yield
        for run_id in (scripts.hydra_run, scripts.script_run):
            scripts.restore(run_id)
    else:
        yield


def test_the_payload_runs_when_hydra_starts_the_app_with_it(scripts, tmp_path):
    """The control: the argv the attacker writes does run code when given to the app, so no marker below means
    nothing ran."""
    marker = tmp_path / "CONTROL"
    done = subprocess.run([sys.executable, "train.py", *HYDRA_ARGS, "steps=2", *scripts.payload(marker)],
                          cwd=scripts.hydra_project, capture_output=True, text=True, timeout=300, env=scripts.workspace.env())
    assert marker.read_text() == "pwned", done.stderr[-2000:]


VERBS = STORED_RUN_VERBS


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_a_hydra_apps_tampered_command_line_runs_nothing(scripts, verb):
    run_id, project = scripts.hydra_run, scripts.hydra_project
    scripts.tamper(run_id, args=[*HYDRA_ARGS, *scripts.payload()])
    before, runs = folder_tree(project), scripts.runs()
    refused = Workspace(project).replay(*VERBS[verb], run_id, env=scripts.workspace.env())
    assert_one_line_error(refused, f"run {run_id} does not match its signature", "nothing of it is run")
    vouched = Workspace(project).replay(*VERBS[verb], run_id, "--allow-unsigned", run_id, env=scripts.workspace.env())
    assert vouched.returncode == 2 and "Traceback" not in vouched.stderr, vouched.stderr
    if verb != "check":  # (check refuses a script's run before it reads the command line)
        assert_one_line_error(vouched, "with the argument '+hydra.callbacks.pwn._target_=pathlib.Path.write_text'",
                              "Hydra's own settings", "nothing was run")
    assert not scripts.marker.exists() and folder_tree(project) == before and scripts.runs() == runs


def test_the_store_cannot_pick_another_script_or_say_a_hydra_app_is_none(scripts):
    import replaybisect as rb

    run_id, project = scripts.hydra_run, scripts.hydra_project
    (project / "other.py").write_text(f"open({str(scripts.marker)!r}, 'w').write('ran')\n")
    try:
        for change, refusal in (({"path": str(project / "other.py")}, "it is not the script the run recorded"),
                                ({"hydra": False}, "it is a @hydra.main app, but its stored train.script says it is not one")):
            scripts.tamper(run_id, **change)
            with pytest.raises(UnsignedRun, match="does not match its signature"):
                rb.find_nan(run_id, tracking_uri=scripts.workspace.tracking_uri, publish=False)
            with pytest.raises(ReplayError, match=refusal):
                rb.find_nan(run_id, tracking_uri=scripts.workspace.tracking_uri, publish=False, allow_unsigned=run_id)
        assert not scripts.marker.exists()
    finally:
        (project / "other.py").unlink()


def test_allow_unsigned_names_the_run_replayed(scripts):
    other = "f" * 32
    refused = scripts.workspace.replay("nan", "--run-id", scripts.hydra_run, "--allow-unsigned", other)
    assert_one_line_error(refused, f"--allow-unsigned '{other}' is not the run replayed ({scripts.hydra_run})")


def test_a_watcher_tags_a_run_it_cannot_verify_untrusted_and_runs_nothing(scripts):
    run_id = scripts.hydra_run
    scripts.tamper(run_id, args=[*HYDRA_ARGS, *scripts.payload()])
    others = [run.info.run_id for run in scripts.store.search_runs(max_results=1000) if run.info.run_id != run_id]
    for other in others:  # this test's run is the only one waiting for triage
        scripts.store.set_tags(other, {"triage": "done"})
    before = folder_tree(scripts.hydra_project)
    try:
        result = Workspace(scripts.hydra_project).replay("watch", "--once", *ALLOW_ROOT, "--json", "--settle", "0.2",
                                                         env=scripts.workspace.env())
        assert result.returncode == 0, result.stderr
        tags = scripts.store.tags(run_id)
        assert tags["triage"] == "untrusted" and "does not match its signature" in tags["triage.reason"], tags
        assert not scripts.marker.exists() and folder_tree(scripts.hydra_project) == before
    finally:
        for other in [*others, run_id]:
            for key in [key for key in scripts.store.tags(other) if key.startswith("triage")]:
                scripts.store.client.delete_tag(other, "replaybisect." + key)


def test_a_team_watcher_triages_its_teams_runs_and_no_others(workspace):
    """The recorders and the watcher hold the team's key; a run signed with a member's own key is not the team's."""
    store = workspace.store()
    team, own = {KEY_ENV: "the team's shared secret"}, {KEY_ENV: "a member's own secret"}
    runs = {}
    for name, key in (("team", team), ("own", own)):
        runs[name] = store.create_run("train")
        store.log_metrics(runs[name], [("loss", 2.0 - step * 0.01, step) for step in range(30)])
        store.log_text(runs[name], "train:\n  steps: 30\n", "config.yaml")
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(KEY_ENV, key[KEY_ENV])
            sign_as_recorder(store, runs[name])
        store.finish_run(runs[name], "crashed", "FAILED")
    result = workspace.replay("watch", "--once", *ALLOW_ROOT, "--json", "--settle", "0.2", env=workspace.env(**team))
    assert result.returncode == 0, result.stderr
    assert store.tags(runs["team"])["triage"] == "done", store.tags(runs["team"])
    assert store.tags(runs["own"])["triage"] == "untrusted"
    assert "was signed by another key" in store.tags(runs["own"])["triage.reason"]
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert any(event["event"] == "untrusted" and event.get("run_id") == runs["own"] for event in events), events


# ---- generated command lines (hypothesis) ------------------------------------------------------------------------
HYDRA_KEYS = ("callbacks.x._target_", "callbacks.x._args_", "run.dir", "sweep.dir", "sweep.subdir", "output_subdir",
              "job.chdir", "job.name", "job.env_set.PYTHONPATH", "job_logging.handlers.file.filename", "searchpath",
              "runtime.output_dir", "verbose", "mode", "launcher._target_", "sweeper._target_", "overrides.task")
HYDRA_GROUPS = ("launcher", "sweeper", "job_logging", "hydra_logging", "callbacks", "env", "help", "output")
FLAGS = ("--multirun", "-m", "--config-dir=/tmp", "-cd", "--config-path=/", "-cp", "--experimental-rerun",
         "--info", "--cfg", "job", "--shell-completion", "-sc", "--package", "--resolve", "--run", "-r", "-c",
         "--version", "-h", "--hydra-help", "--config-name=../../etc/x", "-cn", "/abs/config")
PATHS = ("/tmp/replaybisect-tamper", "../outside", "~/.bashrc", "/etc/passwd")
prefixes = st.sampled_from(["", "+", "++", "~"])
hydra_override = st.one_of(
    st.builds(lambda p, k, v: f"{p}hydra.{k}={v}", prefixes, st.sampled_from(HYDRA_KEYS), st.sampled_from(PATHS)),
    st.builds(lambda p, g, v: f"{p}hydra/{g}={v}", prefixes, st.sampled_from(HYDRA_GROUPS), st.sampled_from(("basic", "none", "x"))),
)
addition = st.builds(lambda p, k, v: f"{p}{k}={v}", st.sampled_from(["+", "++"]),
                     st.from_regex(r"\A[a-z][a-z0-9_]{0,8}(\.[a-z][a-z0-9_]{0,5})?\Z").filter(lambda k: k.split(".")[0] not in ("lr", "steps")),
                     st.sampled_from(PATHS))
dangerous = st.one_of(hydra_override, addition, st.sampled_from(FLAGS), st.sampled_from([f"lr=${{oc.env:HOME}}"]))
path_argument = st.builds(lambda flag, path: f"{flag}={path}", st.sampled_from(["--out_dir", "--data", "--init_from"]),
                          st.sampled_from(PATHS))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], derandomize=True)
@given(data=st.data())
def test_generated_tampered_command_lines_write_nothing_and_run_no_unrecorded_code(scripts, monkeypatch, data):
    import replaybisect as rb

    run_id = data.draw(st.sampled_from([scripts.hydra_run, scripts.script_run]), label="run")
    recorded = list(HYDRA_ARGS if run_id == scripts.hydra_run else SCRIPT_ARGS)
    added = data.draw(st.lists(st.one_of(dangerous, path_argument) if run_id == scripts.script_run else dangerous,
                               min_size=1, max_size=3), label="added")
    at = data.draw(st.integers(0, len(recorded)), label="at")
    scripts.tamper(run_id, args=[*recorded[:at], *added, *recorded[at:]])
    project = scripts.project(run_id)
    before, runs = folder_tree(project), scripts.runs()
    monkeypatch.chdir(project)
    with pytest.raises(UnsignedRun, match="does not match its signature"):
        rb.find_nan(run_id, tracking_uri=scripts.workspace.tracking_uri, publish=False)
    if run_id == scripts.hydra_run:  # vouched for, the command line is still data
        with pytest.raises(UntrustedConfig, match="refused .*nothing was run"):
            rb.find_nan(run_id, tracking_uri=scripts.workspace.tracking_uri, publish=False, allow_unsigned=run_id)
    assert folder_tree(project) == before and scripts.runs() == runs
    assert not scripts.marker.exists() and not Path("/tmp/replaybisect-tamper").exists()
    scripts.restore(run_id)


def test_a_run_recorded_before_signing_replays_only_when_the_user_names_it(scripts, monkeypatch):
    import replaybisect as rb

    run_id = scripts.hydra_run
    scripts.store.client.delete_tag(run_id, "replaybisect.signature")  # as every run recorded before signing
    monkeypatch.chdir(scripts.hydra_project)
    with pytest.raises(UnsignedRun, match=f"carries no signature .*pass --allow-unsigned {run_id}"):
        rb.find_nan(run_id, tracking_uri=scripts.workspace.tracking_uri, publish=False)
    report = rb.find_nan(run_id, tracking_uri=scripts.workspace.tracking_uri, publish=False, allow_unsigned=run_id)
    assert (report.reproduced, report.failing_step) == ("exact", 16), report.headline


def test_a_watcher_without_a_key_does_not_start(workspace, tmp_path):
    """It could verify no run: one line at start (exit 2), never every run tagged untrusted for want of a key."""
    env = workspace.env(XDG_CONFIG_HOME=str(tmp_path / "no-config"))
    assert_one_line_error(workspace.replay("watch", "--once", *ALLOW_ROOT, env=env), "signing key", "does not exist",
                          "$REPLAYBISECT_KEY_FILE")
    assert not (workspace.path / "mlflow.db").exists() or not workspace.store().search_runs()
