"""Tasks through a real tokenizer: the same examples, rendered as text and encoded with a
Hugging Face model's own tokenizer (the built-in model keeps its word vocabulary).

The text is the example's words joined by spaces, each label word rendered as the tokenizer's
label word for it (``choose_label_words``: the first of the task's ``LABEL_WORDS`` whose words
are single distinct tokens, recorded in every dataset and model folder made with it). The colon is located from the tokenizer's
character offsets: the prompt must end exactly where a token ends (a tokenizer that merges
the colon with the next word is refused), and the prompt's tokens must be the ones the
prompt alone encodes to (so the prompt a model is given is the one it was trained on). Each
label is scored by its first token, so two labels whose first tokens are the same cannot be
told apart: such a tokenizer is refused for the task. A counterfactual twin is kept where
its prompt differs from its example's in one token, or, where the two label words take
different numbers of tokens, in one run of tokens of another length (a shifted twin:
``encode_twin``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from tasks import vocab
from tasks.base import Example, Twin


@dataclass(frozen=True)
class Encoded:
    ids: list[int]  # the whole sequence, prompt and answer
    colon_index: int  # the token that ends the prompt (it ends with the colon)
    label_positions: tuple[int, ...]  # where each label's first token is, in ``ids``


def tokenizer_fingerprint(tok, label_words: dict | None = None) -> str:
    """A digest of what the tokenizer does (its whole serialised form when it is a fast
    tokenizer, else its vocabulary) and of the label words it renders (where any differ from
    the built-in ones): equal fingerprints encode every example alike."""
    h = hashlib.sha256()
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(repr(sorted(tok.get_vocab().items())).encode())
    h.update(repr(sorted((tok.special_tokens_map or {}).items())).encode())
    changed = {t: list(w) for t, w in sorted((label_words or {}).items()) if _renamed(t, w)}
    if changed:
        h.update(repr(changed).encode())
    return h.hexdigest()[:16]


def _renamed(task: str, words) -> bool:
    from tasks import get_task

    try:
        mod = get_task(task)
    except ValueError:
        return True
    return tuple(words) != tuple(getattr(mod, "LABELS", ()))


def _single(tok, word: str) -> int | None:
    """The one token ``word`` encodes to after a space, or None where it takes more."""
    ids = tok(" " + word, add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 else None


def choose_label_words(tok, tasks=None) -> dict[str, tuple[str, ...]]:
    """Per task (``tasks``: modules, default every registered one), the words its labels are
    rendered as with ``tok``: the first set of its ``LABEL_WORDS`` whose words are each one
    token after a space, no two the same, and none a token of another word the tasks use
    (their prompts' words and the sets chosen before). A label of one token is scored by that
    token and a twin whose label changes stays aligned with its example, token for token.
    Where no set qualifies, the built-in words (scored by their first token)."""
    from tasks import get_task, task_names

    mods = list(tasks) if tasks is not None else [get_task(t) for t in task_names()]
    labels = {w for m in mods for ws in getattr(m, "LABEL_WORDS", ()) for w in ws}
    taken: set[int] = set()
    for w in vocab.TOKENS:
        if w not in labels and w != vocab.PAD:
            taken.update(tok(" " + w, add_special_tokens=False)["input_ids"])
    out = {}
    for m in mods:
        options = getattr(m, "LABEL_WORDS", None) or (tuple(getattr(m, "LABELS", ())),)
        out[m.NAME] = tuple(options[0])
        for words in options:
            ids = [_single(tok, w) for w in words]
            if None not in ids and len(set(ids)) == len(ids) and not taken & set(ids):
                out[m.NAME] = tuple(words)
                break
        taken.update(i for w in out[m.NAME] if (i := _single(tok, w)) is not None)
    return out


def check_label_words(words, where: str) -> dict[str, tuple[str, ...]]:
    """A recorded ``label_words`` record ({task: [word, ...]}), refused in one line naming
    ``where`` unless each is a list of distinct words without spaces."""
    ok = isinstance(words, dict) and all(
        isinstance(k, str)
        and isinstance(v, list | tuple)
        and v
        and all(isinstance(w, str) and w and " " not in w for w in v)
        and len(set(v)) == len(v)
        for k, v in words.items()
    )
    if not ok:
        raise ValueError(f"{where}: label_words must map each task to a list of distinct words")
    return {k: tuple(v) for k, v in words.items()}


class TokenizerEncoding:
    """Examples -> token ids with one Hugging Face tokenizer (loaded from a local folder).
    ``label_words`` ({task: words}, as recorded by a model trained with them) fixes how the
    labels are rendered; without it they are chosen for the tokenizer (``choose_label_words``)."""

    def __init__(self, tokenizer, source: str = "", label_words: dict | None = None):
        self.tok = tokenizer
        self.source = source
        self.label_words = (
            dict(label_words) if label_words is not None else choose_label_words(tokenizer)
        )
        self.surface = self._surface()
        self.fingerprint = tokenizer_fingerprint(tokenizer, self.label_words)
        self.vocab_size = len(tokenizer)
        self._first: dict[str, int] = {}
        self._encoded: dict[Example, Encoded] = {}

    def _surface(self) -> dict[str, str]:
        """Each built-in label word -> the word it is rendered as (only those that differ)."""
        from tasks import get_task

        out: dict[str, str] = {}
        for task, words in self.label_words.items():
            try:
                mod = get_task(task)
            except ValueError:
                continue  # a task not registered here: its words are never rendered
            base = tuple(getattr(mod, "LABELS", ()))
            if len(base) != len(words):
                raise ValueError(
                    f"label_words of {task} must be {len(base)} words, got {len(words)}"
                )
            out.update({b: w for b, w in zip(base, words, strict=True) if b != w})
        return out

    def render(self, words) -> str:
        """Words as the text this tokenizer reads: label words renamed, joined by spaces."""
        return " ".join(self.surface.get(w, w) for w in words)

    @classmethod
    def from_folder(cls, folder: str | Path, label_words: dict | None = None) -> TokenizerEncoding:
        from transformers import AutoTokenizer

        folder = Path(folder)
        try:
            tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError, TypeError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            files = [
                f
                for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")
                if (folder / f).is_file()
            ]
            where = f"{folder} ({', '.join(files)})" if files else str(folder)
            raise ValueError(f"{where} has no usable tokenizer ({first})") from None
        enc = cls(tok, str(folder), label_words)
        enc.check_colon()
        return enc

    def check_colon(self) -> None:
        """The colon every prompt ends with must be a token of its own: one the tokenizer
        knows (not its unknown token), or no prompt can be read at it."""

        ids = self._ids(f"x {vocab.COLON}")["input_ids"]
        unk = self.tok.unk_token_id
        text = self.tok.decode(ids[-1:]).strip() if ids else ""
        if not ids or (unk is not None and ids[-1] == unk) or text != vocab.COLON:
            files = [
                f
                for f in ("tokenizer.json", "vocab.json", "tokenizer.model")
                if (Path(self.source) / f).is_file()
            ]
            where = Path(self.source) / files[0] if self.source and files else self.source
            raise ValueError(
                f"the tokenizer {where or ''} has no token of its own for the colon "
                f"{vocab.COLON!r} (it becomes {text or 'nothing'!r}): the tasks' "
                "prompts cannot be rendered with it"
            )

    def describe(self) -> dict:
        """What a dataset records of the tokenizer it was encoded with."""
        return {
            "fingerprint": self.fingerprint,
            "source": self.source,
            "class": type(self.tok).__name__,
            "size": self.vocab_size,
            "label_words": {t: list(w) for t, w in self.label_words.items()},
        }

    def _ids(self, text: str, offsets: bool = False):
        return self.tok(text, add_special_tokens=False, return_offsets_mapping=offsets)

    def first_token(self, word: str) -> int:
        """The first token of ``word`` as it appears after a space (how labels follow the colon)."""
        if word not in self._first:
            ids = self._ids(" " + self.surface.get(word, word))["input_ids"]
            if not ids:
                raise ValueError(f"the tokenizer encodes the label {word!r} to no token")
            self._first[word] = ids[0]
        return self._first[word]

    def check_labels(self, words) -> None:
        """Refuse labels whose first tokens collide (they could not be told apart)."""
        seen: dict[int, str] = {}
        for w in sorted(set(words)):
            t = self.first_token(w)
            if t in seen:
                raise ValueError(
                    f"labels {seen[t]!r} and {w!r} start with the same token "
                    f"({self.tok.convert_ids_to_tokens(t)!r}) in the tokenizer of "
                    f"{self.source or 'this model'}: this task cannot be scored with it"
                )
            seen[t] = w

    def encode(self, ex: Example) -> Encoded:
        hit = self._encoded.get(ex)
        if hit is None:
            if len(self._encoded) >= 65536:  # training draws fresh examples every step
                self._encoded.clear()
            hit = self._encoded[ex] = self._encode(ex)
        return hit

    def _encode(self, ex: Example) -> Encoded:
        prompt = self.render(ex.prompt)
        text = self.render(ex.tokens)
        enc = self._ids(text, offsets=True)
        ids, offs = list(enc["input_ids"]), list(enc["offset_mapping"])
        ends = [e for _, e in offs]
        if len(prompt) not in ends:
            raise ValueError(
                f"the tokenizer of {self.source or 'this model'} merges the prompt's colon with "
                "what follows it, so the prompt cannot be located"
            )
        colon = ends.index(len(prompt))
        if self._ids(prompt)["input_ids"] != ids[: colon + 1]:
            raise ValueError(
                f"the tokenizer of {self.source or 'this model'} encodes a prompt differently "
                "alone and followed by its answer"
            )
        # each label's first token is the first token that reaches into the label or the space
        # before it (byte-level tokenizers carry the space; labels follow the colon, one space
        # apart); it must be the token the label starts with alone
        char, word_chars = len(prompt) + 1, []
        for w in ex.rendered_answer:
            word_chars.append(char)
            char += len(self.surface.get(w, w)) + 1
        label_pos = []
        for off, label in zip(ex.label_offsets, ex.answer, strict=True):
            c = word_chars[off]
            j = next(i for i in range(colon + 1, len(ids)) if offs[i][1] > c - 1)
            if ids[j] != self.first_token(label):
                raise ValueError(
                    f"the tokenizer of {self.source or 'this model'} encodes the label {label!r} "
                    "differently after the colon than alone"
                )
            label_pos.append(j)
        return Encoded(ids, colon, tuple(label_pos))

    def encode_twin(self, clean: Encoded, twin: Twin) -> tuple[list[int], int, int] | None:
        """The twin's ids, the first prompt token where they differ from the example's
        (``clean``, its encoding) and the twin's colon index; None where the tokenizer breaks
        the twin contract. The prompts must differ in one contiguous run of tokens, with
        everything before and after it the same: one token changed in place (an aligned twin,
        the colon where the example's is), or, where the two label words take different
        numbers of tokens (" ZERO" two and " ONE" one, say), a run of another length (a
        shifted twin, its colon moved by the difference). The changed answer's first token
        must follow the colon as the example's does; what follows it may differ in length."""
        enc = self.encode(twin.example)
        a, b, c, tc = clean.ids, enc.ids, clean.colon_index, enc.colon_index
        j, tj = clean.label_positions[twin.target], enc.label_positions[twin.target]
        if tj - tc != j - c or a[j] == b[tj]:
            return None
        pre = next((i for i in range(min(c, tc) + 1) if a[i] != b[i]), None)
        if pre is None or pre >= min(c, tc):  # the colon itself changed
            return None
        post = 0  # prompt tokens equal from the end (the colon included)
        while post <= min(c, tc) - pre and a[c - post] == b[tc - post]:
            post += 1
        if c - post < pre or tc - post < pre:  # the equal ends overlap: no run changed
            return None
        if tc == c and c - post != pre:  # in place, one token only
            return None
        return b, pre, tc
