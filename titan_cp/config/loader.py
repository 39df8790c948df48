"""Loading: the TOML in ``--job.config_file``, the command line over it, defaults under both.

Every value, from TOML or from the command line, goes through the one walker of its field's
annotation (:func:`titan_cp.config.values.convert`); renamed torchtitan keys are applied to
their new name, torchtitan keys titan_cp does not implement are collected for one warning.
"""

from __future__ import annotations

import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from titan_cp.config.job import JobConfig, known_keys, section_types
from titan_cp.config.torchtitan import RENAMED, VALUE_ALIASES, torchtitan_keys
from titan_cp.config.values import BOOL_WORDS, convert, did_you_mean, split_hint

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]


def _base(hint: Any) -> Any:
    """The type a hint names, without its bounds."""
    return split_hint(hint)[0]


def parse_cli(argv: list[str]) -> list[tuple[str, str | None]]:
    """``["--a.b", "1", "--c.d=x", "--e.flag"]`` -> ``[("a.b", "1"), ("c.d", "x"), ("e.flag", None)]``.

    A bare flag (no value) is ``None``; whether that is allowed depends on the key's type.
    """
    known = known_keys()
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ValueError(f"expected --section.key, got {arg!r}")
        name, eq, value = arg[2:].partition("=")
        i += 1
        if eq:
            out.append((name, value))
            continue
        is_bool = _base(known.get(name)) is bool
        takes_word = i < len(argv) and not argv[i].startswith("--")
        if is_bool and takes_word and argv[i].lower() not in BOOL_WORDS:
            # no argument is positional: a word after a flag is its value, a wrong one
            raise ValueError(f"--{name} must be true or false (or given alone, meaning true), got {argv[i]!r}")
        if takes_word:
            out.append((name, argv[i]))
            i += 1
        else:
            out.append((name, None))
    return out


