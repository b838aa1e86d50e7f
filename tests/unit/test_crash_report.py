"""An exception nobody caught, as `replay` reports it (replaybisect.cli._report_crash, in this process): whose frame
it came from decides what is shown, and the last line says what to do (e2e/test_cli_errors.py: bad input through the
installed `replay`)."""

from __future__ import annotations


def _caught(run, drop_caller_frames: int = 1) -> BaseException:
    try:
        run()
    except Exception as error:  # noqa: BLE001 - the point is to report any exception
        for _ in range(drop_caller_frames):  # this test's own frames are a user's; drop them where they are not the point
            error.__traceback__ = error.__traceback__.tb_next
        return error
    raise AssertionError("nothing was raised")


def _users_model():
    import torch

    return torch.zeros(2, 3) @ torch.zeros(2, 3)  # a shape bug in "user code" (this file), raised inside torch


def test_a_crash_below_user_code_shows_its_traceback_from_the_users_frame(capsys):
    from replaybisect.cli import _report_crash

    _report_crash(_caught(_users_model))
    stderr = capsys.readouterr().err.strip().splitlines()
    assert stderr[0].startswith("Traceback (from your code") and "test_crash_report.py" in stderr[1] and "_users_model" in stderr[1]
    assert stderr[-1].startswith("replay: error: your code raised RuntimeError: mat1 and mat2 shapes cannot be multiplied")
    assert "(test_crash_report.py:" in stderr[-1] and "in _users_model); fix it" in stderr[-1]


def test_a_crash_in_our_own_code_is_an_internal_error_to_report(capsys):
    from replaybisect.cli import _report_crash
    from replaybisect.core import rng

    _report_crash(_caught(lambda: rng._unsigned(None), drop_caller_frames=2))
    stderr = capsys.readouterr().err.strip().splitlines()
    assert stderr[0] == "Traceback (most recent call last):" and "rng.py" in stderr[-4]
    assert stderr[-1] == "replay: internal error: TypeError: Mersenne Twister words are not an int32 tensor; please report it with the traceback above"


def test_a_crash_in_a_library_with_no_user_frame_names_where_it_was_raised(capsys):
    import json

    from replaybisect.cli import _report_crash

    _report_crash(_caught(lambda: json.loads("{"), drop_caller_frames=2))
    stderr = capsys.readouterr().err.strip().splitlines()
    assert stderr[0] == "Traceback (most recent call last):"
    assert stderr[-1].startswith("replay: error: JSONDecodeError: Expecting property name") and "(raised in decoder.py:" in stderr[-1]


def test_a_crash_caused_by_running_out_of_memory_says_so_in_its_last_line(capsys):
    """A library may wrap a MemoryError (MLflow's SQL session does): the one line still says out of memory, which is
    what `replay watch` reads to report a triage that hit its --memory-mb."""
    import json

    from replaybisect.cli import _report_crash

    def wrapped():
        try:
            raise MemoryError()
        except MemoryError:
            json.loads("{")  # the library's own error, raised while handling it

    _report_crash(_caught(wrapped, drop_caller_frames=2))
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("replay: error: JSONDecodeError") and "(caused by MemoryError: out of memory)" in last, last
