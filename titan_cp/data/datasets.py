"""Document sources: the built-in synthetic long-range recall corpus, local text/JSONL, chat and
agent trajectories (:mod:`titan_cp.data.chat`), Hugging Face datasets saved on disk, and weighted
mixtures of these (:mod:`titan_cp.data.mixture`). Nothing is downloaded.

A source maps a document index ``i >= 0`` to a tokenized :class:`Document`
(``source.document(i)``); finite sources wrap around (epoch ``i // len``), so the packer sees an
endless, deterministic stream.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from titan_cp.data.chat import ChatJsonl
from titan_cp.data.document import Document, DocumentSource
from titan_cp.data.mixture import Mixture
from titan_cp.data.tokenizer import ByteTokenizer, Tokenizer
from titan_cp.files import HF_DATASET_MARKERS, check_saved_hf_dataset, check_text_file, parse_json_line, read_text

if TYPE_CHECKING:
    from titan_cp.config import JobConfig

Split = Literal["train", "validation"]

__all__ = [
    "HFDiskDataset",
    "SyntheticLookup",
    "SyntheticRecall",
    "TextFiles",
    "build_dataset",
]


# --------------------------------------------------------------------------------------------
# synthetic long-range recall

_WORDS = (
    "the a river stone city window music garden letter morning story market bridge harbor "
    "forest engine paper lantern mountain signal winter field island voice station valley road "
    "old quiet bright slow distant small heavy early green narrow warm silent open broken "
    "walks carries finds watches builds remembers follows crosses holds opens reads leaves "
    "near under over beyond through along behind across with without before after while"
).split()
# Keys are symbols that occur nowhere else in a document: the key right before a value is the
# whole cue, so recalling the value is one content lookup, possibly thousands of tokens back.
_KEYS = "#$%&*+<>@^|~"
_VALUE_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"


class SyntheticRecall:
    """Documents that plant key -> value facts at the start and ask for them much later.

    Layout of one document (lengths log-uniform in ``[min_tokens, max_tokens]``)::

        <BOS>Remember these facts.
        fact @4k9d2x.            <- facts: a symbol key, a random value; 1 to 12 of them
        ...
        Filler sentences repeated from a small per-document pool, with the questions at
        random points:
        Recall @4k9d2x.          <- the answer span is the value's tokens
        ...<EOS>

    Every fact is asked once; the distance of an answer is its start minus the start of the
    fact's value, so long documents give distances of thousands of tokens. Document ``i`` depends
    only on ``(seed, split, i)``, so any document can be generated on its own; the ``validation``
    split draws from a different random stream than ``train`` (held out by construction).
    """

    chance = 1 / len(_VALUE_CHARS)
    """The accuracy of a guess at one answer token (a value's characters are uniform)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        seed: int = 0,
        split: Split = "train",
        min_tokens: int = 256,
        max_tokens: int = 6144,
    ) -> None:
        if not 64 <= min_tokens <= max_tokens:
            raise ValueError(f"need 64 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
        self.tokenizer, self.seed, self.split = tokenizer, seed, split
        self.min_tokens, self.max_tokens = min_tokens, max_tokens

    def document(self, index: int) -> Document:
        rng = random.Random(f"synthetic_recall/{self.split}/{self.seed}/{index}")
        target = round(math.exp(rng.uniform(math.log(self.min_tokens), math.log(self.max_tokens))))
        n_facts = rng.randint(1, max(1, min(len(_KEYS), target // 128)))
        keys = rng.sample(_KEYS, n_facts)
        values = {k: "".join(rng.choices(_VALUE_CHARS, k=6)) for k in keys}

        tok = self.tokenizer
        tokens = [tok.bos_id]

        def add(text: str) -> int:
            start = len(tokens)
            tokens.extend(tok.encode(text))
            return start

        # filler repeats sentences from a small per-document pool: text a model can learn to
        # copy from earlier in the document (induction), the same skill fact recall needs. Its
        # words come from one fixed vocabulary (_WORDS), so much of it is predictable without
        # context (~0.65 nats/token): the loss falls long before copying or recall is learned.
        pool = [_sentence(rng) for _ in range(rng.randint(4, 12))]
        add("Remember these facts.\n")
        value_start = {}
        for k in keys:
            add(f"fact {k}")
            value_start[k] = add(values[k])
            add(".\n")
        # Questions at random fractions of the rest of the document, each fact asked once.
        body = max(0, target - len(tokens))
        asked = rng.sample(keys, len(keys))
        marks = sorted(len(tokens) + round(body * rng.uniform(0.05, 1.0)) for _ in asked)
        spans, distances = [], []
        for k, mark in zip(asked, marks):
            while len(tokens) < mark:
                add(rng.choice(pool))
            add(f"\nRecall {k}")
            start = add(values[k])
            spans.append((start, len(tokens)))
            distances.append(start - value_start[k])
            add(".\n")
        while len(tokens) < target - 1:
            add(rng.choice(pool))
        tokens.append(tok.eos_id)
        return Document(tokens, spans, distances)


LOOKUP_KEYS = "#$%&@^"
LOOKUP_VALUES = "0123456789abcdefghijklmnopqrstuvwxy"
_DOT, _QUESTION = ord("."), ord("?")
LOOKUP_FACTS = [b for b in range(256) if chr(b) not in LOOKUP_KEYS + LOOKUP_VALUES and b not in (_DOT, _QUESTION)][
    : len(LOOKUP_KEYS) * len(LOOKUP_VALUES)
]
"""The byte of each (key, value) fact of ``synthetic_lookup``: ``LOOKUP_FACTS[key * 35 + value]``
(every byte but the keys, the dots, the question mark and the 35 value characters, which name
the values and are not tokens of the documents)."""


class SyntheticLookup:
    """Long-range recall as a single lookup: facts at a document's start, each asked once at a
    random point of the rest, amid filler that carries no information.

    One document of exactly ``tokens`` tokens (byte-tokenizer ids)::

        <BOS> F F F F F F          <- 6 facts, each ONE token standing for a (key, value) pair
        .........?$F........?#F... <- filler dots; a question is ``?`` and a key symbol, its answer
                                      the token of that key's fact

    The keys are the symbols ``#$%&@^``, each with 35 values: a fact is a byte of its own for
    each (key, value) pair (:data:`LOOKUP_FACTS`), drawn at random per document. Knowing the key
    leaves 35 candidates (chance ``1/35``); only the document's own fact tells which, however
    far back it sits. One attention layer can answer (the question's key matched against the
    fact tokens, whose token it copies), where a fact written as a key token then a value token
    needs a two-layer circuit that forms only after a long plateau (``docs/recall.md``). The
    questions sit at uniform random points, so their distances spread evenly over the document:
    a document as long as a row, sharded contiguously over ``cp`` ranks, asks about a quarter
    of its questions at each distance of 0..3 shards for ``cp = 4``. The loss is on the answers
    alone (``loss_mask``): the rest is predictable without context. Document ``i`` depends only
    on ``(seed, split, i)``; ``validation`` draws from its own random stream.
    """

    chance = 1 / len(LOOKUP_VALUES)
    """The accuracy of a guess at one value."""

    def __init__(self, tokenizer: Tokenizer, seed: int = 0, split: Split = "train", tokens: int = 8192) -> None:
        facts = len(LOOKUP_KEYS)
        if tokens < 1 + 4 * facts:
            raise ValueError(f"a document of {facts} facts needs at least {1 + 4 * facts} tokens, got {tokens}")
        if not isinstance(tokenizer, ByteTokenizer):
            raise ValueError(
                "synthetic_lookup is written in byte-tokenizer ids (a fact is a byte of its own): leave "
                "model.hf_assets_path unset"
            )
        self.tokenizer, self.seed, self.split, self.tokens = tokenizer, seed, split, tokens

    def document(self, index: int) -> Document:
        rng = random.Random(f"synthetic_lookup/{self.split}/{self.seed}/{index}")
        keys = rng.sample(range(len(LOOKUP_KEYS)), len(LOOKUP_KEYS))
        value = {k: rng.randrange(len(LOOKUP_VALUES)) for k in keys}
        tokens, fact_at = [self.tokenizer.bos_id], {}
        for k in keys:
            fact_at[k] = len(tokens)
            tokens.append(LOOKUP_FACTS[k * len(LOOKUP_VALUES) + value[k]])
        # the questions' starts: distinct 3-token slots of the rest, in order
        slots = (self.tokens - len(tokens)) // 3
        starts = sorted(len(tokens) + 3 * s for s in rng.sample(range(slots), len(keys)))
        spans, distances = [], []
        for k, start in zip(rng.sample(keys, len(keys)), starts):
            tokens += [_DOT] * (start - len(tokens)) + [_QUESTION, ord(LOOKUP_KEYS[k])]
            spans.append((len(tokens), len(tokens) + 1))
            distances.append(len(tokens) - fact_at[k])
            tokens.append(LOOKUP_FACTS[k * len(LOOKUP_VALUES) + value[k]])  # the answer: the fact's token
        tokens += [_DOT] * (self.tokens - len(tokens))
        return Document(tokens, spans, distances, loss_mask=answers_mask(len(tokens), spans))


def answers_mask(length: int, spans: list[tuple[int, int]]) -> list[bool]:
    """A document's ``loss_mask`` with its answer spans as the only targets."""
    mask = [False] * length
    for start, end in spans:
        mask[start:end] = [True] * (end - start)
    return mask


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choices(_WORDS, k=rng.randint(6, 14))).capitalize() + ". "


# --------------------------------------------------------------------------------------------
# local files


def _blank(path: Path) -> bool:
    """Whether the text file ``path`` holds nothing but whitespace (read when it is small)."""
    size = path.stat().st_size
    if size > 1 << 16:
        return False
    with open(path, "rb") as f:
        return not f.read().strip()


class TextFiles:
    """Local text: ``.txt``/``.md`` files are one document each; ``.jsonl``/``.json`` files (JSON
    lines) one document per non-empty line, text under ``text_key``.

    ``path`` is a file or a folder (searched recursively, files in sorted order). Documents are
    indexed once at construction (file, byte offset, line) and read on demand. Construction
    checks every JSON line (JSON, an object whose ``text_key`` is a string) and the start of every
    text file (UTF-8, no NUL byte); what is read later is checked again. Errors are ``ValueError``
    naming the file and the line (or byte offset).
    """

    _SUFFIXES = (".txt", ".md", ".jsonl", ".json")

    def __init__(self, path: str | Path, tokenizer: Tokenizer, text_key: str = "text") -> None:
        path = Path(path)
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in self._SUFFIXES)
        self.tokenizer, self.text_key = tokenizer, text_key
        self._index: list[tuple[Path, int, int]] = []  # (file, byte offset of the JSON line or -1, line number)
        for f in files:
            if f.suffix not in (".jsonl", ".json"):
                check_text_file(f)
                if not _blank(f):  # an empty document would train on its begin/end tokens alone
                    self._index.append((f, -1, 0))
                continue
            with open(f, "rb") as fh:
                offset = 0
                for line_no, line in enumerate(fh, start=1):
                    where = f"{f}, line {line_no}"
                    if line.strip() and self._record_text(parse_json_line(line, where), where).strip():
                        self._index.append((f, offset, line_no))
                    offset += len(line)
        if not files:
            raise ValueError(f"no documents ({'/'.join(self._SUFFIXES)}) under {str(path)!r}")
        if not self._index:
            names = ", ".join(str(f.relative_to(path)) if f != path else f.name for f in files[:3])
            raise ValueError(
                f"{str(path)!r} holds no text: its {len(files)} file(s) ({names}{', ...' if len(files) > 3 else ''}) "
                "are empty or hold only empty records; point training.dataset_path at the data"
            )

    def __len__(self) -> int:
        return len(self._index)

    def _record_text(self, record: object, where: str) -> str:
        """The text of one JSON-lines record, or a ``ValueError`` prefixed by ``where``."""
        if not isinstance(record, dict):
            raise ValueError(f"{where}: a record must be a JSON object with {self.text_key!r}, got {record!r:.60}")
        if self.text_key not in record:
            raise ValueError(f"{where}: no {self.text_key!r} key (keys: {sorted(record)[:10]})")
        text = record[self.text_key]
        if not isinstance(text, str):
            raise ValueError(f"{where}: {self.text_key!r} must be a string, got {type(text).__name__} {text!r:.60}")
        return text

    def text(self, index: int) -> str:
        file, offset, line_no = self._index[index % len(self._index)]
        if offset < 0:
            return read_text(file)
        where = f"{file}, line {line_no} (read again: did the file change after the run started?)"
        with open(file, "rb") as fh:
            fh.seek(offset)
            return self._record_text(parse_json_line(fh.readline(), where), where)

    def document(self, index: int) -> Document:
        return Document(self.tokenizer.encode(self.text(index), bos=True, eos=True))


class HFDiskDataset:
    """A Hugging Face dataset saved with ``save_to_disk``, read with ``datasets.load_from_disk``
    (local only). A ``DatasetDict`` contributes its ``split`` split."""

    def __init__(self, path: str | Path, tokenizer: Tokenizer, split: Split = "train", text_key: str = "text") -> None:
        try:
            import datasets
        except ImportError as e:
            raise ImportError(
                "reading a Hugging Face dataset needs the optional 'datasets' package: pip install 'titan_cp[data]'"
            ) from e
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"{str(path)!r} has splits {sorted(ds)}, not {split!r}")
            ds = ds[split]
        if text_key not in ds.column_names:
            raise ValueError(f"{str(path)!r} has columns {ds.column_names}, not {text_key!r}")
        self._ds, self.tokenizer, self.text_key, self.path = ds, tokenizer, text_key, str(path)

    def __len__(self) -> int:
        return len(self._ds)

    def document(self, index: int) -> Document:
        row = index % len(self._ds)
        text = self._ds[row][self.text_key]
        if not isinstance(text, str):
            raise ValueError(f"{self.path}, row {row}: {self.text_key!r} must be a string, got {text!r:.60}")
        return Document(self.tokenizer.encode(text, bos=True, eos=True))


def _is_saved_hf_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / f).is_file() for f in HF_DATASET_MARKERS)


