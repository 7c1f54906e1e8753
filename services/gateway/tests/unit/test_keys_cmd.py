"""`loadmaster keys` makes credentials the gateway accepts."""

from __future__ import annotations

import json

import yaml
import zmq
from typer.testing import CliRunner

from loadmaster.cli.keys_cmd import app
from loadmaster.common.config import ApiKeySettings, CurveSettings
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
