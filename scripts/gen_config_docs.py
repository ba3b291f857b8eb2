"""Writes docs/configuration.md from the services' config dataclasses.

    python scripts/gen_config_docs.py           # regenerate docs/configuration.md
    python scripts/gen_config_docs.py --check   # exit 1 when the committed file is stale
    python scripts/gen_config_docs.py --stdout  # print it instead

Every row comes from a field declared with ``option(default, help)`` (see
``kvmesh.services.common.config``): the flag, the ``KVMESH_*`` variable and the TOML key
are derived from the field's name exactly as ``config.load`` derives them, the default is
the field's default and the doc line is its help text. ``tests/test_docs.py`` renders
the page in memory and compares it with the committed file.

Importing the prefill and decode configs imports torch (their modules load the engine).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "configuration.md"
COMMAND = "python scripts/gen_config_docs.py"


@dataclasses.dataclass(frozen=True)
class Section:
    """One table: a config class, the command that reads it and its TOML section."""

    title: str  # also the link target: GitHub's anchor of "## conductor" is #conductor
    cls: type
    command: str | None
    toml_section: str | None
    intro: str


def sections() -> list[Section]:
    from kvmesh.services.common.settings import ServiceConfig
    from kvmesh.services.conductor.config import ConductorConfig
    from kvmesh.services.decode.server import DecodeConfig
    from kvmesh.services.node_config import NodeConfig
    from kvmesh.services.prefill.server import PrefillConfig
    from kvmesh.services.store.node import StoreNodeConfig
    from kvmesh.services.store_master.config import StoreMasterConfig

    return [
        Section(
            "Every service",
            ServiceConfig,
            None,
            None,
            "Cluster membership (etcd), addresses, TLS, logging and metrics; "
            "every service takes these options.",
        ),
        Section(
            "Model nodes",
            NodeConfig,
            None,
            None,
            "The model, its KV pool, the memory lent to the cluster store and the data "
            "plane; prefill and decode nodes take these on top of "
            "[every service's](#every-service) options. Every model node of a cluster must "
            "agree on `model`, `dtype`, `seed`, `block_size` and `secret`.",
        ),
        Section(
            "conductor",
            ConductorConfig,
            "`kvmesh conductor`",
            "conductor",
            "The client API (gRPC and OpenAI-compatible HTTP), SLOs, routing and admission; "
            "on top of [every service's](#every-service) options.",
        ),
        Section(
            "store-master",
            StoreMasterConfig,
            "`kvmesh store-master`",
            "store-master",
            "Metadata of the cluster KV store: leases, eviction watermarks, hot-block "
            "replication and the raw-TCP control path; on top of "
            "[every service's](#every-service) options.",
        ),
        Section(
            "prefill",
            PrefillConfig,
            "`kvmesh prefill`",
            "prefill",
            "A prefill node takes [every service's](#every-service) and the "
            "[model nodes'](#model-nodes) options.",
        ),
        Section(
            "decode",
            DecodeConfig,
            "`kvmesh decode`",
            "decode",
            "Continuous batching and reservations; on top of "
            "[every service's](#every-service) and the [model nodes'](#model-nodes) options.",
        ),
        Section(
            "store-node",
            StoreNodeConfig,
            "`python -m kvmesh.services.store.node`",
            "store-node",
            "A process that only lends DRAM (and optionally an SSD directory) to the "
            "cluster store, no model (benchmarks, tests, store capacity on machines "
            "without accelerators); on top of [every service's](#every-service) options.",
        ),
    ]


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _is_bool(cls: type, f: dataclasses.Field) -> bool:
    from kvmesh.services.common.config import _base_type

    return _base_type(typing.get_type_hints(cls)[f.name]) is bool


def _fmt_default(value: Any) -> str:
    if value is dataclasses.MISSING:
        return "*(required)*"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    if value == "":
        return "*(empty)*"
    return f"`{value}`"


def _cell(text: str) -> str:
    """One table cell: on one line, with Markdown's special characters escaped."""
    text = " ".join(str(text).split())
    for ch in "\\|<>*":
        text = text.replace(ch, "\\" + ch)
    return text


def _paragraph(text: str) -> str:
    return textwrap.fill(text, width=88, break_long_words=False, break_on_hyphens=False)


def _own_fields(cls: type, bases: list[type]) -> list[dataclasses.Field]:
    """Fields of ``cls`` that its nearest documented base (``bases`` lists the most
    derived first) does not already list as they are."""
    base = next((b for b in bases if b is not cls and issubclass(cls, b)), None)
    if base is None:
        return list(dataclasses.fields(cls))
    inherited = {f.name: f for f in dataclasses.fields(base)}
    out = []
    for f in dataclasses.fields(cls):
        b = inherited.get(f.name)
        if (
            b is None
            or _default(b) != _default(f)
            or b.metadata.get("help") != f.metadata.get("help")
        ):
            out.append(f)
    return out


