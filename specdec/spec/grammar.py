"""Output formats as grammars (llguidance): a matcher per constrained row, the masks it puts on both models'
logits, and the tokens it allows alone.

Constrained decoding samples from the target's logits with the tokens the grammar forbids at -inf.
Speculation stays lossless under it when every verified position is masked the same way: the matcher
is advanced along each row's draft to get the mask at every drafted position (and, for a token tree,
along every node's path), and the draft model draws from its own masked logits (its q is then the
distribution the token came from). The matcher only ever holds a row's emitted tokens: what a draft
advanced it by is rolled back. Where the grammar allows exactly one token (a key, punctuation, a
closing bracket), that token is the target's only possible choice, so it is emitted without any model
call (`forced`, jump-forward) and the target reads it in the next round's forward.
"""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from ..config import ResponseFormat

log = logging.getLogger(__name__)

# JSON without free whitespace: the separators are forced tokens, and a small model cannot wander into blanks
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# what output formats spell: spaces, a newline, digits, quotes, brackets, separators
SPELLING_SAMPLE = '{"name": "Ada", "year": 1815, "ok": [true, null]}\nIt is 3 - 4.'


class GrammarError(ValueError):
    """A response format the grammar engine cannot compile ("bad_response_format: ..."), or a tokenizer it cannot
    follow formats with ("tokenizer: ...")."""


def grammar_text(fmt: ResponseFormat) -> str:
    """The llguidance grammar of an output format."""
    from llguidance import LLMatcher

    if fmt.type == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if fmt.type == "json_schema":
        return LLMatcher.grammar_from_json_schema(fmt.json_schema.schema_, defaults=JSON_OPTIONS)
    if fmt.type == "regex":
        return LLMatcher.grammar_from_regex(fmt.regex)
    if fmt.type == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in fmt.choice))
    raise ValueError(f"response_format type {fmt.type} has no grammar")


class Grammars:
    """Compiles output formats for one tokenizer (once per format); each row gets its own matcher."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        self.hf_tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, eos_ids
        self._tokenizer = None
        self._compiled: dict[str, object] = {}  # format (JSON) -> a fresh matcher to copy, or the error

    def tokenizer(self):
        """llguidance's view of the target's tokenizer, built and checked (`check_spelling`) once; GrammarError
        (the same one every time) where it cannot serve output formats."""
        if self._tokenizer is None:
            import llguidance.hf

            if self.hf_tokenizer is None:
                raise GrammarError("bad_response_format: output formats need the target's tokenizer")
            try:
                self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=list(self.eos_ids) or None)
                check_spelling(self.hf_tokenizer, self._tokenizer)
            except (ValueError, TypeError, RuntimeError) as exc:
                self._tokenizer = exc if isinstance(exc, GrammarError) else GrammarError(
                    f"tokenizer: llguidance cannot read {tokenizer_file(self.hf_tokenizer)}: {exc}")
                log.warning("rows with an output format will be error rows: %s", self._tokenizer)
        if isinstance(self._tokenizer, GrammarError):
            raise self._tokenizer
        return self._tokenizer

    def matcher(self, fmt: ResponseFormat):
        """A new matcher for `fmt`, or GrammarError naming what is wrong with it (or with the tokenizer)."""
        from llguidance import LLMatcher

        key = fmt.model_dump_json()
        self.tokenizer()
        if key not in self._compiled:
            try:
                m = LLMatcher(self.tokenizer(), grammar_text(fmt), log_level=0)
                self._compiled[key] = GrammarError(f"bad_response_format: {m.get_error()}") if m.is_error() else m
            except (ValueError, TypeError, RuntimeError) as exc:  # a schema that is not JSON, a bad regex
                self._compiled[key] = GrammarError(f"bad_response_format: {exc}")
        compiled = self._compiled[key]
        if isinstance(compiled, GrammarError):
            raise compiled
        return compiled.deep_copy()


def tokenizer_file(hf_tokenizer) -> str:
    """The file a transformers tokenizer was read from: its folder's tokenizer.json (or GGUF file), else its name."""
    path = getattr(hf_tokenizer, "name_or_path", "") or "the target's tokenizer"
    gguf = getattr(hf_tokenizer, "init_kwargs", {}).get("gguf_file")
    if gguf:
        return os.path.join(path, gguf)
    file = os.path.join(path, "tokenizer.json")
    return file if os.path.isfile(file) else path


