"""Finding weights: the GGUF cache key, what a modelWeightPath may name, and its errors."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from llm_engine import weights
from llm_engine.weights import FINGERPRINT_HEAD, fingerprint, resolve_model_dir


def _gguf(path, size=8 << 20, seed=0):
    """A file shaped like two fine-tunes of one base: the same first MiB (header, metadata,
    tokenizer) and the same size; the tensors differ where ``seed`` says."""
    head = bytes(range(256)) * (FINGERPRINT_HEAD // 256)
    body = bytearray(size - len(head))
    if seed:
        body[seed::997] = bytes([seed % 251 + 1]) * len(body[seed::997])
    path.write_bytes(head + bytes(body))
    return path


def test_the_cache_key_tells_apart_fine_tunes_that_share_name_size_and_header(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    base = _gguf(tmp_path / "a" / "model.gguf")
    tune = _gguf(tmp_path / "b" / "model.gguf", seed=7)
    assert base.stat().st_size == tune.stat().st_size
    assert base.read_bytes()[:FINGERPRINT_HEAD] == tune.read_bytes()[:FINGERPRINT_HEAD]
    assert fingerprint(base) != fingerprint(tune)


def test_the_cache_key_sees_a_change_in_the_last_bytes(tmp_path):
    one = _gguf(tmp_path / "one.gguf")
    (tmp_path / "x").mkdir()
    two = tmp_path / "x" / "one.gguf"
    data = bytearray(one.read_bytes())
    data[-1] ^= 1
    two.write_bytes(bytes(data))
    assert fingerprint(one) != fingerprint(two)


def test_the_cache_key_is_the_content_not_the_place(tmp_path):
    """Copies in two installs share one converted folder."""
    one = _gguf(tmp_path / "one.gguf", seed=3)
    (tmp_path / "elsewhere").mkdir()
    two = tmp_path / "elsewhere" / "one.gguf"
    shutil.copy(one, two)
    os.utime(two, (1, 1))
    assert fingerprint(one) == fingerprint(two)
    small = tmp_path / "small.gguf"
    small.write_bytes(b"GGUF" + bytes(100))  # smaller than the header read: no samples, no error
    assert fingerprint(small) != fingerprint(one)


def test_the_default_gguf_has_a_stable_key():
    path = weights.default_gguf_path()
    assert fingerprint(path) == fingerprint(path)
    assert len(fingerprint(path)) == 16


def test_a_weight_path_names_a_checkpoint_folder_or_a_gguf_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_dir(str(tmp_path)) == tmp_path
    with pytest.raises(FileNotFoundError, match="neither a checkpoint directory nor a .gguf file"):
        resolve_model_dir(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        resolve_model_dir(str(tmp_path / "empty"))
    (tmp_path / "w.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="neither a checkpoint directory nor a .gguf file"):
        resolve_model_dir(str(tmp_path / "w.safetensors"))


def test_the_converted_folder_is_named_for_the_content_and_the_converter(tmp_path, monkeypatch):
    """Installs with other transformers/tokenizers releases (or a changed converter) do not
    share a converted folder; the same release and file do."""
    from llm_engine.weights import cache_root, converter_id

    monkeypatch.setenv(weights.CACHE_ENV, str(tmp_path))
    gguf = _gguf(tmp_path / "m.gguf", size=2 << 20)
    calls = []
    monkeypatch.setattr(weights, "_convert", lambda src, target: calls.append(target) or target)
    first = weights.convert_gguf(gguf)
    assert first == cache_root() / f"m-{fingerprint(gguf)}-{converter_id()}"
    monkeypatch.setattr(weights, "CONVERTER_VERSION", weights.CONVERTER_VERSION + 1)
    assert converter_id() != first.name.rsplit("-", 1)[1]
    assert weights.convert_gguf(gguf) != first


def test_one_reading_of_the_weight_path_serves_the_folder_and_the_gguf(tmp_path):
    """``resolve_model_dir`` and ``gguf_source`` both follow ``locate_weights``."""
    default = weights.locate_weights("")
    assert default.is_gguf and default.path == weights.default_gguf_path()
    assert weights.gguf_source("") == default.path
    (tmp_path / "config.json").write_text("{}")
    folder = weights.locate_weights(str(tmp_path))
    assert folder == weights.WeightSource(tmp_path, False)
    assert weights.gguf_source(str(tmp_path)) is None
    gguf = _gguf(tmp_path / "m.gguf", size=2 << 20)
    assert weights.locate_weights(str(gguf)) == weights.WeightSource(gguf, True)
    assert weights.gguf_source(str(gguf)) == gguf
    for bad in ("missing.gguf", "w.bin"):
        with pytest.raises(FileNotFoundError):
            weights.locate_weights(str(tmp_path / bad))
        assert weights.gguf_source(str(tmp_path / bad)) is None


def test_a_conversion_that_died_leaves_nothing_the_next_one_keeps(tmp_path, monkeypatch):
    """A killed conversion's temp folder is removed by the next conversion of that file
    (under its lock); other files' folders and the lock files stay."""
    monkeypatch.setenv(weights.CACHE_ENV, str(tmp_path / "cache"))
    gguf = _gguf(tmp_path / "m.gguf", size=2 << 20)
    target = weights.cache_root() / f"m-{fingerprint(gguf)}-{weights.converter_id()}"
    dead = target.parent / f"{target.name}.k1x9q"
    dead.mkdir(parents=True)
    (dead / "model.safetensors").write_bytes(b"half")
    other = target.parent / "other-0123.abcd"
    other.mkdir()
    monkeypatch.setattr(weights, "_convert", lambda src, dst: dst)
    assert weights.convert_gguf(gguf) == target
    assert not dead.exists() and other.is_dir()
    assert (target.parent / f"{target.name}.lock").is_file()


def test_a_conversion_that_fails_removes_its_temp_folder(tmp_path, monkeypatch):
    import transformers

    class Saves:
        def __init__(self, fail):
            self.fail = fail

        def save_pretrained(self, path):
            (Path(path) / "part").write_bytes(b"x")
            if self.fail:
                raise OSError("No space left on device")

        def state_dict(self):
            return {}

        def load_state_dict(self, *a, **k):
            pass

        def tie_weights(self):
            pass

    class Loader:
        @staticmethod
        def from_pretrained(*a, **k):
            return Saves(fail=False)

        @staticmethod
        def from_config(config):
            return Saves(fail=True)

    for name in ("AutoTokenizer", "AutoModelForCausalLM", "AutoConfig"):
        monkeypatch.setattr(transformers, name, Loader)
    gguf = _gguf(tmp_path / "m.gguf", size=2 << 20)
    target = tmp_path / "cache" / "m-converted"
    with pytest.raises(OSError, match="No space left"):
        weights._convert(gguf, target)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir()] == []
