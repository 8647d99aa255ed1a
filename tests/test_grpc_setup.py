"""client/grpc_setup.py: the `tritium` command and the benchmarks turn grpc's EventEngine client off
before grpc is imported, leave a user's GRPC_EXPERIMENTS alone, and keep the setting out of the
tritonserver they start. Each case runs in a fresh interpreter (grpc reads the variable once)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tritium.client import grpc_setup

PROBE = """
import json, os, sys
from tritium.client import grpc_setup
{before}
applied = grpc_setup.apply()
print(json.dumps({{"applied": applied, "env": os.environ.get("GRPC_EXPERIMENTS"),
                   "server": grpc_setup.server_environment(dict(os.environ)).get("GRPC_EXPERIMENTS")}}))
"""


def probe(before: str = "", **env) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("GRPC_EXPERIMENTS", grpc_setup.KEEP_ENV)}
    e.update(env)
    out = subprocess.run([sys.executable, "-c", PROBE.format(before=before)], env=e, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_sets_the_client_experiments_before_grpc_and_not_for_the_server():
    r = probe()
    assert r == {"applied": True, "env": "-event_engine_client,-event_engine_for_all_other_endpoints", "server": None}


def test_a_users_setting_wins_and_reaches_the_server():
    r = probe(GRPC_EXPERIMENTS="-event_engine_listener")
    assert r == {"applied": False, "env": "-event_engine_listener", "server": "-event_engine_listener"}


def test_opt_out_and_too_late():
    assert probe(TRITIUM_GRPC_EVENT_ENGINE="1") == {"applied": False, "env": None, "server": None}
    # grpc already imported: it has read its experiments, so setting them now would only mislead
    assert probe(before="import grpc") == {"applied": False, "env": None, "server": None}


def test_bad_opt_out_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(grpc_setup.KEEP_ENV, "yes")
    with pytest.raises(ValueError, match="TRITIUM_GRPC_EVENT_ENGINE must be 0 or 1, got 'yes'"):
        grpc_setup.apply()