def table(cls: type, fields: list[dataclasses.Field]) -> list[str]:
    from kvmesh.services.common.config import env_name

    lines = ["| flag | environment | default | what |", "| --- | --- | --- | --- |"]
    for f in fields:
        flag = "--" + f.name.replace("_", "-")
        flag_cell = f"`{flag}` / `--no-{flag[2:]}`" if _is_bool(cls, f) else f"`{flag}`"
        lines.append(
            f"| {flag_cell} | `{env_name(f)}` | {_fmt_default(_default(f))} "
            f"| {_cell(f.metadata.get('help', ''))} |"
        )
    return lines


HEADER = f"""\
# Configuration

<!-- Generated by `{COMMAND}` from the config dataclasses; do not edit by hand.
     tests/test_docs.py fails when this file and the code disagree. -->

Every kvmesh service has one config dataclass; each field is declared with
`option(default, help)` in `services/common/config.py`, and its help text is both the
service's `--help` and the doc line below. This page is generated from those
dataclasses: regenerate it with `{COMMAND}`.

## Where values come from

For each option, the first of these that is set wins:

1. the command-line flag: `--name-with-dashes VALUE`; a boolean option is
   `--name` / `--no-name`;
2. the environment variable `KVMESH_<NAME>` (the field name in capitals);
3. the TOML file given with `--config FILE` (or `KVMESH_CONFIG=FILE`): first the keys in
   the service's own table (`[conductor]`, `[store-master]`, `[prefill]`, `[decode]`,
   `[store-node]`), then top-level keys;
4. the default shown here.

The TOML key is the field name (`kv_memory`, `ttft_slo_ms`). A key the service does not
know is an error, top-level keys included, so keep the options of one role in that
role's table:

```toml
cluster = "prod"
etcd = "10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379"

[decode]
kv_memory = "40%"
max_batch = 64
```

Values are checked when the service starts; a bad one stops it with a `ConfigError` that
names the option and says what would be valid.

- booleans: `1`, `true`, `yes`, `on` / `0`, `false`, `no`, `off` (in the environment);
- sizes (`kv_memory`, `segment_memory`, `ssd_bytes`): a plain byte count or a number
  with a unit, `K`/`M`/`G`/`T` (powers of 1000) or `KiB`/`MiB`/`GiB`/`TiB` (powers of
  1024), e.g. `512MiB`, `2GiB`, `1048576`; `kv_memory` also takes a share of the memory
  available at start, `40%` (at most 90%);
- lists (`etcd`): comma-separated.

Commands and their options:

| command | options |
| --- | --- |
| `kvmesh conductor` | [every service](#every-service), [conductor](#conductor) |
| `kvmesh store-master` | [every service](#every-service), [store-master](#store-master) |
| `kvmesh prefill` | [every service](#every-service), [model nodes](#model-nodes), [prefill](#prefill) |
| `kvmesh decode` | [every service](#every-service), [model nodes](#model-nodes), [decode](#decode) |
| `python -m kvmesh.services.store.node` | [every service](#every-service), [store-node](#store-node) |

`kvmesh up` (a whole local cluster), `kvmesh generate`, `kvmesh status` and
`kvmesh health` are clients with their own flags (`kvmesh <command> --help`); they read
no config file.
"""

FOOTER = """\
## Other environment variables

These are read directly, not through a config dataclass:

| variable | read by | what |
| --- | --- | --- |
| `KVMESH_CONFIG` | every service | TOML file, as `--config` |
| `KVMESH_API_KEY` | `kvmesh generate`, `kvmesh status` | API key sent as `authorization: Bearer` (default of `--api-key`) |
| `KVMESH_TRANSPORT` | transfer engine | `auto` (default: RDMA verbs when a device with an active port is present, else TCP), `tcp` or `rdma` (fail instead of falling back) |
| `KVMESH_RDMA_GID_INDEX` | verbs transport | GID index of the RDMA port (default 0) |
| `OTEL_EXPORTER_OTLP_ENDPOINT` | every service | export traces and metrics over OTLP (with the standard `OTEL_EXPORTER_OTLP_*` variables; needs the `otlp` extra) |
| `KVMESH_TRACE_FILE`, `KVMESH_METRICS_FILE` | every service | test/debug: append spans / metric exports as JSON lines to a file (a directory gets one file per process) |
| `KVMESH_FAULT_CORRUPT_EVERY` | transfer engine | test only: flip a byte in every N-th transfer (the fault suite); never set it in production |
"""


def render() -> str:
    secs = sections()
    bases = [secs[1].cls, secs[0].cls]  # NodeConfig, ServiceConfig: most derived first
    out = [HEADER]
    for s in secs:
        fields = _own_fields(s.cls, bases)
        out.append(f"## {s.title}\n")
        text = s.intro
        if s.command:
            text += f" Command: {s.command}."
        if s.toml_section:
            text += f" TOML table: `[{s.toml_section}]`."
        out.append(_paragraph(text) + "\n")
        if fields:
            out.append("\n".join(table(s.cls, fields)) + "\n")
        else:
            out.append("No options of its own.\n")
    out.append(FOOTER)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    ap.add_argument("--stdout", action="store_true", help="print instead of writing")
    args = ap.parse_args(argv)
    text = render()
    if args.stdout:
        sys.stdout.write(text)
        return 0
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT.relative_to(ROOT)} is stale: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(exist_ok=True)
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
