"""Config: flags > KVMESH_* environment > TOML file > defaults; field docs in --help;
clear errors for bad values."""

from __future__ import annotations

import pytest

from kvmesh.services.common.config import ConfigError, load, parse_memory, parse_size
from kvmesh.services.conductor.config import ConductorConfig
from kvmesh.services.decode.server import DecodeConfig


def test_precedence_flags_env_toml_defaults(tmp_path):
    toml = tmp_path / "kvmesh.toml"
    toml.write_text('cluster = "from-toml"\nport = 7000\n[decode]\nmax_batch = 3\nlease_ttl = 7\n')
    env = {"KVMESH_PORT": "7001", "KVMESH_LEASE_TTL": "8"}
    cfg = load(DecodeConfig, ["--config", str(toml), "--lease-ttl", "9"], section="decode", env=env)
    assert cfg.cluster == "from-toml"  # TOML over default
    assert cfg.port == 7001  # env over TOML
    assert cfg.lease_ttl == 9  # flag over env
    assert cfg.max_batch == 3  # the service's own TOML section
    assert cfg.block_size == 256  # default


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--port", "70000"], "port: 70000 is not a TCP port"),
        (["--lease-ttl", "1"], "lease_ttl"),
        (["--dtype", "float16"], "dtype"),
        (["--model", "no-such-model"], "neither a preset"),
        (["--kv-memory", "lots"], "cannot read 'lots' as a size"),
        (["--block-size", "nope"], "block_size: cannot read 'nope' as int"),
    ],
)
def test_bad_values_raise_clear_errors(argv, fragment):
    with pytest.raises(ConfigError) as e:
        load(DecodeConfig, argv, env={})
    assert fragment in str(e.value)


def test_unknown_toml_key_is_an_error(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("ttft_slo = 5\n")
    with pytest.raises(ConfigError, match="unknown option"):
        load(ConductorConfig, ["--config", str(toml)], env={})


def test_help_lists_field_docs(capsys):
    with pytest.raises(SystemExit):
        load(ConductorConfig, ["--help"], env={})
    out = capsys.readouterr().out
    assert "--ttft-slo-ms" in out and "cluster TTFT SLO in ms" in out
    assert "env KVMESH_POLICY" in out


@pytest.mark.parametrize(
    "module,cls",
    [
        ("kvmesh.services.prefill.server", "PrefillConfig"),
        ("kvmesh.services.decode.server", "DecodeConfig"),
        ("kvmesh.services.conductor.config", "ConductorConfig"),
        ("kvmesh.services.store_master.server", "StoreMasterConfig"),
        ("kvmesh.services.store.node", "StoreNodeConfig"),
    ],
)
def test_every_service_help_renders(capsys, module, cls):
    """A help text with a literal % (``40%``) must not break argparse's formatting."""
    import importlib

    with pytest.raises(SystemExit) as e:
        load(getattr(importlib.import_module(module), cls), ["--help"], env={})
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--lease-ttl" in out
    if cls in ("PrefillConfig", "DecodeConfig"):
        assert "(40%)" in out and "--te-poll-us" in out


def test_sizes_and_memory_shares():
    assert parse_size("64MiB") == 64 << 20 and parse_size("2GB") == 2_000_000_000
    assert 0 < parse_memory("10%") < parse_memory("20%")
    with pytest.raises(ConfigError):
        parse_memory("95%")
