"""The environment-variable registry: aliases, precedence, fail-fast parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from nccl_pg import env


def test_defaults_when_unset() -> None:
    assert env.STORE_TIMEOUT.get({}) == 300.0
    assert env.STORE_SECRET.get({}) is None
    assert env.USE_AGENT_STORE.get({}) is False


def test_torch_alias_and_precedence() -> None:
    assert env.USE_AGENT_STORE.get({"TORCHELASTIC_USE_AGENT_STORE": "True"}) is True
    both = {"NCCL_PG_USE_AGENT_STORE": "0", "TORCHELASTIC_USE_AGENT_STORE": "1"}
    assert env.USE_AGENT_STORE.get(both) is False  # our name wins


@pytest.mark.parametrize(
    "var, raw",
    [(env.USE_AGENT_STORE, "maybe"), (env.STORE_TIMEOUT, "abc"), (env.STORE_TIMEOUT, "-1"),
     (env.STORE_TIMEOUT, "inf"), (env.STORE_MAX_VALUE_SIZE, "0"), (env.STORE_MAX_VALUE_SIZE, "4294967295"),
     (env.STORE_MAX_VALUE_SIZE, "1.5")],
)
def test_invalid_values_fail_naming_the_variable(var: env.Var, raw: str) -> None:
    with pytest.raises(ValueError, match=f"{var.name}"):
        var.get({var.name: raw})
    with pytest.raises(ValueError, match=var.name):
        env.validate_all({var.name: raw})


def test_empty_value_means_unset() -> None:
    assert env.STORE_TIMEOUT.get({"NCCL_PG_STORE_TIMEOUT": "  "}) == 300.0


def test_every_variable_is_documented_and_prefixed() -> None:
    for var in env.ALL:
        assert var.name.startswith("NCCL_PG_") and var.doc


def test_every_variable_is_in_the_readme_table() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for var in env.ALL:
        assert f"| `{var.name}`" in readme, f"{var.name} missing from the README's environment table"
