"""`minillama generate` as llama.cpp and mlx-lm users expect it: the model's chat template unless
--raw, --system, -p, a random seed unless given (printed so a run can be repeated), and the
sampling options chat has."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from minillama.app.chat_template import encode_chat
from minillama.app.cli import cli
from minillama.model.tokenizer import load_tokenizer
from tests.conftest import make_tiny

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    """A tiny random Llama whose tokenizer_config.json carries a ChatML template."""
    folder = make_tiny(tmp_path_factory.mktemp("templated"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return folder


def run(*args):
    result = CliRunner().invoke(cli, ["generate", *map(str, args)])
    assert result.exit_code == 0, result.output
    return result


def prompt_tokens(result) -> int:
    return int(re.search(r"prompt (\d+) tokens", result.stderr).group(1))


def test_a_model_with_a_template_gets_the_prompt_as_a_user_message(templated):
    tok = load_tokenizer(templated)
    chat = run("What is 2+2?", "-m", templated, "-n", 2)
    assert "(chat template)" in chat.stderr
    assert prompt_tokens(chat) == len(encode_chat(tok, [{"role": "user", "content": "What is 2+2?"}]))
    with_system = run("What is 2+2?", "--system", "Be terse.", "-m", templated, "-n", 2)
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2+2?"}]
    assert prompt_tokens(with_system) == len(encode_chat(tok, messages))


def test_raw_completes_the_prompt_as_plain_text(templated):
    raw = run("What is 2+2?", "--raw", "-m", templated, "-n", 2)
    assert "(chat template)" not in raw.stderr and prompt_tokens(raw) == len("What is 2+2?")  # one byte a token


def test_a_model_without_a_template_is_completed_raw_and_system_is_refused(tiny_dir):
    assert "(chat template)" not in run("hi", "-m", tiny_dir, "-n", 2).stderr
    result = CliRunner().invoke(cli, ["generate", "hi", "-m", str(tiny_dir), "--system", "x"])
    assert result.exit_code == 1 and "this model has none" in result.stderr


def test_dash_p_is_the_prompt_and_giving_it_twice_is_refused(tiny_dir):
    assert run("-p", "hi", "-m", tiny_dir, "-n", 3, "-s", 1).stdout == run("hi", "-m", tiny_dir, "-n", 3).stdout
    result = CliRunner().invoke(cli, ["generate", "hi", "-p", "ho", "-m", str(tiny_dir)])
    assert result.exit_code == 1 and "give the prompt once" in result.stderr


def test_sampling_takes_a_random_seed_and_prints_it_so_the_run_repeats(tiny_dir):
    args = ("hi", "-m", tiny_dir, "-n", 12, "--temperature", 1.5)
    first, second = run(*args), run(*args)
    seeds = [int(re.search(r"seed (\d+)", r.stderr).group(1)) for r in (first, second)]
    assert seeds[0] != seeds[1]
    assert run(*args, "--seed", seeds[0]).stdout == first.stdout  # the printed seed repeats the run
    assert "seed" in run(*args, "--seed", -1).stderr  # -1 = random, as llama.cpp


def test_greedy_decoding_prints_no_seed(tiny_dir):
    assert "seed" not in run("hi", "-m", tiny_dir, "-n", 2).stderr


def test_generate_takes_the_sampling_options_chat_takes():
    options = {c.name: {o for p in c.params for o in p.opts} for c in (cli.commands["generate"], cli.commands["chat"])}
    sampling = {"--temperature", "--top-k", "--top-p", "--min-p", "--repeat-penalty", "--seed", "-s"}
    assert sampling <= options["generate"] and sampling <= options["chat"]
