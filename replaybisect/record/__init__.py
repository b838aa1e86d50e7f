"""The recording wing: everything that writes a run while it trains.

  session.py    a run's life: created with its tags, its config, the hooks, its end (FINISHED, FAILED, KILLED)
  hooks.py      the loop hooks that record each step: metrics, layer statistics, snapshots with their batches
  recorder.py   `replaybisect.Recorder`, for a loop you wrote yourself
  lightning.py  `replaybisect.lightning.ReplayCallback`, for a Lightning Trainer (and the step its replays run)

The step itself (its moments, the non-finite rules, halting before the update) is the core's, shared with every
replay: core/step_watch.py, core/loop.py, core/user_step.py.
"""
