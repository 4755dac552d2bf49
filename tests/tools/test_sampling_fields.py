"""SamplingParams's field declarations are the one source of the sampling parameters: a field added
there (here on a subclass) is accepted, with its bounds and doc, by the server's request model,
LangChain's fields and per-call options, lm-eval's gen_kwargs and the CLI's flags, and
docs/sampling.md's table is the one the declarations render. No model is loaded."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest
from pydantic import ValidationError

from minisgl_backend import InvalidSamplingParamsError
from minisgl_backend.types import SamplingParams, sampling_field, sampling_fields, surface_fields
from minisgl_backend.validation import Spec

DOC = "Keep the tokens whose typical mass sums to typical_p; 1 = off."


@dataclass(frozen=True)
class Extended(SamplingParams):
    """SamplingParams with one more field, declared as every field is."""

    typical_p: float = sampling_field(1.0, Spec("float", lo=0, hi=1, lo_open=True), DOC)
    # offered by the server only: the other front ends must not take it
    server_only: int = sampling_field(0, Spec("int", lo=0, hi=7), "A server-only knob.", surfaces=("server",))


def test_the_python_api_checks_the_new_field_by_its_spec():
    assert Extended(typical_p=0.5).typical_p == 0.5
    assert sampling_fields(Extended)["typical_p"].doc == DOC
    with pytest.raises(InvalidSamplingParamsError, match=r"typical_p must be a finite number in \(0, 1\]"):
        Extended(typical_p=0)
    with pytest.raises(InvalidSamplingParamsError, match="typical_p"):
        Extended.check_value("typical_p", 2.0)


def test_the_server_request_model_takes_the_new_field_with_its_bounds_and_doc():
    from minisgl_backend.serve.protocol import engine_sampling_model

    model = engine_sampling_model(Extended)
    body = model.model_validate({"typical_p": 0.5, "server_only": 3, "top_p": 0.9})
    given = {k: v for k, v in body.model_dump().items() if v is not None}
    assert Extended(**given).typical_p == 0.5
    for bad in ({"typical_p": 0}, {"typical_p": 1.5}, {"typical_p": "0.5"}, {"server_only": 8}):
        with pytest.raises(ValidationError):
            model.model_validate(bad)
    prop = model.model_json_schema()["properties"]["typical_p"]
    number = next(s for s in prop["anyOf"] if s["type"] == "number")
    assert (number["exclusiveMinimum"], number["maximum"], prop["description"]) == (0, 1, DOC)


def test_langchain_takes_the_new_field_as_a_field_and_a_per_call_option():
    pytest.importorskip("langchain_core")
    from langchain_minisgl._base import params_model

    model = params_model(Extended)
    llm = model(typical_p=0.5)
    assert llm.sampling_params(None, {}).typical_p == 0.5
    call = {"typical_p": 0.25}
    llm.check_call_kwargs(call)
    assert llm.sampling_params(None, call).typical_p == 0.25
    assert model.model_fields["typical_p"].description == DOC
    with pytest.raises(ValidationError, match="typical_p must be"):
        model(typical_p=0)
    with pytest.raises(ValidationError, match="unknown field"):
        model(server_only=1)
    with pytest.raises(TypeError, match="server_only"):
        llm.check_call_kwargs({"server_only": 1})


def test_lm_eval_passes_the_new_gen_kwarg_through():
    pytest.importorskip("lm_eval")
    from lm_eval_minisgl.model import accepted_gen_kwargs, sampling_params_from_gen_kwargs

    assert "typical_p" in accepted_gen_kwargs(Extended)
    assert "server_only" not in accepted_gen_kwargs(Extended)
    kwargs = {"until": ["\n"], "do_sample": True, "temperature": 0.5, "typical_p": 0.5}
    params, _, _ = sampling_params_from_gen_kwargs(kwargs, "</s>", 16, Extended)
    assert isinstance(params, Extended) and params.typical_p == 0.5
    with pytest.raises(InvalidSamplingParamsError, match="typical_p must be"):
        sampling_params_from_gen_kwargs({**kwargs, "typical_p": 0}, "</s>", 16, Extended)
    with pytest.raises(InvalidSamplingParamsError, match=r"\['server_only'\] are not supported"):
        sampling_params_from_gen_kwargs({**kwargs, "server_only": 1}, "</s>", 16, Extended)


def test_the_cli_has_a_flag_for_the_new_field():
    from minisgl_backend.cli import add_sampling_args, sampling_params_from_args

    parser = argparse.ArgumentParser()
    add_sampling_args(parser, Extended)
    params = sampling_params_from_args(parser.parse_args(["--typical-p", "0.5"]), Extended)
    assert isinstance(params, Extended) and params.typical_p == 0.5
    assert sampling_params_from_args(parser.parse_args([]), Extended).typical_p == 1.0
    with pytest.raises(InvalidSamplingParamsError, match="typical_p must be"):
        sampling_params_from_args(parser.parse_args(["--typical-p", "0"]), Extended)
    assert parser._option_string_actions["--typical-p"].help.startswith(DOC)
    with pytest.raises(SystemExit):
        parser.parse_args(["--server-only", "1"])


def test_every_front_end_offers_exactly_the_declared_fields():
    """The real SamplingParams: a field a front end declares by hand and the declarations do not
    offer it (or the reverse) fails here."""
    from minisgl_backend.cli import build_parser
    from minisgl_backend.serve.protocol import ChatCompletionRequest, CompletionRequest

    for request in (CompletionRequest, ChatCompletionRequest):
        assert set(surface_fields("server")) <= set(request.model_fields), request.__name__
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {o for a in sub.choices["generate"]._actions for o in a.option_strings}
    # the flags `minisgl generate` always had stay as they were
    assert {"--max-tokens", "--temperature", "--top-p", "--top-k", "--min-p", "--seed", "--stop"} <= flags
    assert {"--" + k.replace("_", "-") for k in surface_fields("cli")} <= flags
    pytest.importorskip("langchain_core")
    pytest.importorskip("lm_eval")
    from langchain_minisgl import ChatMiniSGL, MiniSGL
    from lm_eval_minisgl.model import accepted_gen_kwargs

    for cls in (MiniSGL, ChatMiniSGL):
        assert set(surface_fields("langchain")) <= set(cls.model_fields), cls.__name__
    # lm-eval spells stop `until` and max_tokens `max_gen_toks` (or an alias)
    assert set(surface_fields("lm_eval")) - {"stop"} <= accepted_gen_kwargs()


def test_the_sampling_page_is_the_rendered_table():
    from minisgl_backend.tools.sampling_doc import DOC as PAGE
    from minisgl_backend.tools.sampling_doc import documented_table, render_table

    assert documented_table(PAGE.read_text()) == render_table(), (
        "docs/sampling.md differs from SamplingParams's fields: "
        "run python -m minisgl_backend.tools.sampling_doc"
    )
    assert "`typical_p`" in render_table(Extended)
