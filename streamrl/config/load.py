"""Loading a config: a YAML file, then ``a.b=c`` overrides, validated; errors that name the field and the fix."""

from __future__ import annotations

import difflib
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from streamrl.config.sections import Config


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message says why."""


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a YAML file (or the defaults when ``path`` is None) and apply ``a.b=c`` overrides."""
    return config_from(_read_yaml(Path(path)) if path else {}, overrides, str(path) if path else "<defaults>")


def config_from(tree: dict[str, Any], overrides: list[str] | tuple[str, ...] = (), where: str = "<data>") -> Config:
    """A config from plain data (a recorded run's, say) and ``a.b=c`` overrides; ``where`` names it in errors."""
    import copy

    tree = copy.deepcopy(tree)
    for item in overrides:
        _apply_override(tree, item)
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(f"invalid config {where}:\n{_describe(e)}") from None


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        tree = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config {path} is not valid YAML: {e}") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(f"config {path} must be a mapping at the top level, got {type(tree).__name__}")
    return tree


def _apply_override(tree: dict[str, Any], item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} must look like section.field=value")
    parts = key.strip().split(".")
    node: dict[str, Any] = tree
    model: type[BaseModel] | None = Config  # None once inside a free-form dict field
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        if model is not None:
            if part not in model.model_fields:
                name = ".".join(parts[: depth + 1])
                raise ConfigError(f"override {item!r}: {name}: {_unknown(parts[: depth + 1], model.model_fields)}")
            annotation = _section_of(model.model_fields[part].annotation)
            model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
            if not last and model is None and get_origin(annotation) is not dict:
                raise ConfigError(f"override {item!r}: {'.'.join(parts[: depth + 1])} is a value, not a section")
        if last:
            node[part] = _parse_value(raw)
            return
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {'.'.join(parts[: depth + 1])} is not a mapping in the file")
        node = child


def _section_of(annotation: Any) -> Any:
    """The section class of an optional section (``LoraConfig | None``), else the annotation as it is."""
    members = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) in (Union, UnionType) and len(members) == 1:
        return members[0]
    return annotation


def _parse_value(raw: str) -> Any:
    """YAML scalars, so that ``lr=1e-5``, ``x=true`` and ``xs=[1,2]`` get their natural types."""
    try:
        return yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        return raw


def _unknown(path: list[str], fields: dict[str, Any]) -> str:
    close = difflib.get_close_matches(path[-1], list(fields), n=1)
    hint = f" (did you mean {'.'.join(path[:-1] + close)!r}?)" if close else ""
    return f"unknown key{hint}; allowed here: {', '.join(fields) or 'nothing'}"


def _fields_at(path: list[str]) -> dict[str, Any]:
    model: Any = Config
    for part in path:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return {}
        model = _section_of(field.annotation)
    return model.model_fields if isinstance(model, type) and issubclass(model, BaseModel) else {}


def _describe(error: ValidationError) -> str:
    lines = []
    for err in error.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        if err["type"] == "extra_forbidden":
            path = [str(p) for p in err["loc"]]
            lines.append(f"  {loc}: {_unknown(path, _fields_at(path[:-1]))}")
            continue
        if not err["loc"] and err["type"] == "value_error":  # the cross-field rules: each names its fields
            lines.append(f"  {err['ctx']['error']}")
            continue
        got = err.get("input")
        lines.append(f"  {loc}: {err['msg']} (got {got!r})")
    return "\n".join(lines)


def dump_config(config: Config) -> str:
    """The resolved config as YAML, written beside every run for reproducibility."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
