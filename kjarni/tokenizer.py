"""Text to token ids and back, for GGUF files and Hugging Face tokenizer folders.

``Tokenizer.from_gguf`` rebuilds a byte-level BPE tokenizer from GGUF metadata alone (tokens, merges,
token types, ``tokenizer.ggml.pre``) and tokenizes exactly like llama.cpp does for that file:

- special tokens in the text (``<|im_start|>``) become single ids, found the way llama.cpp's
  ``tokenizer_st_partition`` finds them (longest token text first, every occurrence), as llama-cli does
  for prompts (``parse_special=true``). ``encode(..., parse_special=False)`` treats control tokens as
  plain text (user-defined tokens are still matched, as in llama.cpp);
- the text between them is split by the regexes llama.cpp's ``llm_tokenizer_bpe`` uses for the
  file's ``tokenizer.ggml.pre`` (``_PRE_TOKENIZER_REGEXES``), each applied in turn, then byte-level BPE.

``Tokenizer.from_dir`` uses ``tokenizer.json`` as Hugging Face wrote it, with bos/eos/add_bos from
``tokenizer_config.json``, ``special_tokens_map.json`` and ``generation_config.json``.

Decoding is the concatenation of ``token_bytes`` decoded as UTF-8, so streaming (which joins
``token_bytes`` itself and holds back incomplete UTF-8) and ``decode`` always agree.
"""

from __future__ import annotations

import json
import mmap
import re
import struct
import threading
from pathlib import Path
from typing import Any, Iterable

from tokenizers import Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from kjarni.errors import InvalidConfigurationError, InvalidModelError, KjarniError, LoadFailedError

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# The split regexes of llama.cpp's llm_tokenizer_bpe (src/llama-vocab.cpp), per tokenizer.ggml.pre.
# Each regex splits every piece left by the previous one; matches and the text between them both
# become pieces (tokenizers' Split behavior="isolated"). The `(?:'[sS]|...)` spelling is llama.cpp's
# case-insensitive contraction rule written without `(?i:...)`.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    "gpt-2": (_GPT2_REGEX,),
    "phi-2": (_GPT2_REGEX,),
    "mpt": (_GPT2_REGEX,),
    "olmo": (_GPT2_REGEX,),
    "smollm": (r"\p{N}", _GPT2_REGEX),  # digits one by one, then GPT-2
    "starcoder": (r"\p{N}", _GPT2_REGEX),
    "refact": (r"\p{N}", _GPT2_REGEX),
    "codeshell": (r"\p{N}", _GPT2_REGEX),
    "llama-bpe": (_LLAMA3_REGEX,),
    "llama3": (_LLAMA3_REGEX,),
    "llama-v3": (_LLAMA3_REGEX,),
    "dbrx": (_LLAMA3_REGEX,),
    "smaug-bpe": (_LLAMA3_REGEX,),
    "qwen2": (_QWEN2_REGEX,),
    "deepseek-r1-qwen": (_QWEN2_REGEX,),
    "stablelm2": (_QWEN2_REGEX,),
    "megrez": (_QWEN2_REGEX,),
}
# llama.cpp's llama3 family looks a whole pre-token up in the vocabulary before merging
# (ignore_merges) and adds BOS unless the file says otherwise.
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3"}
_ADD_BOS_DEFAULT = {"llama-bpe", "llama3", "llama-v3"}

# Token texts that end a turn; llama.cpp treats them as end-of-generation by name. FIM tokens, which
# llama.cpp also stops on, are left out: kjarni does not do fill-in-the-middle.
_END_OF_TURN_TEXTS = frozenset(
    {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
     "<|end_of_text|>", "<EOT>"}
)

