"""Megatron functional-test style YAML configs as environment variables and command-line flags.

The YAML has the shape of Megatron-LM's ``tests/functional_tests/test_cases/*/model_config.yaml``::

    ENV_VARS:
      CUDA_DEVICE_MAX_CONNECTIONS: 1
    MODEL_ARGS:
      --num-layers: 2
      --use-cpu-initialization: true          # true: the bare flag; false / null: left out
      --cp-comm-type: mesh tasp               # several values: space-separated (shell quoting rules)
      --data-path: [0.5, /data/a, 0.5, /data/b]   # or a YAML list
      --save: ${CHECKPOINT_DIR}/run1          # ${VAR} or $VAR: from the environment or ENV_VARS
      --window-size: "-1,0"                   # one value starting with '-': given as --window-size=-1,0

Variables already set in the environment win over ENV_VARS (the config gives defaults). A
``${VAR}`` that is set nowhere is an error. Other top-level keys (TEST_TYPE, ...) are ignored::

    doc = load("configs/gpt_tiny_cpu.yaml")
    env = environment(doc)                         # {"CUDA_DEVICE_MAX_CONNECTIONS": "1", ...}
    argv = model_args(doc, {**os.environ, **env})  # ["--num-layers", "2", ...]

Standard library and PyYAML only: the launcher (``megatron/launch.py``) reads it before any worker
starts, the planner's prediction for a config (:mod:`.predict`) and the comparison job read it too.
"""

from __future__ import annotations

import os
import shlex
import string

__all__ = ["load", "environment", "model_args"]


def load(path: str) -> dict:
    import yaml

    with open(path) as f:
        try:
            doc = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {e}") from None
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
    try:
        return string.Template(text).substitute(env)
    except KeyError as e:
        raise ValueError(f"{flag}: ${{{e.args[0]}}} is not set (export it or add it to ENV_VARS)") from None
    except ValueError as e:  # a '$' not followed by a name
        raise ValueError(f"{flag}: {e} in {text!r} (write $$ for a literal $)") from None


def model_args(doc: dict, env: dict[str, str]) -> list[str]:
    """MODEL_ARGS as an argv list (see the module docstring for the value rules)."""
    argv: list[str] = []
    for flag, value in (doc.get("MODEL_ARGS") or {}).items():
        flag = str(flag)
        if not flag.startswith("--"):
            raise ValueError(f"MODEL_ARGS key {flag!r} must be a flag starting with '--'")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
            continue
        items = value if isinstance(value, list) else [value]
        words = [w for item in items for text in (_expand(_scalar(item), env, flag),)
                 for w in (shlex.split(text) if not isinstance(value, list) else [text])]
        # one value that starts with '-' (--window-size: "-1,0") as flag=value: argparse would take it for a flag
        argv.extend([f"{flag}={words[0]}"] if len(words) == 1 and words[0].startswith("-") else [flag, *words])
    return argv
