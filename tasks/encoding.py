"""Tasks through a real tokenizer: the same examples, rendered as text and encoded with a
Hugging Face model's own tokenizer (the built-in model keeps its word vocabulary).

The text is the example's words joined by spaces. The colon is located from the tokenizer's
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


def tokenizer_fingerprint(tok) -> str:
    """A digest of what the tokenizer does (its whole serialised form when it is a fast
    tokenizer, else its vocabulary): equal fingerprints encode every text alike."""
    h = hashlib.sha256()
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(repr(sorted(tok.get_vocab().items())).encode())
    h.update(repr(sorted((tok.special_tokens_map or {}).items())).encode())
    return h.hexdigest()[:16]


class TokenizerEncoding:
    """Examples -> token ids with one Hugging Face tokenizer (loaded from a local folder)."""

    def __init__(self, tokenizer, source: str = ""):
        self.tok = tokenizer
        self.source = source
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        self.vocab_size = len(tokenizer)
        self._first: dict[str, int] = {}
        self._encoded: dict[Example, Encoded] = {}

    @classmethod
    def from_folder(cls, folder: str | Path) -> TokenizerEncoding:
        from transformers import AutoTokenizer

        folder = Path(folder)
        try:
            tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError, TypeError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            files = [f for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")
                     if (folder / f).is_file()]  # fmt: skip
            where = f"{folder} ({', '.join(files)})" if files else str(folder)
            raise ValueError(f"{where} has no usable tokenizer ({first})") from None
        enc = cls(tok, str(folder))
        enc.check_colon()
        return enc

    def check_colon(self) -> None:
        """The colon every prompt ends with must be a token of its own: one the tokenizer
        knows (not its unknown token), or no prompt can be read at it."""

        ids = self._ids(f"x {vocab.COLON}")["input_ids"]
        unk = self.tok.unk_token_id
        text = self.tok.decode(ids[-1:]).strip() if ids else ""
        if not ids or (unk is not None and ids[-1] == unk) or text != vocab.COLON:
            files = [f for f in ("tokenizer.json", "vocab.json", "tokenizer.model")
                     if (Path(self.source) / f).is_file()]  # fmt: skip
            where = Path(self.source) / files[0] if self.source and files else self.source
            raise ValueError(f"the tokenizer {where or ''} has no token of its own for the colon "
                             f"{vocab.COLON!r} (it becomes {text or 'nothing'!r}): the tasks' "
                             "prompts cannot be rendered with it")  # fmt: skip

    def describe(self) -> dict:
        """What a dataset records of the tokenizer it was encoded with."""
        return {"fingerprint": self.fingerprint, "source": self.source,
                "class": type(self.tok).__name__, "size": self.vocab_size}  # fmt: skip

    def _ids(self, text: str, offsets: bool = False):
        return self.tok(text, add_special_tokens=False, return_offsets_mapping=offsets)

    def first_token(self, word: str) -> int:
        """The first token of ``word`` as it appears after a space (how labels follow the colon)."""
        if word not in self._first:
            ids = self._ids(" " + word)["input_ids"]
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
        prompt = " ".join(ex.prompt)
        text = ex.text
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
            char += len(w) + 1
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
