"""One folder per verb: command.py (parse, call, print), report.py (render, publish), engine.py (the work)."""
