"""The test suite; helpers shared by the tests live at this level, the tests mirror the source tree."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository
