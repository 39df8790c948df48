"""Chat and agent-trajectory records: JSON lines of ``{"messages": [{"role", "content"}, ...]}``.

One record is one document (its boundaries are trajectory boundaries: the packer never lets one
record attend to another). It is rendered with this template (ChatML), BOS before and EOS after::

    <BOS><|im_start|>system\\n{content}<|im_end|>\\n<|im_start|>user\\n{content}<|im_end|>\\n
        <|im_start|>assistant\\n{content}<|im_end|>\\n<|im_start|>tool\\n{content}<|im_end|>\\n ...<EOS>

and carries a per-token loss mask: the tokens of ``{content}<|im_end|>`` of every message whose
role is in ``loss_roles`` (default: ``assistant``) are training targets, so the model learns to
answer and to end its turn; role headers, the newline after each turn, BOS, EOS and every other
role's turns carry no loss. Each piece (header, content + end marker, newline) is tokenized on its
own so the mask is exact at turn boundaries; with a BPE tokenizer that may split differently from
tokenizing the whole text at once. ``<|im_start|>``/``<|im_end|>`` are plain text to the byte
tokenizer and single tokens to a Hugging Face tokenizer that defines them as added tokens.

With ``training.chat_template = "tokenizer"`` a record is rendered instead by the Jinja
``chat_template`` of the ``tokenizer_config.json`` beside ``model.hf_assets_path``'s
``tokenizer.json`` (no BOS/EOS added: the template writes what it writes), tokenized whole, and a
token is a target when its first character lies in a loss turn: from the start of that turn's
content to the end of what the template renders for the turn (its end-of-turn marker included).
The turn boundaries come from rendering the first k messages for every k (the template must
extend a conversation's rendering as messages are added, as chat templates do), and a turn's
content start from rendering it with a marker in place of its content.

Roles are ``system``, ``user``, ``assistant``, ``tool``; ``content`` is a string. A file is checked
whole when the source is built: a line that is not UTF-8 or not JSON (or nested too deeply to
parse), a record without ``messages``, an unknown role, a missing or non-string ``content``, or an
empty conversation is a ``ValueError`` naming the file, the line number and the key. A line read
again later (records are not kept in memory) is checked again, so a file changed during the run
fails the same way. Blank lines are not records and are passed over.

A record without a turn of ``loss_roles`` has no loss-bearing token: it teaches nothing, so it is
dropped when the file is read (never packed; the source's documents are the other records, so a
run resumed with the same roles reads the records a straight run reads: a resume with other
roles keeps other records, as another file would), and the count is logged once per job
("dropped 3 of 1,000 chat records ..."); a file where every record is dropped is a ``ValueError``
naming the file and the roles. A kept record always has a target under the built-in template (its
loss turns' end marker at least); a tokenizer template that writes nothing for an empty loss turn
can leave one without. A row whose loss turns a row boundary leaves out (a user turn longer than a
row) still holds none: a step whose rows hold no loss-bearing token at all is skipped by the
trainer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from titan_cp.data.document import Document
from titan_cp.data.tokenizer import OffsetTokenizer, Tokenizer

if TYPE_CHECKING:
    from jinja2 import Template
from titan_cp.files import parse_json_line

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"


def render_chat(messages: Sequence[dict], tokenizer: Tokenizer, loss_roles: Sequence[str] = ("assistant",)) -> Document:
    """Tokens and loss mask of one conversation under the module's template."""
    tokens, mask = [tokenizer.bos_id], [False]

    def add(text: str, loss: bool) -> None:
        ids = tokenizer.encode(text)
        tokens.extend(ids)
        mask.extend([loss] * len(ids))

    for message in messages:
        add(f"{TURN_START}{message['role']}\n", False)
        add(f"{message['content']}{TURN_END}", message["role"] in loss_roles)
        add("\n", False)
    tokens.append(tokenizer.eos_id)
    mask.append(False)
    return Document(tokens, loss_mask=mask)


_MARK = "\u2063content\u2063"  # stands in for a turn's content, to find where the template puts it


def compile_template(template: str) -> Template:
    """A Hugging Face chat template compiled as ``transformers`` does (sandboxed Jinja, trimmed blocks)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render_template_chat(
    messages: Sequence[dict],
    tokenizer: OffsetTokenizer,
    template: Template,
    loss_roles: Sequence[str] = ("assistant",),
) -> Document:
    """Tokens and loss mask of one conversation under a compiled tokenizer chat template (see the
    module docstring); ``tokenizer`` needs ``encode_with_offsets`` and ``token`` (:class:`HFTokenizer`)."""
    names = dict(
        bos_token=tokenizer.token(tokenizer.bos_id),
        eos_token=tokenizer.token(tokenizer.eos_id),
        add_generation_prompt=False,
    )
    spans, before = [], ""
    for k, message in enumerate(messages):
        upto = template.render(messages=list(messages[: k + 1]), **names)
        if not upto.startswith(before):
            raise ValueError(
                f"messages[{k}]: the tokenizer's chat template renders the first {k + 1} messages as something "
                f"other than the first {k} plus more, so turns cannot be told apart; set training.chat_template = 'chatml'"
            )
        if message["role"] in loss_roles:
            probe = template.render(messages=[*messages[:k], {**message, "content": _MARK}], **names)
            start = probe.find(_MARK, len(before))
            if start < 0 or probe[:start] != upto[:start]:
                raise ValueError(
                    f"messages[{k}]: cannot find where the tokenizer's chat template puts the content; "
                    "set training.chat_template = 'chatml'"
                )
            spans.append((start, len(upto)))
        before = upto
    ids, offsets = tokenizer.encode_with_offsets(before)
    mask = [any(a <= first < b for a, b in spans) for first, _ in offsets]
    return Document(list(ids), loss_mask=mask)


def check_record(record: object, where: str) -> None:
    """Raise ``ValueError`` (prefixed by ``where``, "file, line n") unless ``record`` is a chat record."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    if "messages" not in record:
        raise ValueError(f"{where}: no 'messages' key (keys: {sorted(record)})")
    messages = record["messages"]
    if not isinstance(messages, list):
        raise ValueError(f"{where}: 'messages' must be a list, got {type(messages).__name__}")
    if not messages:
        raise ValueError(f"{where}: 'messages' is empty (an empty conversation)")
    for k, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{where}: messages[{k}] must be an object, got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"{where}: messages[{k}] has no {key!r} key")
        if message["role"] not in ROLES:
            raise ValueError(f"{where}: messages[{k}].role = {message['role']!r} is not one of {list(ROLES)}")
        if not isinstance(message["content"], str):
            raise ValueError(
                f"{where}: messages[{k}].content must be a string, got {type(message['content']).__name__}"
            )


