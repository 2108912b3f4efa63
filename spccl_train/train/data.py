"""Training data from local files only: corpus, tokenizer, token windows.

Sources (``data.source``):

* ``embedded``: an encyclopedia-like English corpus generated from a fixed seed (entities with
  invented names, places, dates and relations in varied sentence templates), so the default run
  needs nothing but the package. It has real structure to learn: loss falls well below the
  unigram entropy in a few hundred steps of a tiny model.
* ``wikitext103``: WikiText-103 from ``data.paths`` (a folder with ``wiki.train.raw`` or
  ``wiki.train.tokens``, or the Hugging Face parquet layout ``train-*.parquet``), else from the
  local Hugging Face datasets cache; never from the hub.
* ``files``: text files (``.txt``, ``.raw``, ``.tokens``, ``.md``; folders are searched) or
  parquet files with a ``text`` column.

Text is read through ``datasets`` (offline), tokenized by a byte-level BPE trained on the corpus
(or a local ``tokenizer.json``), and cached as a flat int32 token file keyed by everything that
determines it; rank 0 prepares, the other ranks wait and read the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import random

import torch

from .config import DataConfig

__all__ = ["DataError", "TokenData", "embedded_corpus", "prepare_tokens", "default_cache_dir"]

EOS = "<|endoftext|>"
_TEXT_SUFFIXES = (".txt", ".raw", ".tokens", ".md", ".text")


class DataError(RuntimeError):
    """The configured data or tokenizer cannot be found or read; the message says what to provide."""


def default_cache_dir(cfg: DataConfig) -> pathlib.Path:
    """``data.cache_dir``, else ``$SPCCL_DATA_DIR``, else ``~/.cache/spccl_train/data``."""
    root = cfg.cache_dir or os.environ.get("SPCCL_DATA_DIR") or pathlib.Path.home() / ".cache" / "spccl_train" / "data"
    return pathlib.Path(root).expanduser()


# --------------------------------------------------------------------------- embedded corpus

_ONSETS = ["b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "r", "s", "st", "t", "tr", "v", "z"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ou", "ia"]
_CODAS = ["", "", "n", "r", "s", "l", "th", "nd", "m", "x"]
_KINDS = {
    "river": ("flows", "through", "km long"),
    "city": ("lies", "in", "inhabitants"),
    "mountain": ("rises", "above", "metres high"),
    "composer": ("was born", "in", "works"),
    "ship": ("was built", "at", "tonnes"),
    "language": ("is spoken", "in", "speakers"),
}
_ADJ = ["old", "small", "large", "northern", "southern", "famous", "quiet", "ancient", "modern", "remote"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October"]


def _name(rng: random.Random) -> str:
    syllables = rng.randint(2, 3)
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)).title()


def embedded_corpus(n_bytes: int, seed: int = 0) -> str:
    """A deterministic encyclopedia-like corpus of about ``n_bytes`` characters."""
    rng = random.Random(seed)
    regions = [_name(rng) for _ in range(40)]
    entities = [(_name(rng), rng.choice(list(_KINDS)), rng.choice(regions), rng.randint(2, 9000)) for _ in range(3000)]
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        name, kind, region, number = rng.choice(entities)
        verb, prep, unit = _KINDS[kind]
        other = rng.choice(entities)
        year = 1500 + (number * 7) % 520
        sentences = [
            f"= {name} =\n",
            f"{name} is a {rng.choice(_ADJ)} {kind} in {region}.",
            f"The {kind} {verb} {prep} {region} and has about {number} {unit}.",
            f"It was first described in {rng.choice(_MONTHS)} {year}, and {other[0]} is a {other[1]} near it.",
            f"Like {other[0]}, {name} is known across {region} for its {rng.choice(_ADJ)} history.",
            f"In {year + rng.randint(1, 60)} the people of {region} named a street after {name}.",
        ]
        body = sentences[0] + " ".join(sentences[1 : 2 + rng.randint(1, 4)]) + "\n\n"
        parts.append(body)
        size += len(body)
    return "".join(parts)


# --------------------------------------------------------------------------- reading text


def _text_files(paths: list[str]) -> list[pathlib.Path]:
    found: list[pathlib.Path] = []
    for raw in paths:
        p = pathlib.Path(raw).expanduser()
        if p.is_dir():
            found.extend(sorted(q for q in p.rglob("*") if q.is_file() and q.suffix in (*_TEXT_SUFFIXES, ".parquet")))
        elif p.is_file():
            found.append(p)
        else:
            raise DataError(f"data.paths entry {raw!r} does not exist: give existing text files or folders")
    if not found:
        raise DataError(f"data.paths={paths!r} holds no text files ({', '.join(_TEXT_SUFFIXES)}, .parquet)")
    return found


def _wikitext_files(paths: list[str]) -> list[pathlib.Path] | None:
    """The WikiText-103 training files under ``paths``, or None when none are given."""
    for raw in paths:
        root = pathlib.Path(raw).expanduser()
        for pattern in ("wiki.train.raw", "wiki.train.tokens", "**/wiki.train.raw", "**/wiki.train.tokens"):
            hits = sorted(root.glob(pattern))
            if hits:
                return hits[:1]
        hits = sorted(root.glob("**/wikitext-103-raw-v1/train-*.parquet")) or sorted(root.glob("**/train-*.parquet"))
        if hits:
            return hits
    if paths:
        raise DataError(
            f"no WikiText-103 training split under data.paths={paths!r}: expected wiki.train.raw, "
            "wiki.train.tokens or wikitext-103-raw-v1/train-*.parquet"
        )
    return None


def _load_lines(files: list[pathlib.Path], cache: pathlib.Path) -> list[str]:
    """The corpus as lines: text files read directly (the embedded corpus needs no ``datasets``),
    split as ``datasets``' text loader splits them (universal newlines, then at ``\n`` only),
    parquet files through Hugging Face ``datasets`` (their ``text`` column)."""
    if not any(f.suffix == ".parquet" for f in files):
        lines = []
        for f in files:
            text = f.read_text(encoding="utf-8")
            lines += text.split("\n")[: -1 if text.endswith("\n") else None]
        return lines
    if not all(f.suffix == ".parquet" for f in files):
        raise DataError("data.paths mixes parquet and text files: give one kind")
    import datasets

    datasets.disable_progress_bars()
    ds = datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train", cache_dir=str(cache))
    if "text" not in ds.column_names:
        raise DataError(f"{files[0]}: no 'text' column (columns: {ds.column_names})")
    return ds["text"]


def _wikitext_from_hf_cache(cache: pathlib.Path) -> list[str]:
    import datasets
    import huggingface_hub.constants as hub

    # Never the hub, even if the caller imported these libraries before setting *_OFFLINE.
    saved = hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    hub.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        ds = datasets.load_dataset("wikitext", "wikitext-103-raw-v1", split="train")
    except Exception as exc:  # any failure means "not available offline"
        raise DataError(
            "WikiText-103 is not available locally (not in the Hugging Face datasets cache, and no data.paths): "
            "download it elsewhere (wikitext-103-raw-v1: wiki.train.raw or its parquet files) and set "
            "data.paths=[FOLDER], or use data.source=embedded"
        ) from exc
    finally:
        hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved
    return ds["text"]


def _source_files(cfg: DataConfig, cache: pathlib.Path) -> tuple[list[pathlib.Path], str]:
    """The corpus files and a fingerprint of their identity."""
    if cfg.source == "embedded":
        path = cache / f"embedded-{cfg.embedded_bytes}.txt"
        if not path.exists():
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(embedded_corpus(cfg.embedded_bytes))
            tmp.replace(path)
        return [path], f"embedded:{cfg.embedded_bytes}:v1"
    files = _text_files(cfg.paths) if cfg.source == "files" else _wikitext_files(cfg.paths)
    if files is None:
        return [], "wikitext103:hf-cache"
    ident = [f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    return files, f"{cfg.source}:" + ";".join(ident)


# --------------------------------------------------------------------------- tokenizer


def _train_bpe(lines: list[str], cfg: DataConfig, path: pathlib.Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.tokenizer_vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def head():
        budget = cfg.tokenizer_train_bytes
        for line in lines:
            if budget <= 0:
                return
            budget -= len(line)
            yield line

    tok.train_from_iterator(head(), trainer=trainer)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tok.save(str(tmp))
    tmp.replace(path)
    return tok


def _load_tokenizer_file(spec: str):
    from tokenizers import Tokenizer

    p = pathlib.Path(spec).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise DataError(
            f"data.tokenizer={spec!r}: no tokenizer.json there; give a local tokenizer.json (or a folder with one), "
            "or data.tokenizer=bpe to train one on the corpus"
        )
    return Tokenizer.from_file(str(p))


# --------------------------------------------------------------------------- tokens


class TokenData:
    """A flat token stream cut into ``seq_len + 1`` windows, batched deterministically per step."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, vocab_size: int, eos_id: int, meta: dict) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.meta = meta
        self.windows = (tokens.numel() - 1) // seq_len
        if self.windows < 1:
            raise DataError(f"the corpus has {tokens.numel()} tokens, fewer than data.seq_len+1={seq_len + 1}")

    def batch(self, step: int, rank: int, world: int, micro_batch: int, seed: int) -> torch.Tensor:
        """The ``[micro_batch, seq_len + 1]`` token windows of ``rank`` at ``step``.

        Depends only on (seed, step, rank, world, micro_batch), so dense and SpCCL runs see the
        same data.
        """
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(self.windows, (world * micro_batch,), generator=gen)[
            rank * micro_batch : (rank + 1) * micro_batch
        ]
        offsets = starts[:, None] * self.seq_len + torch.arange(self.seq_len + 1)
        return self.tokens[offsets].long()


