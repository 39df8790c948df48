"""Prompt files: one text file (one prompt), or JSON lines with a ``"prompt"`` string per record.

For scoring, each JSON record also carries the ``"continuation"`` to score. Errors are
:class:`~titan_cp.errors.UserError` naming the config key, the file and the line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from titan_cp.errors import UserError
from titan_cp.files import parse_json_line, read_bytes, read_text

JSON_SUFFIXES = (".jsonl", ".json")


@dataclass(frozen=True)
class PromptRecord:
    """One prompt: its place in the file (0-based record number), text, continuation (scoring), and
    where it is written (``"<file>, line <n>"``) for errors."""

    index: int
    prompt: str
    continuation: str | None
    where: str


def _string(record: object, name: str, where: str) -> str:
    if not isinstance(record, dict):
        raise UserError(f"{where}: a record must be a JSON object with a {name!r} string, got {record!r:.60}")
    if name not in record:
        raise UserError(f"{where}: no {name!r} key (keys: {sorted(record)[:10]})")
    value = record[name]
    if not isinstance(value, str):
        raise UserError(f"{where}: {name!r} must be a string, got {type(value).__name__} {value!r:.60}")
    if not value:
        raise UserError(f"{where}: {name!r} is empty")
    return value


def read_prompts(path: str, continuations: bool = False, key: str = "generate.prompt_file") -> list[PromptRecord]:
    """The prompts of the file ``path`` (the value of ``key``), with their continuations when
    ``continuations`` (JSON lines only). A missing or empty file, a text file where continuations
    are needed, and a bad record are errors naming the key, the file and the line."""
    where = f"{key} = {path!r}"
    if not Path(path).exists():
        raise UserError(f"{where} does not exist")
    if Path(path).suffix not in JSON_SUFFIXES:
        if continuations:
            raise UserError(
                f'{where} is a text file; scoring reads JSON lines (.jsonl) with "prompt" and "continuation" strings'
            )
        text = read_text(path, where)
        if not text.strip():
            raise UserError(f"{where} is empty: it holds no prompt")
        return [PromptRecord(0, text, None, where)]
    records: list[PromptRecord] = []
    for line_no, line in enumerate(read_bytes(path, where).splitlines(), start=1):
        if not line.strip():
            continue
        at = f"{where}, line {line_no}"
        record = parse_json_line(line, at)
        prompt = _string(record, "prompt", at)
        continuation = _string(record, "continuation", at) if continuations else None
        records.append(PromptRecord(len(records), prompt, continuation, at))
    if not records:
        raise UserError(f'{where} is empty: it holds no JSON line with a "prompt"')
    return records