def check_spelling(hf_tokenizer, ll_tokenizer) -> None:
    """Raise GrammarError ("tokenizer: ...", naming the tokenizer's file) if the bytes llguidance takes a text's
    tokens to spell are not that text: a grammar would then mask by the wrong bytes (a tokenizer.json whose
    decoder does not undo its pre-tokenizer: a byte-level BPE with a SentencePiece decoder finds no token that
    spells a space). A pre-tokenizer's leading space is allowed."""
    text = SPELLING_SAMPLE
    ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    spelled = ll_tokenizer.decode_bytes(ids)
    if spelled in (text.encode(), b" " + text.encode()):
        return
    decoded = hf_tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    file = tokenizer_file(hf_tokenizer)
    if decoded.strip() == text:
        why = (f"llguidance reads the tokens of {text!r} as {spelled.decode(errors='replace')!r}, though transformers "
               "decodes them right")
    else:
        why = f"it decodes its own tokens of {text!r} as {decoded!r}: its decoder does not undo its pre-tokenizer"
    pre = json.loads(hf_tokenizer.backend_tokenizer.to_str()).get("pre_tokenizer") or {}
    byte_level = "ByteLevel" in json.dumps(pre)
    raise GrammarError(f"tokenizer: {file}: {why}, so no output format can be followed; fix the file's `decoder`"
                       + (' (its ByteLevel pre-tokenizer needs {"type": "ByteLevel"})' if byte_level else ""))


def _bits(bitmask: np.ndarray, vocab: int, device) -> torch.Tensor:
    """int32 bitmasks [..., words] -> allowed tokens [..., vocab] (bool, on `device`)."""
    words = torch.from_numpy(bitmask).to(device)
    bits = (words[..., None] >> torch.arange(32, device=device, dtype=torch.int32)) & 1
    return bits.flatten(-2)[..., :vocab].bool()


