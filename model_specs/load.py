"""`load_spec`: a built-in name, a config.json, or a directory holding one -> a validated spec.

Built-in specs are ordinary Hugging Face config files in `configs/`, so a built-in and a user's
own config take exactly the same path through the frontend.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tilertc.model_specs.hf import spec_from_hf_config
from tilertc.model_specs.spec import ModelSpec, SpecError

CONFIGS_DIR = Path(__file__).parent / "configs"


def builtin_names() -> list[str]:
    """Names of the built-in specs, sorted."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))


def load_spec(name_or_path: str | os.PathLike[str],
              overrides: Mapping[str, Any] | None = None) -> ModelSpec:
    """The validated spec of a built-in name, a config.json, or a directory containing one.

    An existing path wins over a built-in name of the same spelling, as with Hugging Face's
    `from_pretrained`. `overrides` replaces top-level config keys before parsing, so that a
    variant (fewer layers, another context length) is checked like any config.
    """
    path, name = resolve(name_or_path)
    cfg = read_config(path)
    source = str(path)
    if overrides:
        cfg.update(overrides)
        source += f" (with overrides of {', '.join(sorted(overrides))})"
    return spec_from_hf_config(cfg, name=name, source=source)


def resolve(name_or_path: str | os.PathLike[str]) -> tuple[Path, str]:
    """The config file to read and the name the spec gets."""
    path = Path(name_or_path)
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise SpecError(f"{path}: directory has no config.json")
        return config, path.resolve().name
    if path.is_file():
        return path, path.resolve().parent.name if path.name == "config.json" else path.stem
    text = str(name_or_path)
    if text in builtin_names():
        return CONFIGS_DIR / f"{text}.json", text
    if os.sep in text or text.endswith(".json"):
        raise SpecError(f"{text}: no such file or directory")
    close = difflib.get_close_matches(text, builtin_names(), n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    raise SpecError(f"{text!r} is neither a built-in model nor a path to a config.json{hint} "
                    f"(built-in: {', '.join(builtin_names())})")


def read_config(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; errors say where the file is broken."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"{path}: cannot read the config: {e}") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: "
                        f"{e.msg}") from None
    if not isinstance(cfg, dict):
        raise SpecError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg
