"""The recorder, the snapshot format, and RNG/determinism state."""
