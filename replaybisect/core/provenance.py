"""Who recorded a run: a signature over what picks the code a replay runs.

Anyone who can write to a tracking store can rewrite a run's `config.yaml` and its tags, and those pick code: the
`_target_`s, a script's path, its arguments and folder, the folder modules import from. So the recorder signs them
with a key only the recording user holds (an HMAC-SHA256 of the run id, the config.yaml text and the tags in
SIGNED_TAGS), and a replay runs nothing of a run whose signature does not verify with the replaying user's key.

The key: $REPLAYBISECT_KEY (the secret itself), else the file $REPLAYBISECT_KEY_FILE, else `replaybisect/key` in the
user's config folder ($XDG_CONFIG_HOME, default ~/.config), created on first use with mode 0600. A team shares one
key (the recorders and the watcher given the same secret) so that every member's runs verify everywhere.
Light: no torch, no MLflow.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from replaybisect.errors import ReplayError, UntrustedConfig

KEY_ENV = "REPLAYBISECT_KEY"
KEY_FILE_ENV = "REPLAYBISECT_KEY_FILE"
SIGNATURE_TAG = "signature"  # replaybisect.signature = "v1:<key id>:<hmac hex>"
# The tags a replay reads that pick code or a command it prints: the import folder, the hashes of the user's files, the
# `replay train` arguments. Every other tag is a number or a word a replay parses as data.
SIGNED_TAGS = ("code_dir", "source_sha256", "config_dir", "config_name", "overrides")
VERSION = "v1"
SHORTEST_KEY = 16  # bytes of secret: a shorter one can be guessed


class UnsignedRun(UntrustedConfig):
    """A run whose signature is missing or does not verify with this user's key: nothing of it is run."""


@dataclass(frozen=True)
class Key:
    secret: bytes
    where: str  # for messages: "$REPLAYBISECT_KEY", or the key file's path

    @property
    def id(self) -> str:
        """A fingerprint that names the key without revealing it (a run says which key signed it)."""
        return hashlib.sha256(b"replaybisect key id\0" + self.secret).hexdigest()[:16]


def default_key_file() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "replaybisect" / "key"


def signing_key(create: bool = False) -> Key:
    """This user's key (see the module's docstring). `create`: make the default key file when there is none (a
    recorder does; a replay with no key has nothing to verify with and says so)."""
    secret = os.environ.get(KEY_ENV)
    if secret is not None:
        return _checked(secret.strip().encode(), f"${KEY_ENV}")
    named = os.environ.get(KEY_FILE_ENV)
    path = Path(named).expanduser() if named else default_key_file()
    if not named and create and not path.exists():
        _create(path)
    return _checked(_read(path, named is not None), str(path))


def _checked(secret: bytes, where: str) -> Key:
    if len(secret) < SHORTEST_KEY:
        raise ReplayError(f"the signing key in {where} is {len(secret)} bytes; use at least {SHORTEST_KEY} random bytes "
                          "(e.g. `python -c \"import secrets; print(secrets.token_hex(32))\"`)")
    return Key(secret, where)


def _read(path: Path, named: bool) -> bytes:
    source = f"${KEY_FILE_ENV}={path}" if named else str(path)
    try:
        mode = path.stat().st_mode
        if not stat.S_ISREG(mode):
            raise ReplayError(f"the signing key {source} is not a file; point ${KEY_FILE_ENV} at the key file")
        if mode & 0o077:
            raise ReplayError(f"the signing key {source} can be read or written by other users (mode {stat.S_IMODE(mode):o}); "
                              f"run `chmod 600 {path}` (anyone who reads it can sign runs as you)")
        return path.read_bytes().strip()
    except FileNotFoundError:
        what = "does not exist" if named else "does not exist yet (it is made when you first record a run)"
        raise ReplayError(f"the signing key {source} {what}; record a run here, or set ${KEY_FILE_ENV} to your "
                          "team's key file") from None
    except OSError as error:
        raise ReplayError(f"cannot read the signing key {source}: {error.strerror or error}") from None


def _create(path: Path) -> None:
    """A new random key, mode 0600, made whole or not at all: two recorders starting at once agree on one key."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    temp = path.with_name(f".key.{os.getpid()}.{secrets.token_hex(4)}")
    descriptor = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "w") as handle:
            handle.write(secrets.token_hex(32) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(temp, path)  # fails if another process made it first: theirs is the key
        except FileExistsError:
            pass
    finally:
        temp.unlink(missing_ok=True)


def _message(run_id: str, config_text: str, tags: Mapping[str, str]) -> bytes:
    signed = {name: str(tags.get(name, "")) for name in SIGNED_TAGS}
    return json.dumps({"v": VERSION, "run": run_id, "config_sha256": hashlib.sha256(config_text.encode()).hexdigest(),
                       "tags": signed}, sort_keys=True).encode()


def signature(key: Key, run_id: str, config_text: str, tags: Mapping[str, str]) -> str:
    """The value of the run's signature tag. `tags`: the run's replaybisect tags without the prefix."""
    mac = hmac.new(key.secret, _message(run_id, config_text, tags), hashlib.sha256).hexdigest()
    return f"{VERSION}:{key.id}:{mac}"


def verify(run_id: str, config_text: str, tags: Mapping[str, str], unsigned_ok: tuple[str, ...] = ()) -> None:
    """Nothing when the run's signature verifies with this user's key, or when the user vouched for this run with
    --allow-unsigned; else UnsignedRun in one line saying what is wrong and what to do."""
    if run_id in unsigned_ok:
        return
    stored = str(tags.get(SIGNATURE_TAG, "") or "")
    if not stored:
        raise UnsignedRun(f"run {run_id} carries no signature (replaybisect.signature), so nothing of it is run here; if "
                          "you know its config.yaml and tags are as recorded (a run recorded before runs were signed), "
                          f"pass --allow-unsigned {run_id}")
    parts = stored.split(":")
    if len(parts) != 3 or parts[0] != VERSION:
        raise UnsignedRun(f"run {run_id} has a damaged signature tag, so nothing of it is run here; record the run again")
    key = signing_key()
    if not hmac.compare_digest(parts[1], key.id):
        raise UnsignedRun(f"run {run_id} was signed by another key ({_shown(parts[1])}; yours is {key.id}, {key.where}), "
                          f"so nothing of it is run here; if it is your team's run, set ${KEY_FILE_ENV} (or ${KEY_ENV}) "
                          "to the team's key")
    if not hmac.compare_digest(stored, signature(key, run_id, config_text, tags)):
        raise UnsignedRun(f"run {run_id} does not match its signature: its config.yaml or a tag that picks code "
                          f"({', '.join(SIGNED_TAGS)}) was changed after it was recorded, so nothing of it is run here; "
                          "record the run again")


def _shown(text: str) -> str:
    return "".join(c if c.isalnum() else "?" for c in text[:16])
