"""`python -m pipeline --help` offers what a user picks, and nothing Hydra applies on its own."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def _help(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "pipeline", "--help", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_help_lists_the_option_files_marks_the_chosen_ones_and_prints_the_composed_config():
    out = _help("env=atari", "workers=process")
    groups, config = out.split("== Config ==")
    assert "base_" not in groups and "specialize:" not in groups and "bench" not in groups
    for group in ("env:", "workers:", "server:", "trainer:", "transport:", "chunking:", "logger:"):
        assert f"\n{group}\n" in groups, group
    assert "  * atari " in groups and "  * process " in groups and "    cartpole " in groups
    assert "id: ALE/Pong-v5" in config and "hydra:" not in config
    assert "--hydra-help" in groups


def test_a_bad_override_in_help_is_still_one_config_error_line():
    done = subprocess.run([sys.executable, "-m", "pipeline", "--help", "env=nope"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().startswith("config error:"), done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1
