"""Bad input ends in one clear line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from minillama.app.cli import cli


def run(args):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.fixture
def broken(tmp_path, tiny_dir):
    folder = tmp_path / "m"
    shutil.copytree(tiny_dir, folder)
    return folder


def test_missing_config(broken):
    (broken / "config.json").unlink()
    assert "config.json" in run(["generate", "hi", "--model", str(broken)])


def test_corrupt_safetensors_header(broken):
    (broken / "model.safetensors").write_bytes(b"\xff" * 64)
    assert "safetensors" in run(["generate", "hi", "--model", str(broken)])


def test_unknown_model_type(broken):
    cfg = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    assert "unsupported model_type 'gpt2'" in run(["generate", "hi", "--model", str(broken)])


def test_shape_mismatch_names_tensor_and_shapes(broken):
    cfg = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    line = run(["generate", "hi", "--model", str(broken)])
    assert (
        "shape mismatch for model.layers.0.mlp.gate_proj.weight" in line
        and "(256, 256)" in line
        and "(96, 256)" in line
    )


def test_a_config_asking_for_more_layers_than_the_weights_hold_is_refused_before_building_them(broken):
    """100,000 layers in config.json: refused from the weights' headers (loader.py:
    check_layer_count), before a module is built (building them first took 90 s and 4.5 GB)."""
    cfg = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 100000}))
    line = run(["generate", "hi", "--model", str(broken)])
    assert "num_hidden_layers=100000, the weights hold layers 0..1 (2)" in line


def test_pickle_only_checkpoint_is_refused_not_unpickled(broken):
    (broken / "model.safetensors").unlink()
    (broken / "pytorch_model.bin").write_bytes(b"not even a pickle")
    assert "never unpickles" in run(["generate", "hi", "--model", str(broken)])


def test_unknown_hub_id_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert "Hugging Face hub" in run(["generate", "hi", "--model", "no-such-org/no-such-model"])


def test_unknown_kv_preset_names_the_nearest_choices(tiny_dir):
    line = run(["generate", "hi", "--model", str(tiny_dir), "--kv", "int5"])
    assert "did you mean int8 or int4" in line and "kv --list" in line


@pytest.mark.parametrize("command", [["generate", "hi", "--ctx", "100000000000"], ["chat", "--ctx", "100000000000"]])
def test_a_context_too_big_for_memory_is_one_line_before_allocating(tiny_dir, command):
    result = CliRunner().invoke(cli, [*command, "--model", str(tiny_dir)], input="hello\n")
    assert result.exit_code == 1 and "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "lower --ctx or pick a smaller --kv" in lines[0]


def test_output_piped_into_a_reader_that_leaves_early_ends_quietly():
    """`minillama kv --list | head -1`: once head has left, a write raises BrokenPipeError;
    the CLI stops without an error line (exit 141, 128 + SIGPIPE, as other tools end)."""
    script = "import sys\nfrom minillama.app.cli import main\nsys.argv = ['minillama', 'kv', '--list']\nmain()\n"
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader leaves before the first line (the child is still importing)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and err == ""


@pytest.mark.parametrize(
    "args, message",
    [
        (["ppl", "--tokens", "0"], "--tokens must be at least 2"),
        (["ppl", "--prefill", "-5"], "--prefill must be at least 1"),
        (["needle", "--lengths", "1"], "--lengths must be token counts"),
        (["needle", "--depths", "2"], "--depths must be fractions"),
        (["kv", "inspect"], "kv inspect needs a cache file"),
        (["kv", "hadv2", "extra"], "unexpected argument"),
    ],
)
def test_a_command_line_that_cannot_work_is_a_usage_error(args, message):
    """Options out of range or at odds with each other exit 2 with one line, as click's own usage
    errors do, before any model loads."""
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(not Path("/dev/null").exists(), reason="no /dev/null")
def test_a_device_is_not_a_cache_file():
    """`kv inspect /dev/null`: the file is named as what it is, not an OS error number."""
    assert run(["kv", "inspect", "/dev/null"]) == "error: /dev/null is not a regular file, so not a cache file"


def test_the_version_is_one_line():
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip().startswith("minillama ")
    assert len(result.stdout.strip().splitlines()) == 1


def test_threads_must_be_a_positive_count():
    result = CliRunner().invoke(cli, ["generate", "hi", "--threads", "0"])
    assert result.exit_code == 2 and "--threads" in result.stderr


def test_llama_cpp_short_options_mean_the_long_ones(tiny_dir):
    """-m -n -c -s -t as llama.cpp names them: the same completion as the long options."""
    short = CliRunner().invoke(
        cli, ["generate", "hi", "-m", str(tiny_dir), "-n", "3", "-c", "64", "-s", "7", "-t", "2"]
    )
    long = ["generate", "hi", "--model", str(tiny_dir), "--max-tokens", "3", "--ctx", "64", "--seed", "7"]
    assert short.exit_code == 0, short.stderr
    assert short.stdout == CliRunner().invoke(cli, [*long, "--threads", "2"]).stdout