def _cache_key(cfg: DataConfig, fingerprint: str) -> str:
    spec = {
        "source": fingerprint,
        "tokenizer": cfg.tokenizer if cfg.tokenizer == "bpe" else str(pathlib.Path(cfg.tokenizer).resolve()),
        "vocab": cfg.tokenizer_vocab_size,
        "train_bytes": cfg.tokenizer_train_bytes,
        "max_tokens": cfg.max_tokens,
        "version": 1,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def prepare_tokens(cfg: DataConfig, *, rank: int = 0, barrier=None) -> TokenData:
    """Tokenize the corpus (rank 0; cached) and load it on every rank.

    ``barrier`` (a callable) separates rank 0's preparation from the other ranks' reads.
    """
    cache = default_cache_dir(cfg)
    token_path = meta_path = None
    if rank == 0:
        cache.mkdir(parents=True, exist_ok=True)
        token_path, meta_path = _prepare(cfg, cache)
    if barrier is not None:
        barrier()
    if token_path is None:
        _, fingerprint = _source_files_readonly(cfg, cache)
        key = _cache_key(cfg, fingerprint)
        token_path, meta_path = cache / f"tokens-{key}.bin", cache / f"tokens-{key}.json"
    meta = json.loads(meta_path.read_text())
    tokens = torch.from_file(str(token_path), shared=False, size=meta["num_tokens"], dtype=torch.int32)
    return TokenData(tokens, cfg.seq_len, meta["vocab_size"], meta["eos_id"], meta)


def _source_files_readonly(cfg: DataConfig, cache: pathlib.Path) -> tuple[list[pathlib.Path], str]:
    if cfg.source == "embedded":
        return [cache / f"embedded-{cfg.embedded_bytes}.txt"], f"embedded:{cfg.embedded_bytes}:v1"
    return _source_files(cfg, cache)


def _prepare(cfg: DataConfig, cache: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    files, fingerprint = _source_files(cfg, cache)
    key = _cache_key(cfg, fingerprint)
    token_path, meta_path = cache / f"tokens-{key}.bin", cache / f"tokens-{key}.json"
    if token_path.exists() and meta_path.exists():
        return token_path, meta_path
    hf_cache = cache / "hf-datasets"
    lines = _load_lines(files, hf_cache) if files else _wikitext_from_hf_cache(hf_cache)
    lines = [line for line in lines if line.strip()]
    if not lines:
        raise DataError(f"the corpus ({cfg.source}) holds no text")
    if cfg.tokenizer == "bpe":
        tok_path = cache / f"bpe-{key}.json"
        tok = _train_bpe(lines, cfg, tok_path)
    else:
        tok = _load_tokenizer_file(cfg.tokenizer)
        tok_path = pathlib.Path(cfg.tokenizer)
    eos_id = tok.token_to_id(EOS)
    if eos_id is None:
        eos_id = tok.get_vocab_size() - 1
    chunks: list[torch.Tensor] = []
    total = 0
    step = 4096
    for start in range(0, len(lines), step):
        encoded = tok.encode_batch(
            [line if line.endswith("\n") else line + "\n" for line in lines[start : start + step]]
        )
        ids = [i for enc in encoded for i in enc.ids]
        chunks.append(torch.tensor(ids, dtype=torch.int32))
        total += len(ids)
        if cfg.max_tokens and total >= cfg.max_tokens:
            break
    tokens = torch.cat(chunks)
    if cfg.max_tokens:
        tokens = tokens[: cfg.max_tokens]
    tmp = token_path.with_suffix(f".tmp{os.getpid()}")
    tokens.numpy().tofile(tmp)
    tmp.replace(token_path)
    meta = {
        "num_tokens": int(tokens.numel()),
        "vocab_size": int(tok.get_vocab_size()),
        "eos_id": int(eos_id),
        "tokenizer": str(tok_path),
        "source": cfg.source,
        "files": [str(f) for f in files],
    }
    meta_path.write_text(json.dumps(meta, indent=1))
    return token_path, meta_path
