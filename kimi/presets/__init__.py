"""Built-in model configs (the `config.json` of real checkpoints), for tests, tools and sanity checks.

`kimi-k2.6.json` is the K2.6 text model as a nested `kimi_k25` config (docs/model-format.md, Checkpoint variants: the
K2.5 / K2.6 column and the values common to every variant; INT4 compressed-tensors routed experts). The vision tower's
config is left out: kimi serves the text backbone only.

    >>> from kimi.config import ModelConfig
    >>> ModelConfig.from_dict(load_preset("kimi-k2.6")).n_routed_experts
    384
"""

from __future__ import annotations

import copy
import json
import os
from functools import cache
from typing import Any

__all__ = ["list_presets", "load_preset"]

_DIR = os.path.dirname(os.path.abspath(__file__))


def list_presets() -> list[str]:
    """Names accepted by `load_preset` (file names in this folder without `.json`), sorted."""
    return sorted(f[:-5] for f in os.listdir(_DIR) if f.endswith(".json"))


@cache
def _read(name: str) -> dict[str, Any]:
    with open(os.path.join(_DIR, name + ".json")) as f:
        preset: dict[str, Any] = json.load(f)
    return preset


def load_preset(name: str) -> dict[str, Any]:
    """The parsed config.json of preset `name` (e.g. "kimi-k2.6"); a fresh deep copy the caller may edit.

    Raises:
        KeyError: no preset of that name (the message lists the known ones).
    """
    if name.endswith(".json"):
        name = name[:-5]
    if name not in list_presets():
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(list_presets())}")
    return copy.deepcopy(_read(name))