class ChatJsonl:
    """Chat/trajectory records from ``.jsonl`` files: one record per non-blank line.

    ``path`` is a file or a folder (searched recursively for ``*.jsonl``, in sorted order). Every
    line is checked at construction (see the module docstring); records with a turn of
    ``loss_roles`` are indexed by (file, byte offset) and read again on demand, so memory does not
    grow with the data; the others are dropped (``dropped`` of ``records``; ``announce``: log the
    count, on one rank). ``chat_template``: ``None`` for the built-in template, or the Jinja source
    of a tokenizer's chat template.
    """

    def __init__(
        self,
        path: str | Path,
        tokenizer: Tokenizer,
        loss_roles: Sequence[str] = ("assistant",),
        chat_template: str | None = None,
        announce: bool = False,
    ) -> None:
        unknown = [r for r in loss_roles if r not in ROLES]
        if unknown:
            raise ValueError(f"training.loss_roles: unknown roles {unknown}; roles are {list(ROLES)}")
        path = Path(path)
        files = [path] if path.is_file() else sorted(path.rglob("*.jsonl"))
        self.tokenizer, self.loss_roles = tokenizer, tuple(loss_roles)
        self._template = compile_template(chat_template) if chat_template is not None else None
        self._index: list[tuple[Path, int, int]] = []  # (file, byte offset, line number) of the kept records
        self.records, roles_seen = 0, set()
        for f in files:
            with open(f, "rb") as fh:
                offset = 0
                for line_no, line in enumerate(fh, start=1):
                    if line.strip():
                        where = f"{f}, line {line_no}"
                        record = parse_json_line(line, where)
                        check_record(record, where)
                        self.records += 1
                        roles = {m["role"] for m in record["messages"]}
                        roles_seen |= roles
                        if not roles.isdisjoint(self.loss_roles):
                            self._index.append((f, offset, line_no))
                    offset += len(line)
        if not self.records:
            raise ValueError(f"no chat records (*.jsonl lines) under {str(path)!r}")
        self.dropped = self.records - len(self._index)
        if not self._index:
            raise ValueError(
                f"{str(path)!r}: none of its {self.records:,} chat records has a turn of training.loss_roles = "
                f"{list(self.loss_roles)} (their roles: {', '.join(r for r in ROLES if r in roles_seen)}), so no "
                "token carries loss; set training.loss_roles to roles the records have, or point the dataset "
                "path at records with such turns"
            )
        if self.dropped and announce:
            logger.warning(
                "%s: dropped %s of %s chat records with no loss-bearing token (roles trained on: %s, "
                "training.loss_roles); they are not packed",
                path,
                f"{self.dropped:,}",
                f"{self.records:,}",
                ", ".join(self.loss_roles),
            )
        if self._template is not None:
            self.document(0)  # a template that cannot be used fails now, not mid-run

    def __len__(self) -> int:
        """The kept records (those with a turn of ``loss_roles``)."""
        return len(self._index)

    def messages(self, index: int) -> list[dict]:
        """The messages of kept record ``index`` (wrapping around)."""
        file, offset, line_no = self._index[index % len(self._index)]
        where = f"{file}, line {line_no} (read again: did the file change after the run started?)"
        with open(file, "rb") as fh:
            fh.seek(offset)
            record = parse_json_line(fh.readline(), where)
        check_record(record, where)
        if all(m["role"] not in self.loss_roles for m in record["messages"]):
            raise ValueError(f"{where}: no turn of training.loss_roles = {list(self.loss_roles)} any more")
        return record["messages"]

    def document(self, index: int) -> Document:
        if self._template is None:
            return render_chat(self.messages(index), self.tokenizer, self.loss_roles)
        if not isinstance(self.tokenizer, OffsetTokenizer):
            raise TypeError("a tokenizer's chat template needs its tokenizer.json (model.hf_assets_path)")
        try:
            return render_template_chat(self.messages(index), self.tokenizer, self._template, self.loss_roles)
        except ValueError as e:
            file, _, line_no = self._index[index % len(self._index)]
            raise ValueError(f"{file}, line {line_no}: {e}") from None
