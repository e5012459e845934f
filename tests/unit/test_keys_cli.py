"""`tokios keys` as a user meets it: without an action it prints its help with the exit status of
`tokios` without a command, and `keys list` on an empty store says that there are no keys (on
stderr, so that stdout stays the listing) and how to make one."""

from __future__ import annotations

import subprocess
import sys


def tokios(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokios.cli", *args], capture_output=True, text=True, timeout=120)


def keys(*args: str, db_dir) -> subprocess.CompletedProcess:
    """`tokios keys` on a store of its own (never the user's)."""
    return tokios("keys", "--db", str(db_dir / "gateway.db"), *args)


def test_keys_without_an_action_prints_help_like_tokios_without_a_command(tmp_path):
    bare = tokios()
    without_action = keys(db_dir=tmp_path)
    assert without_action.returncode == bare.returncode == 2
    assert "usage: tokios keys" in without_action.stdout
    for action in ("create", "list", "revoke"):
        assert action in without_action.stdout
    assert without_action.stderr == ""
    assert not (tmp_path / "gateway.db").exists()  # help touches no store


def test_keys_list_on_an_empty_store_says_so_and_a_created_key_is_listed(tmp_path):
    empty = keys("list", db_dir=tmp_path)
    assert empty.returncode == 0, empty.stderr
    assert empty.stdout == ""
    assert f"no keys in {tmp_path / 'gateway.db'}" in empty.stderr
    assert "tokios keys create" in empty.stderr

    as_json = keys("list", "--json", db_dir=tmp_path)
    assert as_json.returncode == 0 and as_json.stdout.strip() == "[]" and as_json.stderr == ""

    created = keys("create", "--name", "laptop", db_dir=tmp_path)
    assert created.returncode == 0, created.stderr
    listed = keys("list", db_dir=tmp_path)
    assert "name=laptop" in listed.stdout and "no keys" not in listed.stderr
