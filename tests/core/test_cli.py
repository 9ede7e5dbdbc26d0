"""The `baton` command's answers to newcomer mistakes: usage errors and one-line errors, no tracebacks."""

from __future__ import annotations

import argparse
import json

import pytest

from baton.cli.main import add_engine_arguments, build_parser, engine_argv, engine_overrides, main


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--log-level", "LOUD", "hi"],
        ["--log-level", "LOUD", "generate", "hi"],
    ],
)
def test_an_unknown_log_level_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: baton")
    assert "argument --log-level: invalid choice: 'LOUD' (choose from" in err
    assert "Traceback" not in err


def test_an_unknown_log_level_from_the_environment_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("BATON_LOG_LEVEL", "loud")
    with pytest.raises(SystemExit) as info:
        main(["plugins"])
    assert info.value.code == 2
    assert "BATON_LOG_LEVEL='loud' is not a log level" in capsys.readouterr().err


def test_log_level_in_any_case_before_or_after_the_command():
    parser = build_parser()
    assert parser.parse_args(["generate", "--log-level", "debug", "hi"]).log_level == "DEBUG"
    assert parser.parse_args(["--log-level", "error", "generate", "hi"]).log_level == "ERROR"
    assert parser.parse_args(["generate", "hi"]).log_level == "WARNING"


def _bert_folder(path):
    path.mkdir()
    config = {"model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": 30522}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda p: p / "model.gguf", "is not a GGUF file"),
        (_bert_folder, "is not a causal language model"),
    ],
)
def test_a_model_that_cannot_load_is_one_line(tmp_path, monkeypatch, capsys, make, fragment):
    model = make(tmp_path / "m")
    if model.suffix == ".gguf":
        model.parent.mkdir()
        model.write_text("<html>404</html>")
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["generate", "--model", str(model), "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("baton: error: ") and fragment in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_engine_argv_gives_the_engine_flags_back_as_arguments() -> None:
    """What a command that starts another baton command passes on: parsed again, the same
    overrides (switches, --tp's long name, --set items), and nothing for a flag not given."""
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    given = ["--model", "tiny", "--tp", "2", "--enable-lora", "--set", "cache.block_size=32"]
    args = parser.parse_args(given)
    argv = engine_argv(args)
    assert argv == [
        "--model",
        "tiny",
        "--tensor-parallel-size",
        "2",
        "--enable-lora",
        "--set",
        "cache.block_size=32",
    ]
    assert engine_overrides(parser.parse_args(argv)) == engine_overrides(args)
    assert engine_argv(parser.parse_args([])) == []
