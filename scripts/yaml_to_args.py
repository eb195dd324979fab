#!/usr/bin/env python3
"""Translate a Megatron functional-test style YAML config into environment variables and flags.

The YAML has the shape of Megatron-LM's ``tests/functional_tests/test_cases/*/model_config.yaml``::

    ENV_VARS:
      CUDA_DEVICE_MAX_CONNECTIONS: 1
    MODEL_ARGS:
      --num-layers: 2
      --use-cpu-initialization: true          # true: the bare flag; false / null: left out
      --cp-comm-type: mesh tasp               # several values: space-separated (shell quoting rules)
      --data-path: [0.5, /data/a, 0.5, /data/b]   # or a YAML list
      --save: ${CHECKPOINT_DIR}/run1          # ${VAR}: from the environment or ENV_VARS

Variables already set in the environment win over ENV_VARS (the config gives defaults). A
``${VAR}`` that is set nowhere is an error. Other top-level keys (TEST_TYPE, ...) are ignored.

Usage (prints NUL-separated items for ``mapfile -d ''``)::

    yaml_to_args.py --env CONFIG.yaml    # KEY=VALUE for every ENV_VARS entry
    yaml_to_args.py --args CONFIG.yaml   # the flags of MODEL_ARGS

Only the standard library and PyYAML: the shell script runs this before torch is imported.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys

import yaml

_VAR = re.compile(r"\$\{(\w+)\}|\$(\w+)")


def load(path: str) -> dict:
    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    if not isinstance(doc, dict) or not isinstance(doc.get("MODEL_ARGS", {}), dict) \
            or not isinstance(doc.get("ENV_VARS", {}) or {}, dict):
        raise ValueError(f"{path}: expected a mapping with MODEL_ARGS (and optionally ENV_VARS) mappings")
    return doc


def environment(doc: dict, base: dict | None = None) -> dict[str, str]:
    """ENV_VARS as strings, values already in ``base`` (default: os.environ) taking precedence."""
    base = os.environ if base is None else base
    return {str(k): base.get(str(k), _scalar(v)) for k, v in (doc.get("ENV_VARS") or {}).items()}


def _scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _expand(text: str, env: dict[str, str], flag: str) -> str:
    def sub(m):
        name = m.group(1) or m.group(2)
        if name not in env:
            raise ValueError(f"{flag}: ${{{name}}} is not set (export it or add it to ENV_VARS)")
        return env[name]
    return _VAR.sub(sub, text)


def model_args(doc: dict, env: dict[str, str]) -> list[str]:
    """MODEL_ARGS as an argv list (see the module docstring for the value rules)."""
    argv: list[str] = []
    for flag, value in (doc.get("MODEL_ARGS") or {}).items():
        flag = str(flag)
        if not flag.startswith("--"):
            raise ValueError(f"MODEL_ARGS key {flag!r} must be a flag starting with '--'")
        if value is None or value is False:
            continue
        argv.append(flag)
        if value is True:
            continue
        items = value if isinstance(value, list) else [value]
        for item in items:
            text = _expand(_scalar(item), env, flag)
            argv.extend(shlex.split(text) if not isinstance(value, list) else [text])
    return argv


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--env", action="store_true", help="print KEY=VALUE of ENV_VARS")
    what.add_argument("--args", action="store_true", help="print the MODEL_ARGS flags")
    p.add_argument("config")
    a = p.parse_args(argv)
    try:
        doc = load(a.config)
        env = environment(doc)
        items = [f"{k}={v}" for k, v in env.items()] if a.env else model_args(doc, {**os.environ, **env})
    except (OSError, ValueError, yaml.YAMLError) as e:
        print(f"yaml_to_args: error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write("".join(item + "\0" for item in items))
    return 0


if __name__ == "__main__":
    sys.exit(main())