class Constraints:
    """The matchers of a batch's rows, by slot (None: an unconstrained row), kept in the batch's slots (a copied
    row gets a copy of its source's)."""

    def __init__(self, slots, vocab_size: int, device, eos: frozenset[int] = frozenset()):
        self.matchers: list[object | None] = slots.add_objects(
            "matcher", lambda src, dst: None if src is None else src.deep_copy())
        self.eos = eos  # end-of-sequence ids: a grammar that is complete allows them, never consumes them
        self.vocab_size, self.device = vocab_size, device
        self.words = (vocab_size + 31) // 32
        self._drafted: list[int] = []  # per slot: tokens the draft advanced its matcher by (rolled back after)
        self._stuck: list[bool] = []  # per slot: the draft left the grammar

    def rows(self, n: int) -> list[int]:
        """The constrained rows among [0, n)."""
        return [i for i in range(n) if self.matchers[i] is not None]

    def set(self, slot: int, matcher) -> None:
        """The row at `slot` follows `matcher` (None: unconstrained)."""
        self.matchers[slot] = matcher

    def _mask(self, m) -> np.ndarray:
        mask = np.frombuffer(m.compute_bitmask(), dtype=np.int32)[: self.words]  # llguidance: vocab // 32 + 1 words
        return mask if mask.any() else np.full(self.words, -1, dtype=np.int32)  # a dead end: unreachable, unmasked

    def forced(self, slot: int, limit: int) -> list[int]:
        """The tokens, up to `limit`, the row's grammar allows alone from here: consumed, they are the row's."""
        m, out = self.matchers[slot], []
        while len(out) < limit and not m.is_error():
            mask = self._mask(m)
            if np.unpackbits(mask.view(np.uint8)).sum() != 1:
                break
            word = int(np.flatnonzero(mask)[0])
            token = 32 * word + int(np.uint32(mask[word])).bit_length() - 1
            if token >= self.vocab_size or not m.consume_token(token):
                break
            out.append(token)
        return out

    def commit(self, slot: int, tokens: list[int]) -> bool:
        """The row emitted `tokens`; False if its grammar forbids them (they were verified under its masks: a bug)."""
        m = self.matchers[slot]
        if m is None or not tokens:
            return True
        return self._valid(m, tokens) == len(tokens) and m.consume_tokens([t for t in tokens if t not in self.eos])

    # ---- the draft model's steps: mask, draw, advance; then roll back

    def draft_mask(self, n: int, vocab: int) -> torch.Tensor:
        """[n, vocab] the tokens each row's grammar allows at its next draft position (all, for free rows)."""
        masks = np.full((n, self.words), -1, dtype=np.int32)
        for i in self.rows(n):
            masks[i] = self._mask(self.matchers[i])
        allowed = _bits(masks, vocab, self.device)
        return allowed | ~allowed.any(-1, keepdim=True)  # nothing left in the draft's vocabulary: unmasked

    def advance(self, n: int, tokens: list[int]) -> None:
        """Draft rows [0, n) drew `tokens` (a host list: a device sync per draft step). A row whose token its
        grammar forbids (past its end) stops following its draft: a matcher never consumes a forbidden token."""
        if len(self._drafted) < n:
            self._drafted, self._stuck = [0] * n, [False] * n
        for i in self.rows(n):
            m = self.matchers[i]
            if not self._stuck[i] and m.validate_tokens([tokens[i]]) == 1 and m.consume_token(tokens[i]):
                self._drafted[i] += 1
            else:
                self._stuck[i] = True

    def rollback(self, n: int) -> None:
        for i in self.rows(n):
            if i < len(self._drafted) and self._drafted[i]:
                self.matchers[i].rollback(self._drafted[i])
        self._drafted = []

    # ---- verification

    def valid_lengths(self, n: int, tokens: list[list[int]], lengths: np.ndarray) -> np.ndarray:
        """[n] each row's chain cut to its longest prefix the grammar allows (a token it forbids is dropped)."""
        out = lengths.copy()
        for i in self.rows(n):
            out[i] = self._valid(self.matchers[i], tokens[i][: int(lengths[i])])
        return out

    def _valid(self, m, tokens: list[int]) -> int:
        """How many of `tokens` the grammar allows from here, an end-of-sequence id where it is complete included."""
        ok = m.validate_tokens(tokens)
        if ok < len(tokens) and tokens[ok] in self.eos and m.consume_tokens(tokens[:ok]):
            complete = m.is_accepting()
            m.rollback(ok)
            ok += complete
        return ok

    def chain_masks(self, n: int, tokens: list[list[int]], lengths: np.ndarray, width: int) -> torch.Tensor:
        """[n, width, vocab] the tokens allowed at each verified position of the rows' chains: after the row's
        emitted tokens, then after each drafted token (all tokens, past a row's chain and for free rows)."""
        from llguidance.torch import fill_next_token_bitmask_par_with_draft_tokens

        masks = torch.full((n * width, self.words), -1, dtype=torch.int32)
        rows = [(self.matchers[i], i * width, tokens[i][: int(lengths[i])]) for i in self.rows(n)]
        if any(draft for _, _, draft in rows):
            fill_next_token_bitmask_par_with_draft_tokens(_executor(), [r for r in rows if r[2]], masks)
        masks = masks.numpy()
        for m, at, draft in rows:
            if not draft:
                masks[at] = self._mask(m)
        masks[~masks.view(np.uint32).any(-1)] = -1  # dead ends (unreachable): unmasked
        return _bits(masks.reshape(n, width, self.words), self.vocab_size, self.device)

    def tree_masks(self, n: int, tokens: np.ndarray, parent: np.ndarray, lengths: np.ndarray) -> torch.Tensor:
        """[n, T + 1, vocab] the tokens allowed after the root and after each node of the rows' token trees
        (host arrays [n, T]): the matcher advanced along each node's path."""
        t = tokens.shape[1]
        masks = np.full((n, t + 1, self.words), -1, dtype=np.int32)
        for i in self.rows(n):
            m = self.matchers[i]
            masks[i, 0] = self._mask(m)
            for j in range(int(lengths[i])):
                path, node = [], j + 1
                while node:
                    path.append(int(tokens[i, node - 1]))
                    node = int(parent[i, node - 1])
                path.reverse()
                if m.validate_tokens(path) == len(path) and m.consume_tokens(path):
                    masks[i, j + 1] = self._mask(m)
                    m.rollback(len(path))
        return _bits(masks, self.vocab_size, self.device)


_EXECUTOR: list = []


def _executor():
    if not _EXECUTOR:
        from llguidance import LLExecutor

        _EXECUTOR.append(LLExecutor())
    return _EXECUTOR[0]
