"""The commit a run records is the one it started from (`dpmix_jax.checkout`)."""

from __future__ import annotations

import os
import subprocess

from dpmix_jax import checkout


def test_a_pinned_commit_outlives_changes_to_the_tree_until_the_run_ends(monkeypatch):
    monkeypatch.delenv(checkout.PINNED_ENV, raising=False)
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    live = checkout.commit()
    assert live is not None and live.startswith(head)
    with checkout.pinned_commit():
        assert checkout.commit() == live
        monkeypatch.setattr(checkout, "_read_commit", lambda: "0000000+modified")
        assert checkout.commit() == live  # the tree changed; the run still names its start
        with checkout.pinned_commit():  # a nested run (or a child process) keeps the pin
            assert checkout.commit() == live
        assert os.environ[checkout.PINNED_ENV] == live
    assert checkout.PINNED_ENV not in os.environ
    assert checkout.commit() == "0000000+modified"  # a later run reads the tree afresh


def test_a_parent_process_pin_is_inherited(monkeypatch):
    monkeypatch.setenv(checkout.PINNED_ENV, "abc1234")
    with checkout.pinned_commit():
        assert checkout.commit() == "abc1234"
    assert os.environ[checkout.PINNED_ENV] == "abc1234"  # not the run's to remove
    monkeypatch.setenv(checkout.PINNED_ENV, "")  # pinned outside a git checkout
    assert checkout.commit() is None