def flatten_toml(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": {"c": 1}}}`` -> ``{"a.b.c": 1}``."""
    out: dict[str, Any] = {}
    for name, value in table.items():
        if isinstance(value, dict):
            out.update(flatten_toml(value, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = value
    return out


def read_toml(path: str) -> dict[str, Any]:
    """The flattened table of the TOML file ``path``; ``ValueError`` naming ``job.config_file``
    for a file that is missing, a folder, unreadable, not UTF-8 text or not valid TOML."""
    where = f"job.config_file = {path!r}"
    try:
        with open(path, "rb") as f:
            return flatten_toml(tomllib.load(f))
    except FileNotFoundError:
        raise ValueError(f"{where} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"{where} is a folder; give the TOML file (e.g. train_configs/debug_cp.toml)") from None
    except OSError as e:
        raise ValueError(f"{where} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{where} is not a text file (byte {e.object[e.start]:#04x} at offset {e.start} is not UTF-8); "
            "give the TOML file"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{where} is not valid TOML: {e}") from None


@dataclass
class _Values:
    """The values given so far (dotted titan_cp key -> converted value), and the torchtitan keys seen."""

    values: dict[str, Any] = field(default_factory=dict)
    spelled: dict[str, str] = field(default_factory=dict)  # key -> how the TOML named it (two names: an error)
    ignored: list[str] = field(default_factory=list)
    renamed: list[str] = field(default_factory=list)

    def place(self, key: str, value: Any, origin: str, from_cli: bool) -> None:
        known, given = known_keys(), key
        if from_cli and key not in known and key not in RENAMED and value is None:
            section, _, leaf = key.rpartition(".")
            if leaf.startswith("no_") and _base(known.get(f"{section}.{leaf[3:]}")) is bool:
                key, value = f"{section}.{leaf[3:]}", "false"
        if key in RENAMED:
            self.renamed.append(f"{key} -> {RENAMED[key]}")
            key = RENAMED[key]
        if key not in known:
            if key not in torchtitan_keys():
                candidates = [*known, *torchtitan_keys(), *RENAMED]
                raise ValueError(f"unknown config key {key!r} ({origin}){did_you_mean(key, candidates)}")
            self.ignored.append(key)
            return
        if not from_cli:
            if key in self.spelled:
                raise ValueError(f"{self.spelled[key]} and {given} ({origin}) both set {key}: keep one")
            self.spelled[key] = given
        if value is None:
            if _base(known[key]) is not bool:
                raise ValueError(f"--{key} needs a value")
            value = "true"
        if isinstance(value, str):
            value = VALUE_ALIASES.get(key, {}).get(value, value)
        self.values[key] = convert(key, value, known[key], from_text=from_cli)

    def warning(self) -> str | None:
        """The one warning listing the torchtitan keys ignored and renamed, if any."""
        parts = []
        if self.ignored:
            parts.append(
                "ignoring torchtitan keys titan_cp does not implement: " + ", ".join(dict.fromkeys(self.ignored))
            )
        if self.renamed:
            parts.append("renamed legacy torchtitan keys: " + ", ".join(dict.fromkeys(self.renamed)))
        return "; ".join(parts) or None


def load_config(argv: list[str] | None = None, *, warn_adjustments: bool = True, training: bool = True) -> JobConfig:
    """Build a validated :class:`JobConfig` from ``argv``: the TOML in ``--job.config_file`` (if any)
    overridden by the other ``--section.key value`` arguments. Starts no process group.

    Raises ``ValueError`` (naming the key) for unknown keys and bad values, and warns once listing
    the torchtitan keys that are ignored or renamed. The adjustments :meth:`JobConfig.reconcile`
    makes (a warmup longer than the run) are warned about when ``warn_adjustments``: a launcher
    that starts one process per rank passes it on one rank only, so the job warns once.
    ``training=False`` (generation): the checks across sections (:meth:`JobConfig.reconcile`) are
    not made: they are all the trainer's (its rows, batches, schedule, validation and memory options),
    none of which generation reads, so a training key (``validation.recall_shard_cut`` on one rank)
    does not stop a generation run on the same config.
    """
    cli = parse_cli(list(argv or []))
    given = _Values()
    toml_path = next((value for name, value in reversed(cli) if name == "job.config_file"), None)
    if toml_path is not None:
        for key, value in read_toml(toml_path).items():
            given.place(key, value, f"in {toml_path}", from_cli=False)
    for key, value in cli:
        given.place(key, value, "on the command line", from_cli=True)
    message = given.warning()
    if message:
        warnings.warn(message, UserWarning, stacklevel=2)
    job_config = JobConfig.from_values(given.values)
    job_config.validate()
    for note in job_config.reconcile() if training else []:
        if warn_adjustments:
            warnings.warn(note, UserWarning, stacklevel=2)
    return job_config


def _kind(hint: Any) -> Any:
    """How :func:`usage` names a field's type (``hint`` without bounds): a ``Literal``'s choices,
    else the type's name."""
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else getattr(hint, "__name__", hint)


def usage() -> str:
    """The command line and every key with its type and default, by section (``--help``)."""
    lines = [
        "usage: torchrun --nproc-per-node N -m titan_cp.train --job.config_file X.toml [--section.key value ...]",
        "",
        "Precedence: command line > TOML > defaults. Booleans: --section.flag / --section.no_flag;",
        "lists comma-separated; 'none' unsets an optional value. Presets: train_configs/*.toml.",
        "Bad input is one line and exit status 2; --debug (or TITAN_CP_DEBUG=1) shows its traceback.",
    ]
    for name, cls in section_types().items():
        lines.append(f"\n[{name}]")
        defaults, hints = cls(), typing.get_type_hints(cls)
        for key in cls.hints():
            hint = hints[key]
            lines.append(f"  --{name}.{key} ({_kind(hint)}, default {getattr(defaults, key)!r})")
    return "\n".join(lines)
