"""Runtime settings: which paths may be set, laying stored values over the file's, and why a
value is refused (the pydantic models of the configuration decide)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadmaster.common.config import Settings, load_settings
from loadmaster.common.errors import InvalidArgumentError
from loadmaster.common.runtime_config import (
    apply_overrides,
    differences,
    effective_values,
    merge_stored,
    resolve,
    value_at,
)


@pytest.fixture()
def settings(tmp_path: Path) -> Settings:
    config = tmp_path / "loadmaster.yaml"
    config.write_text(
        "models:\n"
        "  defaults: {max_inflight: 4}\n"
        "  known:\n"
        "    llama-3.1-8b: {vram_mb: 100}\n"
        "    small: {pin: true}\n"
        "  aliases:\n"
        "    chat: [llama-3.1-8b, small]\n"
        "tenants:\n"
        "  alice: {weight: 2}\n"
    )
    return load_settings(config)


def test_a_path_is_matched_by_its_most_specific_pattern_and_names_may_hold_dots() -> None:
    assert resolve("models.known.llama-3.1-8b.pin").parts == ("models", "known", "llama-3.1-8b", "pin")
    weight = resolve("tenants.team.a.weight")
    assert (weight.pattern, weight.parts) == ("tenants.*.weight", ("tenants", "team.a", "weight"))
    whole = resolve("tenants.team")
    assert whole.pattern == "tenants.*" and whole.removable
    with pytest.raises(
        InvalidArgumentError, match=r"'gateway.http_port' cannot be set at run time.*scheduler"
    ):
        resolve("gateway.http_port")
    with pytest.raises(InvalidArgumentError):
        resolve("models.known..pin")


def test_stored_values_lay_over_the_file_and_defaults_keep_applying(settings: Settings) -> None:
    merged = apply_overrides(
        settings,
        {
            "models.known.llama-3.1-8b.pin": True,
            "models.known.fresh.keep_alive_s": 30,
            "scheduler.strategy": "round_robin",
            "tenants.bob.weight": 0.5,
            "models.allow_cloud_fallback": False,
        },
    )
    model = merged.models.for_model("llama-3.1-8b")
    assert (model.pin, model.vram_mb, model.max_inflight) == (True, 100, 4)  # defaults still merged
    assert merged.models.for_model("fresh").keep_alive_s == 30
    assert merged.scheduler.strategy == "round_robin" and merged.tenants["bob"].weight == 0.5
    assert merged.models.allow_cloud_fallback is False and settings.models.allow_cloud_fallback is True
    assert merged.config_dir == settings.config_dir


def test_null_removes_a_whole_entry_but_is_a_value_for_a_field(settings: Settings) -> None:
    merged = apply_overrides(settings, {"models.aliases.chat": None, "models.known.small.keep_alive_s": None})
    assert "chat" not in merged.models.aliases
    assert merged.models.for_model("small").pin is True


def test_a_refused_value_names_its_path(settings: Settings) -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"tenants.alice.weight: Input should be greater than 0 \(got -1\)"
    ):
        apply_overrides(settings, {"tenants.alice.weight": -1})
    with pytest.raises(InvalidArgumentError, match=r"models\.allow_cloud_fallback"):
        apply_overrides(settings, {"models.allow_cloud_fallback": "maybe"})
    with pytest.raises(InvalidArgumentError, match="unknown model 'nowhere'"):
        apply_overrides(settings, {"models.aliases.other": ["nowhere"]})


def test_differences_name_what_the_stored_values_change(settings: Settings) -> None:
    stored = {"tenants.alice.weight": 3, "models.known.small.pin": True, "scheduler.strategy": "round_robin"}
    found = {(d.path, d.configured, d.stored) for d in differences(settings, stored)}
    assert found == {
        ("tenants.alice.weight", 2.0, 3),
        ("scheduler.strategy", "model_deadline", "round_robin"),
    }


def test_merge_keeps_the_good_values_and_reports_the_bad_ones(settings: Settings) -> None:
    merged, refused = merge_stored(settings, {"models.aliases.gone": ["nowhere"], "tenants.bob.weight": 2})
    assert merged.tenants["bob"].weight == 2 and "gone" not in merged.models.aliases
    assert list(refused) == ["models.aliases.gone"] and "nowhere" in refused["models.aliases.gone"]


def test_effective_values_expand_the_mappings(settings: Settings) -> None:
    values = effective_values(settings)
    assert values["models.known.small.pin"] is True
    assert values["models.aliases.chat"] == {"models": ["llama-3.1-8b", "small"], "pin_primary": False}
    assert values["tenants.alice.weight"] == 2.0 and values["models.allow_cloud_fallback"] is True
    assert value_at(settings, "models.known.absent.pin") is None