def build_dataset(
    job_config: JobConfig, tokenizer: Tokenizer, split: Split = "train", announce: bool = False
) -> DocumentSource:
    """The source named by ``training.dataset`` (``split="train"``) or ``validation.dataset``.

    ``synthetic_recall`` and ``synthetic_lookup`` (one document a row of the split's ``seq_len``)
    are built in (seeded by ``training.seed``; validation is their held-out split). ``text``, ``chat`` and ``hf`` read ``*.dataset_path``; ``chat`` records carry loss on
    the roles in ``training.loss_roles``. ``mixture`` (training only) draws from the sources of
    ``training.mixture`` by weight, seeded by ``training.seed``. Any other name (e.g. torchtitan's
    ``c4``) needs ``*.dataset_path`` too, and is read as a saved HF dataset or as text/JSONL files,
    whichever the path holds. ``announce``: log what a source drops (chat records without a loss
    turn), on one rank.
    """
    section = "training" if split == "train" else "validation"
    cfg = getattr(job_config, section)
    t = job_config.training
    if cfg.dataset == "mixture":
        if split != "train":
            raise ValueError("validation.dataset = 'mixture' is not supported: name one source for validation")
        if not t.mixture:
            raise ValueError(
                "training.dataset = 'mixture' needs sources in training.mixture ([[training.mixture]] tables)"
            )
        return Mixture(
            [
                (
                    m.name,
                    _source(
                        m.kind,
                        m.path,
                        f"training.mixture[{m.name!r}]",
                        "kind",
                        "path",
                        job_config,
                        tokenizer,
                        split,
                        announce,
                    ),
                    m.weight,
                )
                for m in t.mixture
            ],
            seed=t.seed,
        )
    if split == "train" and t.mixture:
        raise ValueError(
            f"training.mixture lists sources but training.dataset = {t.dataset!r}: set training.dataset = "
            "'mixture' to train on them, or remove the table"
        )
    return _source(
        cfg.dataset, cfg.dataset_path, section, "dataset", "dataset_path", job_config, tokenizer, split, announce
    )


