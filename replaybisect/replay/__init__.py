"""Restore, probes and the verbs built on replay: nan, ablate, bisect, check, diagnose, watch."""
