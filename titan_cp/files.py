"""Reading the files a user points titan_cp at, with errors that name the file (and the line).

Every reader here raises :class:`titan_cp.errors.UserError` for a file that cannot be used: a
folder where a file was expected, an unreadable file, bytes that are not UTF-8, text that is
not JSON, JSON nested too deeply for Python's parser. ``where`` prefixes every message: the file,
with the config key that named it when there is one (``model.hf_assets_path = '...':
tokenizer.json``), and the line for JSON lines.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any

from titan_cp.errors import UserError

SNIFF_BYTES = 1 << 16  # how much of a text file is checked when a source is built


def _parse(text: str | bytes, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{where}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    except RecursionError:
        raise UserError(f"{where}: JSON nested too deeply to read (arrays or objects over ~1000 levels)") from None


def parse_json_line(line: bytes, where: str) -> Any:
    """One JSON value from one line of a JSON-lines file; ``where``: ``"<file>, line <n>"``."""
    return _parse(line, where)


def read_bytes(path: str | Path, where: str | None = None) -> bytes:
    """The bytes of the file ``path``; a folder, a missing or an unreadable file is a ``UserError``."""
    path = Path(path)
    where = where or str(path)
    try:
        return path.read_bytes()
    except IsADirectoryError:
        raise UserError(f"{where} is a folder, not a file") from None
    except FileNotFoundError:
        raise UserError(f"{where} does not exist") from None
    except OSError as e:
        raise UserError(f"{where} cannot be read: {e.strerror}") from None


def read_text(path: str | Path, where: str | None = None) -> str:
    """The UTF-8 text of the file ``path`` (see :func:`read_bytes`); bytes that are not UTF-8 are a
    ``UserError`` giving the offset."""
    where = where or str(path)
    data = read_bytes(path, where)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{where}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})") from None


def read_json(path: str | Path, where: str | None = None) -> Any:
    """The JSON value in the file ``path``; an empty file, text that is not JSON or not UTF-8 is a
    ``UserError`` naming the file (and the line and column)."""
    where = where or str(path)
    data = read_bytes(path, where)
    if not data.strip():
        raise UserError(f"{where} is empty (a JSON file was expected)")
    return _parse(data, where)


def check_text_file(path: str | Path, where: str | None = None) -> None:
    """Check that the start of ``path`` (:data:`SNIFF_BYTES`) is UTF-8 text: no NUL byte, no byte
    that UTF-8 refuses. A ``UserError`` names the file and the offset."""
    where = where or str(path)
    try:
        with open(path, "rb") as f:
            head = f.read(SNIFF_BYTES)
    except OSError as e:
        raise UserError(f"{where} cannot be read: {e.strerror}") from None
    nul = head.find(b"\0")
    if nul >= 0:
        raise UserError(f"{where} is binary, not text (a NUL byte at offset {nul})")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a character cut by the sniff is fine
    except UnicodeDecodeError as e:
        raise UserError(f"{where}: not UTF-8 text (byte {head[e.start]:#04x} at offset {e.start})") from None


HF_DATASET_MARKERS = ("dataset_dict.json", "state.json")


def check_saved_hf_dataset(path: str | Path, kind_key: str, path_key: str) -> None:
    """``path`` (``path_key``, for ``kind_key = 'hf'``) is a Hugging Face dataset written by
    ``save_to_disk``: a folder holding ``dataset_dict.json`` or ``state.json``. A ``UserError``
    otherwise, pointing a text or JSON-lines file at ``'text'`` / ``'chat'``."""
    p = Path(path)
    if p.is_dir() and any((p / f).is_file() for f in HF_DATASET_MARKERS):
        return
    what = "a file" if p.is_file() else "a folder without dataset_dict.json or state.json"
    raise UserError(
        f"{path_key} = {str(path)!r} is {what}, not a Hugging Face dataset saved with save_to_disk ({kind_key} = "
        f"'hf'); for .txt/.jsonl files set {kind_key} = 'text' (or 'chat' for chat records)"
    )
