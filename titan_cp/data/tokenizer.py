"""Tokenizers: a built-in byte-level one, and a local Hugging Face ``tokenizer.json``.

Both expose ``vocab_size``, ``bos_id``, ``eos_id``, ``pad_id``, ``encode(text, bos=False, eos=False)
-> list[int]`` and ``decode(ids) -> str``. Nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from titan_cp.errors import UserError
from titan_cp.files import read_json


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@runtime_checkable
class OffsetTokenizer(Tokenizer, Protocol):
    """A tokenizer that also gives each token's character span and string (:class:`HFTokenizer`), as a
    tokenizer's own chat template needs."""

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...

    def token(self, token_id: int) -> str | None: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, then BOS = 256, EOS = 257, PAD = 258 (``vocab_size = 259``).

    Lossless on any text; ``decode`` drops the special ids.
    """

    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` read with the optional ``tokenizers`` package.

    ``path`` is the ``tokenizer.json`` file or the folder holding it. BOS/EOS/PAD come from
    ``tokenizer_config.json`` beside it when present, else from common special-token names
    (``<|begin_of_text|>``, ``<s>``, ...); PAD falls back to EOS. ``chat_template``: the Jinja
    chat template of that ``tokenizer_config.json`` (``None`` if it has none).
    """

    _BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[CLS]")
    _EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "[SEP]")

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError as e:
            raise ImportError(
                "reading a tokenizer.json (model.hf_assets_path) needs the optional 'tokenizers' "
                "package: pip install 'titan_cp[data]', or unset model.hf_assets_path to use the "
                "built-in byte tokenizer"
            ) from e
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        read_json(file)  # a file that is not JSON is named here, not by the tokenizers library
        try:
            self._tok = _Tokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001 - the library raises a bare Exception for what it cannot read
            raise UserError(f"{file}: not a tokenizer the 'tokenizers' package can read ({e})") from None
        self.file = file
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        special = _special_tokens(file.parent / "tokenizer_config.json")
        self.bos_id = self._find(special.get("bos_token"), self._BOS_NAMES, "BOS")
        self.eos_id = self._find(special.get("eos_token"), self._EOS_NAMES, "EOS")
        pad = special.get("pad_token")
        pad_token_id = self._tok.token_to_id(pad) if pad else None
        self.pad_id = pad_token_id if pad_token_id is not None else self.eos_id
        self.chat_template = _chat_template(file.parent / "tokenizer_config.json")

    def _find(self, configured: str | None, names: Sequence[str], what: str) -> int:
        for name in ([configured] if configured else []) + list(names):
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        raise ValueError(f"{self.file} has no {what} token (tried {[configured, *names]})")

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id] * bos + ids + [self.eos_id] * eos

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of ``text`` (special tokens written in it included) and each token's character span."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def token(self, token_id: int) -> str | None:
        """The token string of ``token_id`` (``None`` for an id outside the vocabulary)."""
        return self._tok.id_to_token(token_id)


def _special_tokens(config_file: Path) -> dict[str, str]:
    """``{"bos_token": "<s>", ...}`` from a ``tokenizer_config.json`` (values may be dicts)."""
    if not config_file.is_file():
        return {}
    config = _config_object(config_file)
    out = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def _chat_template(config_file: Path) -> str | None:
    """The ``chat_template`` of a ``tokenizer_config.json`` (a named list: its ``default`` entry)."""
    if not config_file.is_file():
        return None
    template = _config_object(config_file).get("chat_template")
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    return template if isinstance(template, str) else None


def _config_object(config_file: Path) -> dict:
    """The JSON object of a ``tokenizer_config.json``; a ``UserError`` naming it otherwise."""
    config = read_json(config_file)
    if not isinstance(config, dict):
        raise UserError(f"{config_file}: a tokenizer config must be a JSON object, got {type(config).__name__}")
    return config


def _tokenizer_file(path: str) -> Path:
    """The ``tokenizer.json`` of ``model.hf_assets_path = path`` (the folder holding it, or the file)."""
    p = Path(path)
    if (p / "tokenizer.json").is_file():
        return p / "tokenizer.json"
    if p.is_file() and p.name.endswith(".json"):
        return p
    raise ValueError(
        f"model.hf_assets_path = {path!r} holds no tokenizer.json; point it at a local folder "
        "with one, or leave it unset for the built-in byte tokenizer"
    )


def check_tokenizer_files(path: str) -> None:
    """What ``model.hf_assets_path = path`` holds can be read: its ``tokenizer.json`` (and the
    ``tokenizer_config.json`` beside it, if any) are JSON. Errors name the key and the file."""
    file = _tokenizer_file(path)
    read_json(file, f"model.hf_assets_path = {path!r}: {file}")
    config = file.parent / "tokenizer_config.json"
    if config.is_file():
        read_json(config, f"model.hf_assets_path = {path!r}: {config}")


def build_tokenizer(path: str | None) -> Tokenizer:
    """The byte tokenizer, or the ``tokenizer.json`` in ``path`` (``model.hf_assets_path``) when that is set."""
    if not path:
        return ByteTokenizer()
    return HFTokenizer(_tokenizer_file(path))
