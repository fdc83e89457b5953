"""Per-model settings: one TOML file (`$MLX_PREFIX_HOME/models.toml`, or `serve
--models-file`), one table per model, read once at startup.

    [models."mlx-community/Qwen3.5-4B-4bit"]      # a hub id, a folder, or a served name
    aliases = ["qwen", "coder"]                    # more names that select it
    context_length = 16384                         # caps the prompt + reply
    temperature = 0.6                              # sampling defaults: top_p, top_k,
    max_tokens = 2048                              #   min_p, max_tokens too
    chat_template_kwargs = { enable_thinking = false }
    draft_model = "mlx-community/Qwen3.5-0.8B-4bit"  # speculative decoding
    kv_bits = 8                                    # and kv_group_size
    keep_alive = "30m"                             # idle time before unload; -1: never
    pinned = true                                  # never unloaded when idle

A request's own fields win over these, and these over the server's flags. Naming a
model here lets requests load it on demand, as `--allowed-models` does (the operator
wrote the file). Anything wrong (TOML syntax, an unknown key, a value of the wrong type
or out of range, an alias used twice) is a `SettingsFileError` naming the file and the
line. Pure: no MLX, nothing looked up on disk but the file itself.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_prefix.config import KV_BITS, KV_GROUP_SIZES, parse_duration
from mlx_prefix.errors import MlxPrefixError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

FILE_NAME = "models.toml"
FILE_ENV = "MLX_PREFIX_MODELS_FILE"


class SettingsFileError(MlxPrefixError):
    """The settings file cannot be used: the message names the file and the line."""

    status = 500
    type = "server_error"
    code = "bad_settings_file"


@dataclass(frozen=True)
class ModelSettings:
    """One model's table. None (or empty) everywhere: the server's own behaviour."""

    name: str  # the table's name: a hub id, a folder, or the served name
    aliases: tuple[str, ...] = ()
    context_length: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    draft_model: str | None = None
    kv_bits: int | None = None
    kv_group_size: int | None = None
    keep_alive_s: float | None = None  # config.FOREVER: never unloaded when idle
    pinned: bool = False


NO_SETTINGS = ModelSettings(name="")


def _number(lo: float, hi: float, kind: type = float):
    def check(v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int):
            raise ValueError(f"must be {'a number' if kind is float else 'an integer'}")
        if not lo <= v <= hi:
            raise ValueError(f"must be between {lo:g} and {hi:g}")
        return kind(v)

    return check


def _string(v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ValueError("must be a non-empty string")
    return v


def _names(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(a, str) and a.strip() == a and a for a in v):
        raise ValueError("must be a list of names (strings without surrounding spaces)")
    return tuple(dict.fromkeys(v))


def _table(v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ValueError("must be a table, e.g. { enable_thinking = false }")
    return dict(v)


def _choice(options: tuple[int, ...]):
    def check(v: Any) -> int:
        if isinstance(v, bool) or v not in options:
            raise ValueError(f"must be one of {', '.join(map(str, options))}")
        return int(v)

    return check


def _keep_alive(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise ValueError('must be a duration such as "5m" or a number of seconds (-1: never)')
    return parse_duration(v)


def _flag(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError("must be true or false")
    return v


# key in the file -> (field of ModelSettings, check and convert)
_KEYS = {
    "aliases": ("aliases", _names),
    "context_length": ("context_length", _number(1, 1 << 40, int)),
    "temperature": ("temperature", _number(0, 2)),
    "top_p": ("top_p", _number(0, 1)),
    "top_k": ("top_k", _number(0, 1 << 31, int)),
    "min_p": ("min_p", _number(0, 1)),
    "max_tokens": ("max_tokens", _number(1, 1 << 40, int)),
    "chat_template_kwargs": ("chat_template_kwargs", _table),
    "draft_model": ("draft_model", _string),
    "kv_bits": ("kv_bits", _choice(KV_BITS)),
    "kv_group_size": ("kv_group_size", _choice(KV_GROUP_SIZES)),
    "keep_alive": ("keep_alive_s", _keep_alive),
    "pinned": ("pinned", _flag),
}


@dataclass(frozen=True)
class ModelsFile:
    """The parsed file: settings by table name, and which table each alias selects."""

    path: Path | None = None
    models: Mapping[str, ModelSettings] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)  # alias -> table name

    def find(self, name: str) -> ModelSettings | None:
        """The table `name` selects (its own name or an alias); None if none."""
        name = name.rstrip("/") or name
        if name in self.models:
            return self.models[name]
        target = self.aliases.get(name)
        return self.models[target] if target is not None else None


def default_path() -> Path:
    """$MLX_PREFIX_MODELS_FILE, else models.toml in $MLX_PREFIX_HOME (else the user cache
    folder's mlx-prefix/)."""
    from mlx_prefix.models.default import default_models_dir

    if named := os.environ.get(FILE_ENV):
        return Path(named).expanduser()
    return default_models_dir().parent / FILE_NAME


def load_models_file(path: str | Path | None = None) -> ModelsFile:
    """Read `path` (a missing file is an error), else the default path (a missing file
    there means no settings)."""
    explicit = path is not None or FILE_ENV in os.environ
    where = Path(path).expanduser() if path is not None else default_path()
    try:
        text = where.read_text(encoding="utf-8")
    except FileNotFoundError:
        if explicit:
            raise SettingsFileError(f"{where}: no such settings file") from None
        return ModelsFile()
    except (OSError, UnicodeDecodeError) as e:
        raise SettingsFileError(f"{where}: cannot be read ({e})") from None
    return parse_models_file(text, where)


def parse_models_file(text: str, path: Path | None = None) -> ModelsFile:
    where = str(path) if path is not None else "the settings file"
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        # tomllib says where: "... (at line 3, column 7)"
        raise SettingsFileError(f"{where}: {e}") from None
    lines = _Lines(text)
    unknown = [k for k in data if k != "models"]
    if unknown:
        raise SettingsFileError(
            f"{where}{lines.at(None, unknown[0])}: unknown section {unknown[0]!r} "
            '(settings go under [models."NAME"])'
        )
    tables = data.get("models", {})
    if not isinstance(tables, dict):
        raise SettingsFileError(f"{where}{lines.at(None, 'models')}: 'models' must be a table")
    models: dict[str, ModelSettings] = {}
    aliases: dict[str, str] = {}
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise SettingsFileError(
                f"{where}{lines.at(None, name)}: models.{name!r} must be a table of settings"
            )
        values: dict[str, Any] = {"name": name.rstrip("/") or name}
        for key, value in table.items():
            if key not in _KEYS:
                raise SettingsFileError(
                    f"{where}{lines.at(name, key)}: unknown setting {key!r} for {name!r} "
                    f"(known: {', '.join(_KEYS)})"
                )
            attr, check = _KEYS[key]
            try:
                values[attr] = check(value)
            except ValueError as e:
                raise SettingsFileError(f"{where}{lines.at(name, key)}: {key}: {e}") from None
        settings = ModelSettings(**values)
        models[settings.name] = settings
        for alias in settings.aliases:
            other = aliases.get(alias) or (alias if alias in tables and alias != name else None)
            if other is not None:
                raise SettingsFileError(
                    f"{where}{lines.at(name, 'aliases')}: the alias {alias!r} of {name!r} "
                    f"also names {other!r}"
                )
            aliases[alias] = settings.name
    return ModelsFile(path, models, aliases)


class _Lines:
    """Where a table or a key sits in the file's text (tomllib keeps no positions): the
    line of `[models."NAME"]` and of `key =` below it, found by reading the text."""

    def __init__(self, text: str):
        self.lines = text.splitlines()

    def at(self, table: str | None, key: str) -> str:
        line = self._find(table, key)
        return f", line {line}" if line else ""

    def _find(self, table: str | None, key: str) -> int | None:
        name = _quoted(key)
        if table is None:  # a section, or a table under models: its header or `key =`
            top = re.compile(rf"\s*(\[\s*)?(models\s*\.\s*)?{name}\s*(=|\]|\.)")
            return next((i + 1 for i, ln in enumerate(self.lines) if top.match(ln)), None)
        header = re.compile(rf"\s*\[\s*models\s*\.\s*{_quoted(table)}\s*\]")
        found = next((i for i, ln in enumerate(self.lines) if header.match(ln)), None)
        if found is None:
            return None
        setting = re.compile(rf"\s*{name}\s*=")
        for i in range(found + 1, len(self.lines)):
            if self.lines[i].lstrip().startswith("["):
                break
            if setting.match(self.lines[i]):
                return i + 1
        return found + 1  # the table's own line


def _quoted(name: str) -> str:
    """A TOML key as written bare, "double-quoted" or 'single-quoted' (a regex)."""
    n = re.escape(name)
    return rf"(?:{n}|\"{n}\"|'{n}')"