_GGUF_KEYS = (
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id", "tokenizer.ggml.add_bos_token",
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are written in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}
_SPM_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class Tokenizer:
    """Encodes text to token ids and decodes ids to text for one model.

    Build it with ``Tokenizer.from_gguf`` or ``Tokenizer.from_dir``. ``token_bytes`` gives the exact
    bytes a token stands for (for streaming); special tokens are control or user-defined tokens.
    """

    def __init__(self, *, hf: HFTokenizer, tokens: list[str], special_ids: Iterable[int],
                 bos_token_id: int | None, eos_token_ids: Iterable[int], add_bos: bool,
                 byte_level: bool, partition_specials: bool, control_ids: Iterable[int] = ()) -> None:
        # Special-token texts are parsed by `hf` and kept literal by a copy of it made on first
        # use: tokenizers' encode_special_tokens is a setting of the object, and toggling one
        # shared object would let two threads encoding at once get each other's setting.
        self._hf = hf
        self._hf.encode_special_tokens = False
        self._hf_literal: HFTokenizer | None = None
        self._literal_lock = threading.Lock()
        self._tokens = tokens
        self._special_ids = frozenset(special_ids)
        self._control_ids = frozenset(control_ids)
        self._byte_level = byte_level
        self._partition_specials = partition_specials
        # llama.cpp matches special tokens longest text first (tokenizer_st_partition).
        self._specials_by_length = sorted(self._special_ids, key=lambda i: -len(tokens[i].encode()))
        self._bytes_cache: dict[int, bytes] = {}
        self.bos_token_id = bos_token_id
        self.eos_token_ids = frozenset(eos_token_ids)
        self.add_bos = bool(add_bos and bos_token_id is not None)
        self.vocab_size = len(tokens)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_gguf(cls, path_or_reader: Any) -> "Tokenizer":
        """Builds the tokenizer of a GGUF file (a path or a ``gguf.GGUFReader``) from its metadata.

        Only byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) are supported; the
        pre-tokenizer named by ``tokenizer.ggml.pre`` must be one of ``_PRE_TOKENIZER_REGEXES``.
        """
        if isinstance(path_or_reader, (str, Path)):
            path = Path(path_or_reader)
            meta = _read_gguf_metadata(path, _GGUF_KEYS)
        else:
            path = Path(getattr(path_or_reader, "path", "<GGUFReader>"))
            meta = _metadata_from_reader(path_or_reader, _GGUF_KEYS)
        return cls._from_gguf_metadata(meta, path)

    @classmethod
    def _from_gguf_metadata(cls, meta: dict[str, Any], path: Path) -> "Tokenizer":
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise InvalidModelError(
                f"{path}: tokenizer.ggml.model is {kind!r}; kjarni reads only byte-level BPE "
                "vocabularies ('gpt2') from GGUF files. Use a model with a BPE tokenizer, or its "
                "Hugging Face folder (tokenizer.json).")
        pre = meta.get("tokenizer.ggml.pre", "")
        if pre not in _PRE_TOKENIZER_REGEXES:
            raise InvalidModelError(
                f"{path}: tokenizer.ggml.pre is {pre!r}, which kjarni cannot reproduce; supported: "
                f"{', '.join(sorted(_PRE_TOKENIZER_REGEXES))}. Use a model with one of these.")
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            if key not in meta:
                raise LoadFailedError(f"{path}: GGUF metadata lacks {key}; the file is incomplete or "
                                      "not a language model. Re-download or re-convert it.")
        tokens = [t.decode("utf-8", errors="replace") for t in meta["tokenizer.ggml.tokens"]]
        types = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens))
        merges = [tuple(m.decode("utf-8", errors="replace").split(" ", 1))
                  for m in meta["tokenizer.ggml.merges"]]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        # Some vocabularies lack a few byte symbols (SmolLM2 has no 0xF1 byte). llama.cpp keeps such
        # a byte as a symbol while merging, so its neighbours cannot merge across it, and drops it at
        # the end; tokenizers would drop it first. Give each one a placeholder id past the vocabulary
        # and filter those ids out after encoding.
        for char in _BYTE_OF_CHAR:
            if char not in vocab:
                vocab[char] = len(vocab)
        _check_merges(merges, vocab, path)
        try:
            bpe = models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES)
        except BaseException as exc:  # plain Exception for inconsistent merges, or a Rust panic
            _reraise_unless_tokenizers(exc)
            raise LoadFailedError(f"{path}: the GGUF vocabulary and merges disagree ({exc}); the "
                                  "file is corrupt. Re-download it.") from None
        hf = HFTokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_TOKENIZER_REGEXES[pre]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        hf.decoder = decoders.ByteLevel()

        control = [i for i, t in enumerate(types) if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN)]
        special = control + [i for i, t in enumerate(types) if t == TOKEN_TYPE_USER_DEFINED]
        bos = _token_id(meta.get("tokenizer.ggml.bos_token_id"), len(tokens))
        eos = _token_id(meta.get("tokenizer.ggml.eos_token_id"), len(tokens))
        eos_ids = {i for i in (eos, _token_id(meta.get("tokenizer.ggml.eot_token_id"), len(tokens)),
                               _token_id(meta.get("tokenizer.ggml.eom_token_id"), len(tokens)))
                   if i is not None}
        eos_ids |= {i for i in control if tokens[i] in _END_OF_TURN_TEXTS}
        add_bos = meta.get("tokenizer.ggml.add_bos_token", pre in _ADD_BOS_DEFAULT)
        return cls(hf=hf, tokens=tokens, special_ids=special, control_ids=control, bos_token_id=bos,
                   eos_token_ids=eos_ids, add_bos=bool(add_bos), byte_level=True,
                   partition_specials=True)

    @classmethod
    def from_dir(cls, folder: str | Path) -> "Tokenizer":
        """Builds the tokenizer of a Hugging Face model folder (``tokenizer.json`` and friends)."""
        folder = Path(folder)
        tokenizer_json = folder / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise LoadFailedError(f"{folder}: no tokenizer.json; kjarni needs the fast-tokenizer file. "
                                  "Download it with the model or save it with transformers.")
        try:
            hf = HFTokenizer.from_file(str(tokenizer_json))
            spec = json.loads(tokenizer_json.read_text(encoding="utf-8"))
        except BaseException as exc:  # any Exception, or tokenizers' Rust panic
            _reraise_unless_tokenizers(exc)
            raise LoadFailedError(f"{tokenizer_json}: cannot be read ({type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0] if str(exc) else ''}). Re-download it.") from None
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        generation = _read_json(folder / "generation_config.json")

        size = hf.get_vocab_size(with_added_tokens=True)
        tokens = [""] * size
        for tok, i in hf.get_vocab(with_added_tokens=True).items():
            if i < size:
                tokens[i] = tok
        special = [t["id"] for t in spec.get("added_tokens", []) if t.get("special")]

        def token_of(name: str) -> int | None:
            value = config.get(name, special_map.get(name))
            if isinstance(value, dict):
                value = value.get("content")
            return hf.token_to_id(value) if isinstance(value, str) else None

        bos = token_of("bos_token")
        if bos is None and isinstance(generation.get("bos_token_id"), int):
            bos = generation["bos_token_id"]
        eos_ids = {i for i in (token_of("eos_token"),) if i is not None}
        gen_eos = generation.get("eos_token_id")
        eos_ids |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if isinstance(gen_eos, int) else [])
        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"])
        else:  # what the tokenizer.json post-processor does with add_special_tokens=True
            add_bos = bos is not None and hf.encode("a", add_special_tokens=True).ids[:1] == [bos]
        byte_level = _has_byte_level_decoder(spec.get("decoder"))
        return cls(hf=hf, tokens=tokens, special_ids=special, control_ids=special, bos_token_id=bos,
                   eos_token_ids=eos_ids, add_bos=add_bos, byte_level=byte_level,
                   partition_specials=False)

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_bos: bool | None = None, *, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_bos=None`` follows the model's own rule (``self.add_bos``).

        Special-token texts in ``text`` become their single ids (llama.cpp's ``parse_special``);
        with ``parse_special=False`` control tokens are tokenized as plain text. Text that is not
        valid Unicode (a lone surrogate such as ``"\\ud800"``) raises ``InvalidConfigurationError``
        naming its position; a failure inside tokenizers raises ``LoadFailedError``, never a
        Rust panic.
        """
        _check_text(text)
        try:
            return self._encode(text, add_bos, parse_special)
        except BaseException as exc:
            _reraise_unless_tokenizers(exc)
            raise LoadFailedError(f"tokenizers failed encoding a text of {len(text)} characters "
                                  f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                                  "the model's vocabulary is corrupt. Re-download the model.") from None

    def _encode(self, text: str, add_bos: bool | None, parse_special: bool) -> list[int]:
        ids: list[int] = []
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids.append(self.bos_token_id)
        if not self._partition_specials:
            # tokenizer.json carries its own added-token rules; Hugging Face is the truth there.
            hf = self._hf if parse_special else self._literal_hf()
            ids.extend(hf.encode(text, add_special_tokens=False).ids)
            return ids
        for piece in self._partition(text, parse_special):
            if isinstance(piece, int):
                ids.append(piece)
            else:
                ids.extend(self._hf.encode(piece, add_special_tokens=False).ids)
        if self._hf.get_vocab_size() > self.vocab_size:
            ids = [i for i in ids if i < self.vocab_size]  # the missing-byte placeholders
        return ids

    def _literal_hf(self) -> HFTokenizer:
        """The copy of the tokenizers object that encodes special-token texts as plain text."""
        with self._literal_lock:
            if self._hf_literal is None:
                literal = HFTokenizer.from_str(self._hf.to_str())
                literal.encode_special_tokens = True
                self._hf_literal = literal
            return self._hf_literal

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Splits text into plain fragments and special-token ids the way llama.cpp does."""
        pieces: list[str | int] = [text] if text else []
        for sid in self._specials_by_length:
            if not parse_special and sid in self._control_ids:
                continue
            needle = self._tokens[sid]
            if not needle:
                continue
            out: list[str | int] = []
            for piece in pieces:
                if isinstance(piece, int) or needle not in piece:
                    out.append(piece)
                    continue
                parts = piece.split(needle)
                for k, part in enumerate(parts):
                    if k:
                        out.append(sid)
                    if part:
                        out.append(part)
            pieces = out
        return pieces

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of ``ids``: their ``token_bytes`` joined and decoded as UTF-8 (bad bytes -> U+FFFD)."""
        return b"".join(self.token_bytes(int(i), skip_special=skip_special) for i in ids).decode(
            "utf-8", errors="replace")

    def token_bytes(self, token_id: int, skip_special: bool = False) -> bytes:
        """The exact bytes token ``token_id`` stands for; a special token gives its text as UTF-8,
        or ``b""`` when ``skip_special``."""
        if not 0 <= token_id < self.vocab_size:
            raise IndexError(f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        if token_id in self._special_ids:
            return b"" if skip_special else self._tokens[token_id].encode("utf-8")
        cached = self._bytes_cache.get(token_id)
        if cached is None:
            cached = self._bytes_cache[token_id] = self._raw_bytes(self._tokens[token_id])
        return cached

    def _raw_bytes(self, token: str) -> bytes:
        if self._byte_level:
            try:
                return bytes(_BYTE_OF_CHAR[c] for c in token)
            except KeyError:  # a token outside the byte alphabet (an added token): its own text
                return token.encode("utf-8")
        match = _SPM_BYTE.fullmatch(token)  # SentencePiece style: <0x0A> byte tokens, ▁ for space
        return bytes([int(match.group(1), 16)]) if match else token.replace("\u2581", " ").encode("utf-8")

    def is_special(self, token_id: int) -> bool:
        """True for control and user-defined tokens (``<|im_start|>``, ``<tool_call>``, ...)."""
        return token_id in self._special_ids

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry of ``token_id`` as stored (byte-level alphabet for BPE)."""
        return self._tokens[token_id]


# ---------------------------------------------------------------------- helpers
def _check_text(text: Any) -> None:
    """Refuse what tokenizers cannot take: a non-str, or a str that is not valid Unicode."""
    if not isinstance(text, str):
        raise InvalidConfigurationError(f"the text to encode must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidConfigurationError(
            f"the text has a lone surrogate {text[exc.start]!r} at character {exc.start} (of {len(text)}), "
            "which is not valid Unicode; remove it, or decode the bytes it came from with errors='replace'"
        ) from None


def _reraise_unless_tokenizers(exc: BaseException) -> None:
    """Let kjarni's own errors and interrupts through; what is left is a tokenizers failure.

    tokenizers' Rust panics surface as ``pyo3_runtime.PanicException``, which derives from
    BaseException (not Exception) and so escapes ``except Exception``.
    """
    if isinstance(exc, KjarniError) or not (isinstance(exc, Exception) or type(exc).__name__ == "PanicException"):
        raise exc


def _check_merges(merges: list[tuple[str, ...]], vocab: dict[str, int], path: Path) -> None:
    """Every merge names two tokens of the vocabulary and makes a third: tokenizers panics otherwise."""
    for i, merge in enumerate(merges):
        if len(merge) != 2 or merge[0] not in vocab or merge[1] not in vocab or merge[0] + merge[1] not in vocab:
            raise LoadFailedError(
                f"{path}: GGUF merge {i} ({' '.join(merge)!r}) does not join two tokens of the vocabulary "
                "into a third; the tokenizer metadata is corrupt. Re-download or re-convert the file.")


def _token_id(value: Any, vocab_size: int) -> int | None:
    return int(value) if value is not None and 0 <= int(value) < vocab_size else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LoadFailedError(f"{path}: not valid JSON ({exc}). Re-download it.") from exc
    return data if isinstance(data, dict) else {}


def _has_byte_level_decoder(decoder: Any) -> bool:
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_has_byte_level_decoder(d) for d in decoder.get("decoders", []) or [])


