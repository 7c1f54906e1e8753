"""`loadmaster keys` makes credentials the gateway accepts."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
import zmq
from typer.testing import CliRunner

from loadmaster.cli.keys_cmd import app
from loadmaster.common.config import load_settings
from loadmaster.common.credentials import Credentials, Identity
from loadmaster.common.gateway_config import ApiKeySettings, CurveSettings
from loadmaster.common.internal_auth import credentials_from_settings
from loadmaster.gateway.auth import ADMIN, Authenticator


def test_api_key_entry_is_accepted_and_holds_no_secret() -> None:
    result = CliRunner().invoke(
        app, ["api", "--name", "ops", "--scope", "infer", "--scope", "admin", "--json"]
    )
    assert result.exit_code == 0, result.output
    printed = json.loads(result.output)
    entry = ApiKeySettings.model_validate(printed["entry"])
    assert printed["key"] not in json.dumps(printed["entry"])
    assert Authenticator([entry]).authorize(printed["key"], ADMIN) == "ops"
    yaml_result = CliRunner().invoke(app, ["api", "--name", "bot", "--rate-per-s", "5"])
    assert yaml_result.exit_code == 0
    config = yaml.safe_load(yaml_result.output.split("\n", 1)[1])
    assert ApiKeySettings.model_validate(config["gateway"]["auth"]["api_keys"][0]).rate_per_s == 5
    bad = CliRunner().invoke(app, ["api", "--name", "x", "--scope", "root"])
    assert bad.exit_code != 0


def test_curve_pair_is_valid_and_yaml_safe() -> None:
    result = CliRunner().invoke(app, ["curve"])
    assert result.exit_code == 0
    pair = yaml.safe_load(result.output)
    assert zmq.curve_public(pair["secret_key"].encode()).decode() == pair["public_key"]
    assert CurveSettings(server_secret_key=pair["secret_key"]).enabled


def test_an_internal_identity_key_is_accepted_as_its_identity_only(tmp_path: Path) -> None:
    (tmp_path / "internal.secret").write_text("0123456789abcdef0123456789abcdef\n")
    config = tmp_path / "loadmaster.yaml"
    config.write_text("internal_auth:\n  secret_file: internal.secret\n")
    result = CliRunner().invoke(app, ["internal", "--identity", "trainer/job-7", "--config", str(config)])
    assert result.exit_code == 0, result.output
    job = Credentials.from_identity_key(result.output)
    suite = credentials_from_settings(load_settings(config), Identity("gpu-broker", "b1"))
    assert suite is not None
    method = "/loadmaster.v1.GpuBrokerService/Release"
    assert suite.verify_call(dict(job.call_metadata(method)), method) == Identity("trainer", "job-7")
    bare = tmp_path / "bare.yaml"
    bare.write_text("log_level: INFO\n")
    refused = CliRunner().invoke(app, ["internal", "--identity", "trainer/job-7", "--config", str(bare)])
    assert refused.exit_code != 0
