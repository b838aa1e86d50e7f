"""The replay wing: a recorded run rebuilt at a snapshot and replayed (restore.py), a script's run replayed by running
the script again (script.py; the child that serves it: verbs/script_child.py), and the builds and steps that replay a
trainer's run without its trainer (lightning.py, hf.py)."""