# GGUF metadata value types (gguf.GGUFValueType) -> struct format of a scalar.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
           12: "<d"}
_STRING, _ARRAY = 8, 9


def _read_gguf_metadata(path: Path, wanted: Iterable[str]) -> dict[str, Any]:
    """Reads the wanted key/value pairs of a GGUF header without touching the tensors.

    gguf.GGUFReader parses every tensor and builds one numpy view per array element, which takes
    seconds for a 150k-token vocabulary; this walks the metadata once and keeps only ``wanted``.
    Strings come back as ``str``, arrays of strings as lists of ``bytes`` (decoded by the caller).
    """
    wanted = set(wanted)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse_gguf_kv(buf, wanted, path)
    except (OSError, ValueError) as exc:
        raise LoadFailedError(f"{path}: cannot read the GGUF header ({exc}). Check the path, or "
                              "re-download the file.") from exc
    except struct.error as exc:
        raise LoadFailedError(f"{path}: the GGUF header is truncated ({exc}). Re-download the file.") from exc


def _parse_gguf_kv(buf: Any, wanted: set[str], path: Path) -> dict[str, Any]:
    if buf[:4] != b"GGUF":
        raise LoadFailedError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}).")
    version, _n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise LoadFailedError(f"{path}: GGUF version {version} is too old; re-convert the model.")
    pos = 24
    unpack = struct.unpack_from

    def read_string(pos: int) -> tuple[bytes, int]:
        (n,) = unpack("<Q", buf, pos)
        return buf[pos + 8:pos + 8 + n], pos + 8 + n

    out: dict[str, Any] = {}
    for _ in range(n_kv):
        key_bytes, pos = read_string(pos)
        key = key_bytes.decode("utf-8", errors="replace")
        (vtype,) = unpack("<I", buf, pos)
        pos += 4
        keep = key in wanted
        if vtype == _STRING:
            raw, pos = read_string(pos)
            value = raw.decode("utf-8", errors="replace")
        elif vtype == _ARRAY:
            etype, count = unpack("<IQ", buf, pos)
            pos += 12
            if etype == _STRING:
                value = [] if keep else None
                for _ in range(count):
                    (n,) = unpack("<Q", buf, pos)
                    if keep:
                        value.append(buf[pos + 8:pos + 8 + n])
                    pos += 8 + n
            elif etype in _SCALAR:
                fmt = _SCALAR[etype]
                size = struct.calcsize(fmt)
                value = list(struct.unpack_from(f"<{count}{fmt[1]}", buf, pos)) if keep else None
                pos += size * count
            else:
                raise LoadFailedError(f"{path}: GGUF key {key} holds an array of type {etype}, "
                                      "which this reader does not know; re-convert the model.")
        elif vtype in _SCALAR:
            (value,) = unpack(_SCALAR[vtype], buf, pos)
            pos += struct.calcsize(_SCALAR[vtype])
        else:
            raise LoadFailedError(f"{path}: GGUF key {key} has unknown value type {vtype}; the file "
                                  "is corrupt or newer than this reader.")
        if keep:
            out[key] = value
    return out


def _metadata_from_reader(reader: Any, wanted: Iterable[str]) -> dict[str, Any]:
    """The wanted fields of a ``gguf.GGUFReader``, in the shapes ``_read_gguf_metadata`` returns."""
    out: dict[str, Any] = {}
    for key in wanted:
        field = reader.fields.get(key)
        if field is None or not field.types:
            continue
        if field.types[0] == 9:  # array
            elem = field.types[1] if len(field.types) > 1 else None
            parts = [field.parts[i] for i in field.data]
            out[key] = [bytes(p) for p in parts] if elem == _STRING else [p[0].item() for p in parts]
        elif field.types[0] == _STRING:
            out[key] = bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
        else:
            out[key] = field.parts[field.data[0]][0].item()
    return out
