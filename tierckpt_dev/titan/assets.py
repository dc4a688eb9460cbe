"""Demo assets for the torchtitan runs: a corpus of real text and a tokenizer trained on it.

Corpus choice: the docstrings of a fixed list of CPython standard-library modules, read from the
``.py`` sources of the running interpreter's stdlib (``sysconfig.get_path("stdlib")``). That text
is real English prose written by the CPython developers, it ships with every CPython install
(python:3.11 Docker images, Debian's python3.11, pyenv builds, CI runners), needs no network and
no extra package. The sources are parsed with :mod:`ast` (never imported), documents are taken in
a fixed order (module list below, then source order inside each module) and then shuffled once
with a fixed seed (so every batch mixes modules), so the same interpreter always yields the same
bytes. A different CPython patch release may carry slightly different
docstrings; the manifest records the Python version the corpus came from and the hashes of every
file, and a cached build is reused as long as its recipe and hashes match.

Tokenizer: byte-level BPE trained with the ``tokenizers`` library on that corpus, vocabulary
:data:`VOCAB_SIZE` (= the llama3 debug model's vocabulary, 2048, special tokens included), trained
single-threaded so merges are chosen in the same order every time. It is saved as
``tokenizer.json`` + ``tokenizer_config.json`` (bos/eos names), the layout torchtitan's
``HuggingFaceTokenizer`` loads from ``hf_assets_path``.

Layout of an assets directory (default ``<repo>/outputs/assets``, or ``$TIERCKPT_ASSETS_DIR``)::

    corpus.jsonl                  one JSON object per document: {"source": ..., "text": ...}
    tokenizer/tokenizer.json      the trained tokenizer
    tokenizer/tokenizer_config.json
    manifest.json                 recipe, per-file sha256 and size, assets_hash (written last)

The dataset is registered with torchtitan's text dataloader as :data:`DATASET_NAME`
(``register_dataset``); it is loaded from ``corpus.jsonl`` into an in-memory
``datasets.Dataset`` (no network, no Hugging Face cache directory).

CLI: ``python -m tierckpt_dev.titan.assets --out DIR [--rebuild]``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import fcntl
import hashlib
import json
import os
import random
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

ASSETS_ENV = "TIERCKPT_ASSETS_DIR"
DATASET_NAME = "tierckpt_corpus"
RECIPE_VERSION = 1
VOCAB_SIZE = 2048  # llama3 "debugmodel" vocab_size; special tokens included
MIN_DOC_CHARS = 80
SHUFFLE_SEED = 1234  # documents are shuffled once, deterministically, so batches mix modules
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)

# Prose-heavy stdlib modules, relative to the stdlib directory, without ".py". Order matters.
# Modules missing from an interpreter (e.g. removed in a later Python) are skipped and the
# manifest lists the ones actually used.
STDLIB_MODULES = (
    "argparse", "asyncio/events", "asyncio/tasks", "asyncio/streams", "base64", "bisect",
    "calendar", "collections/__init__", "configparser", "contextlib", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "email/message", "enum", "fractions", "ftplib",
    "functools", "gettext", "heapq", "http/client", "http/cookiejar", "imaplib", "inspect",
    "ipaddress", "json/__init__", "json/decoder", "logging/__init__", "logging/handlers",
    "mailbox", "optparse", "os", "pathlib", "pickle", "pickletools", "pydoc", "random",
    "shutil", "smtplib", "socket", "statistics", "string", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "tokenize", "turtle", "typing", "unittest/case", "urllib/parse",
    "urllib/request", "uuid", "warnings", "weakref", "xml/dom/minidom", "zipfile",
    "_pydecimal", "doctest", "codecs", "locale", "platform", "sched", "shlex", "socketserver",
    "ssl", "trace", "tracemalloc", "traceback", "zipimport", "webbrowser", "wave", "cmd",
    "pdb", "pprint", "queue", "secrets", "selectors", "signal", "site", "sqlite3/__init__",
    "timeit", "colorsys", "copy", "filecmp", "fileinput", "fnmatch", "glob", "hashlib", "hmac",
    "numbers", "operator", "pstats", "reprlib", "stat", "symtable", "tabnanny",
    "unittest/mock", "xmlrpc/client",
)

CORPUS_FILE = "corpus.jsonl"
TOKENIZER_DIR = "tokenizer"
MANIFEST_FILE = "manifest.json"
_BUILT_FILES = (
    CORPUS_FILE,
    f"{TOKENIZER_DIR}/tokenizer.json",
    f"{TOKENIZER_DIR}/tokenizer_config.json",
)


@dataclass(frozen=True)
class AssetPaths:
    root: Path
    corpus: Path  # corpus.jsonl: use as the dataloader's dataset_path
    tokenizer_dir: Path  # use as Trainer.Config.hf_assets_path
    manifest: Path
    assets_hash: str
    vocab_size: int
    num_documents: int


def default_assets_dir() -> Path:
    env = os.environ.get(ASSETS_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "outputs" / "assets"


def _recipe() -> dict:
    return {
        "recipe_version": RECIPE_VERSION,
        "corpus": "cpython-stdlib-docstrings",
        "modules": list(STDLIB_MODULES),
        "min_doc_chars": MIN_DOC_CHARS,
        "shuffle_seed": SHUFFLE_SEED,
        "tokenizer": "byte-level-bpe",
        "vocab_size": VOCAB_SIZE,
        "special_tokens": list(SPECIAL_TOKENS),
    }


# ---------------------------------------------------------------------------------- corpus


def _docstrings_in_source_order(tree: ast.Module, module: str):
    def visit(node, prefix):
        doc = ast.get_docstring(node, clean=True)
        name = module if prefix is None else prefix
        if doc:
            yield name, doc
        for child in node.body:
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                qual = child.name if prefix is None else f"{prefix}.{child.name}"
                yield from visit(child, qual)

    for name, doc in visit(tree, None):
        yield (module if name == module else f"{module}:{name}"), doc


def collect_documents(stdlib_dir: str | os.PathLike | None = None) -> tuple[list[dict], list[str]]:
    """Return (documents, modules used). Each document is {"source", "text"}."""
    root = Path(stdlib_dir or sysconfig.get_path("stdlib"))
    docs: list[dict] = []
    used: list[str] = []
    for rel in STDLIB_MODULES:
        path = root / f"{rel}.py"
        if not path.is_file():
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        module = rel.replace("/__init__", "").replace("/", ".")
        used.append(rel)
        for source, text in _docstrings_in_source_order(tree, module):
            if len(text) >= MIN_DOC_CHARS:
                docs.append({"source": source, "text": text})
    if not docs:
        raise RuntimeError(f"no stdlib docstrings found under {root}")
    # random.Random(int).shuffle is stable across CPython 3 releases (seeding and _randbelow
    # have not changed since 3.2), so the order depends only on the documents themselves.
    random.Random(SHUFFLE_SEED).shuffle(docs)
    return docs, used


# ------------------------------------------------------------------------------- tokenizer


@contextlib.contextmanager
def _single_threaded_tokenizers():
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with _single_threaded_tokenizers():
        tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def _tokenizer_config() -> dict:
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "model_max_length": 1 << 20,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }


# ---------------------------------------------------------------------------------- build


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_bytes_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _dump_json(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def _files_record(root: Path) -> dict:
    return {
        name: {"sha256": _sha256(root / name), "bytes": (root / name).stat().st_size}
        for name in _BUILT_FILES
    }


def _assets_hash(files: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(f"{name}\0{files[name]['sha256']}\n".encode())
    return h.hexdigest()


def build_assets(out_dir: str | os.PathLike, stdlib_dir: str | os.PathLike | None = None) -> dict:
    """Build (or overwrite) the assets in ``out_dir``; return the manifest. Deterministic."""
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    (root / MANIFEST_FILE).unlink(missing_ok=True)  # the manifest is the commit marker
    docs, used = collect_documents(stdlib_dir)

    corpus = "".join(
        json.dumps(d, sort_keys=True, ensure_ascii=False) + "\n" for d in docs
    ).encode("utf-8")
    _write_bytes_atomic(root / CORPUS_FILE, corpus)

    tok = train_tokenizer([d["text"] for d in docs])
    if tok.get_vocab_size() > VOCAB_SIZE:
        raise RuntimeError(f"tokenizer vocab {tok.get_vocab_size()} > {VOCAB_SIZE}")
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    _write_bytes_atomic(
        root / TOKENIZER_DIR / "tokenizer.json", (tok.to_str(pretty=True) + "\n").encode()
    )
    _write_bytes_atomic(
        root / TOKENIZER_DIR / "tokenizer_config.json", _dump_json(_tokenizer_config())
    )

    import tokenizers

    files = _files_record(root)
    manifest = {
        "recipe": _recipe(),
        "source": {
            "python": sys.version.split()[0],
            "stdlib_modules_used": used,
            "tokenizers": tokenizers.__version__,
        },
        "num_documents": len(docs),
        "corpus_chars": sum(len(d["text"]) for d in docs),
        "vocab_size": tok.get_vocab_size(),
        "files": files,
        "assets_hash": _assets_hash(files),
    }
    _write_bytes_atomic(root / MANIFEST_FILE, _dump_json(manifest))
    return manifest


def _valid_manifest(root: Path) -> dict | None:
    try:
        manifest = json.loads((root / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("recipe") != _recipe():
        return None
    try:
        if _files_record(root) != manifest.get("files"):
            return None
    except OSError:
        return None
    return manifest


def _paths(root: Path, manifest: dict) -> AssetPaths:
    return AssetPaths(
        root=root,
        corpus=root / CORPUS_FILE,
        tokenizer_dir=root / TOKENIZER_DIR,
        manifest=root / MANIFEST_FILE,
        assets_hash=manifest["assets_hash"],
        vocab_size=manifest["vocab_size"],
        num_documents=manifest["num_documents"],
    )


def ensure_assets(out_dir: str | os.PathLike | None = None, *, rebuild: bool = False) -> AssetPaths:
    """Return the assets in ``out_dir`` (default :func:`default_assets_dir`), building them if
    missing, incomplete, corrupted or from another recipe. Safe to call from several processes
    at once (an ``flock`` serialises builders; the others wait and reuse the result)."""
    root = Path(out_dir) if out_dir is not None else default_assets_dir()
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".build.lock", "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            manifest = None if rebuild else _valid_manifest(root)
            if manifest is None:
                manifest = build_assets(root)
            return _paths(root, manifest)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


# ------------------------------------------------------------------- torchtitan dataset hook


def load_corpus_dataset(path: str):
    """Loader for torchtitan's DATASETS registry: ``corpus.jsonl`` (or a directory holding it)
    -> in-memory map-style ``datasets.Dataset`` with ``text`` and ``source`` columns."""
    from datasets import Dataset

    p = Path(path)
    if p.is_dir():
        p = p / CORPUS_FILE
    texts, sources = [], []
    with open(p, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                texts.append(rec["text"])
                sources.append(rec.get("source", ""))
    return Dataset.from_dict({"text": texts, "source": sources})


def _sample_text(sample: dict) -> str:
    return sample["text"]


def register_dataset(path: str | os.PathLike | None = None) -> None:
    """Register :data:`DATASET_NAME` in torchtitan's text-dataset registry (idempotent).

    ``path`` is the default location (the dataloader's ``dataset_path`` overrides it)."""
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    default = str(path) if path is not None else str(default_assets_dir() / CORPUS_FILE)
    DATASETS[DATASET_NAME] = DatasetConfig(
        path=default, loader=load_corpus_dataset, sample_processor=_sample_text
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tierckpt_dev.titan.assets", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help=f"assets directory (default ${ASSETS_ENV} or outputs/assets)")
    ap.add_argument("--rebuild", action="store_true", help="rebuild even if a valid build exists")
    args = ap.parse_args(argv)
    paths = ensure_assets(args.out, rebuild=args.rebuild)
    print(
        json.dumps(
            {
                "root": str(paths.root),
                "corpus": str(paths.corpus),
                "tokenizer_dir": str(paths.tokenizer_dir),
                "assets_hash": paths.assets_hash,
                "vocab_size": paths.vocab_size,
                "num_documents": paths.num_documents,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
