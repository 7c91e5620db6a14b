"""Where the held-out test data written by others lives (../shared/heldout, read in place, never
copied into the repository; see its README). Tests that need it skip when it is absent."""

from pathlib import Path

HELDOUT = Path(__file__).resolve().parents[2] / "shared" / "heldout"
