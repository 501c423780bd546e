"""Each option declared once: flags, environment variables, config.pbtxt parameters and the
table of docs/options.md all come from the dataclass fields (pergola.config.options)."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

import pytest
from pergola.cli import SERVE_SETS, BuildOptions, options_markdown
from pergola.config.engine import EngineConfig, TritonModelOptions
from pergola.config.options import declared, env_name, flag_name, value_type
from pergola.gateway.options import GatewayOptions
from pergola.triton.server import ServerOptions

OPTIONS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "options.md"
CLASSES = [BuildOptions, ServerOptions, GatewayOptions, EngineConfig, TritonModelOptions]
ALL = [(cls, f) for cls in CLASSES for f in declared(cls)]


def serve_parser(command: str = "serve") -> argparse.ArgumentParser:
    """The `serve` (or another command's) subparser, built the way `pergola serve` builds it."""
    import pergola.cli as cli

    captured = {}
    real = argparse.ArgumentParser.parse_args

    def grab(self, args=None, namespace=None):
        captured["parser"] = self
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = grab
    try:
        with pytest.raises(SystemExit):
            cli.main(["serve"])
    finally:
        argparse.ArgumentParser.parse_args = real
    sub = next(a for a in captured["parser"]._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def parser_for(f) -> argparse.ArgumentParser:
    """`pergola gateway` for the gateway options `pergola serve` sets itself, else `serve`."""
    return serve_parser("gateway" if f.name in SERVE_SETS else "serve")


def other_value(f) -> tuple[str, object]:
    """A value unlike the default, as an environment string and as the parsed value."""
    kind, _ = value_type(f)
    default = f.default
    if f.metadata["choices"]:
        choice = next(c for c in f.metadata["choices"] if c != default)
        return choice, choice
    if kind is bool:
        return ("no", False) if default else ("yes", True)
    if kind is int:
        return str(default + 3), default + 3
    if kind is float:
        return str(default + 0.5), default + 0.5
    return "elsewhere", "elsewhere"


def test_the_options_page_holds_the_generated_table():
    text = OPTIONS_PAGE.read_text()
    start, end = "<!-- options:start -->\n", "\n<!-- options:end -->"
    assert start in text and end in text, "docs/options.md needs the options markers"
    assert text[text.index(start) + len(start):text.index(end)] == options_markdown(), \
        "docs/options.md's table is stale: paste `pergola options --markdown` between the markers"


def test_every_option_has_a_flag_and_a_row(capsys):
    flags = {s for command in ("serve", "gateway") for a in serve_parser(command)._actions for s in a.option_strings}
    table = options_markdown()
    for cls, f in ALL:
        assert flag_name(f) in flags, f"{cls.__name__}.{f.name} has no flag"
        assert f"`{env_name(f)}`" in table, f"{cls.__name__}.{f.name} has no row in the options table"
        assert f.metadata["help"], f"{cls.__name__}.{f.name} has no help"


@pytest.mark.parametrize("cls,f", ALL, ids=[f"{c.__name__}.{f.name}" for c, f in ALL])
def test_every_option_reads_its_environment_variable(monkeypatch, cls, f):
    raw, expected = other_value(f)
    monkeypatch.setenv(env_name(f), raw)
    args = parser_for(f).parse_args([])
    assert getattr(args, f.name) == expected


@pytest.mark.parametrize("raw,expected", [("true", True), ("1", True), ("yes", True), ("On", True),
                                          ("false", False), ("0", False), ("no", False), ("off", False)])
def test_booleans_accept_the_usual_words(monkeypatch, raw, expected):
    monkeypatch.setenv("PERGOLA_TRUNCATE", raw)
    assert serve_parser().parse_args([]).truncate is expected
    assert EngineConfig.from_parameters({"model_dir": "x", "truncate": raw}).truncate is expected


def test_bad_values_are_refused_with_the_option_named(monkeypatch):
    monkeypatch.setenv("PERGOLA_TRUNCATE", "maybe")
    with pytest.raises(ValueError, match="PERGOLA_TRUNCATE must be true or false"):
        serve_parser()
    monkeypatch.delenv("PERGOLA_TRUNCATE")
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--max-texts", "many"])
    with pytest.raises(ValueError, match="parameter max_texts must be int"):
        EngineConfig.from_parameters({"model_dir": "x", "max_texts": "many"})


def test_unset_fields_are_none_and_round_trip_through_parameters():
    cfg = EngineConfig(model_dir="/m", task="rerank", causal=False, truncate=False, metrics_flush_s=0.25)
    params = cfg.to_parameters()
    assert "pooling" not in params and "query_prompt" not in params  # None: not written
    again = EngineConfig.from_parameters(params)
    assert again == cfg
    assert EngineConfig(model_dir="/m").task is None


def test_no_option_is_declared_twice():
    names = [f.name for cls in CLASSES for f in fields(cls) if f.metadata.get("cli")]
    assert len(names) == len(set(names))