def _source(
    name: str,
    path: str | None,
    section: str,
    name_key: str,
    path_key: str,
    job_config: JobConfig,
    tokenizer: Tokenizer,
    split: Split,
    announce: bool = False,
) -> DocumentSource:
    """One source of kind ``name`` at ``path``; errors name ``{section}.{name_key}`` / ``{section}.{path_key}``."""
    if name == "synthetic_recall":
        return SyntheticRecall(tokenizer, seed=job_config.training.seed, split=split)
    if name == "synthetic_lookup":  # one document a row
        seq_len = job_config.training.seq_len if split == "train" else job_config.validation_rows()[1]
        return SyntheticLookup(tokenizer, seed=job_config.training.seed, split=split, tokens=seq_len)
    if name == "mixture":
        raise ValueError(f"{section}.{name_key} = 'mixture': a mixture cannot hold another mixture")
    if not path:
        raise ValueError(
            f"{section}.{name_key} = {name!r} is not built in (built in: 'synthetic_recall', 'synthetic_lookup'); set "
            f"{section}.{path_key} to a local copy: titan_cp never downloads data"
        )
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{section}.{path_key} = {path!r} does not exist")
    if name == "chat":
        t = job_config.training
        template = None
        if t.chat_template == "tokenizer":
            template = getattr(tokenizer, "chat_template", None)
            if template is None:
                raise ValueError(
                    "training.chat_template = 'tokenizer', but the tokenizer (model.hf_assets_path = "
                    f"{job_config.model.hf_assets_path!r}) has no chat_template in its tokenizer_config.json; "
                    "set training.chat_template = 'chatml'"
                )
        return ChatJsonl(p, tokenizer, t.loss_roles, template, announce)
    if name == "hf":
        check_saved_hf_dataset(p, f"{section}.{name_key}", f"{section}.{path_key}")
    if name == "hf" or (name != "text" and _is_saved_hf_dataset(p)):
        return HFDiskDataset(p, tokenizer, split)
    return TextFiles(p, tokenizer)
