"""`kubegpu config schema`: print the JSON Schema of the config file (`kubegpu.config.v1`).

Editors and CI check a ConfigMap's `config.yaml` against it before it reaches a node; a
copy is kept beside the Helm chart (`deployments/helm/kubegpu/config.schema.json`).
"""

from __future__ import annotations

import json
import sys

from kubegpu.cli import COMMANDS
from kubegpu.cli.usage import Command, Group
from kubegpu.config.v1 import json_schema


def schema_text() -> str:
    """The schema as `kubegpu config schema` prints it (and the chart's copy holds)."""
    return json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n"


def run_schema() -> int:
    sys.stdout.write(schema_text())
    return 0


schema = Command(
    "schema",
    callback=run_schema,
    help=(
        "Print the JSON Schema (draft 2020-12) of the config file, for editors and CI: "
        "kubegpu config schema > config.schema.json"
    ),
    short_help="print the config file's JSON Schema",
)
config = Group("config", commands=[schema], help=COMMANDS["config"].summary)
