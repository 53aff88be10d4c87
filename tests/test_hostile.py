"""Hostile input: nothing a user names is destroyed, and every refusal is one clear line.

Each test replays a case a new or hostile user tried (issue 25): it checks the exit code, that
stderr holds one ``error:`` line (or the documented note), that every file that was there before
is byte-identical afterwards, and that no temporary file is left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillama.app.chat import ChatSession, handle_command
from minillama.app.cli import cli
from minillama.errors import UserError
from minillama.kv.file import read
from minillama.kv.spec import parse_kv
from minillama.model.sampling import SamplingParams
from minillama.native.fast import load_model


def invoke(args, stdin=None):
    return CliRunner().invoke(cli, [str(a) for a in args], input=stdin)


def one_error_line(result, code=1) -> str:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes: what must be identical after a refused command."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def model(tmp_path, tiny_dir):
    """A private copy of the tiny model, so a test may watch its files."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_dir, folder)
    return folder


# -- a prompt-cache or /save target that is not a minillama cache is never touched ------------


def test_generate_refuses_to_write_its_cache_over_the_prompt_file(model, tmp_path):
    prompt = tmp_path / "v.txt"
    prompt.write_text("A prompt the user wrote by hand and wants to keep. " * 5)
    before = files(tmp_path)
    line = one_error_line(invoke(["generate", "--model", model, "--prompt-file", prompt, "--prompt-cache", prompt]))
    assert "v.txt exists and is not a minillama cache file" in line and "refusing to overwrite" in line
    assert files(tmp_path) == before


def test_generate_refuses_to_write_its_cache_over_the_model_weights(model, tmp_path):
    before = files(tmp_path)
    line = one_error_line(
        invoke(["generate", "hello", "--model", model, "--prompt-cache", model / "model.safetensors"])
    )
    assert "model.safetensors exists and is not a minillama cache file" in line
    assert files(tmp_path) == before
    assert invoke(["generate", "hello", "--model", model, "--max-tokens", "2"]).exit_code == 0  # the weights still load


def test_chat_refuses_a_prompt_cache_and_a_save_target_that_are_not_caches(model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    before = files(tmp_path)
    line = one_error_line(invoke(["chat", "--model", model, "--prompt-cache", notes, "--temperature", "0"], "hi\n"))
    assert "notes.txt exists and is not a minillama cache file" in line
    result = invoke(["chat", "--model", model, "--temperature", "0", "--max-tokens", "3"], "hi\n/save notes.txt\n")
    assert result.exit_code == 0 and "notes.txt exists and is not a minillama cache file" in result.stderr
    assert files(tmp_path) == before


def test_a_cache_of_another_spec_is_replaced_only_with_a_line_that_says_so(model, tmp_path):
    text, cache = tmp_path / "doc.txt", tmp_path / "doc.kv"
    text.write_text("Cats and dogs and a long document. " * 8)
    args = ["generate", "--model", model, "--prompt-file", text, "--max-tokens", "4", "--prompt-cache", cache]
    assert invoke([*args, "--kv", "hadv2"]).exit_code == 0
    result = invoke([*args, "--kv", "kivi4"])
    assert result.exit_code == 0
    said = [line for line in result.stderr.splitlines() if "prompt cache not used" in line]
    assert len(said) == 1 and "holds a --kv hadv2 cache, not kivi4" in said[0] and "replaces it" in said[0]
    assert read(cache).header["kv_name"] == "kivi4"


def test_prompt_cache_ro_reads_the_file_but_never_writes_it(model, tmp_path):
    text, cache = tmp_path / "doc.txt", tmp_path / "doc.kv"
    text.write_text("Cats and dogs and a long document. " * 8)
    args = ["generate", "--model", model, "--prompt-file", text, "--max-tokens", "4", "--prompt-cache", cache]
    assert invoke([*args, "--kv", "hadv2"]).exit_code == 0
    before = cache.read_bytes()
    other = invoke([*args, "--kv", "kivi4", "--prompt-cache-ro"])
    assert other.exit_code == 0 and "replaces it" not in other.stderr
    longer = tmp_path / "longer.txt"
    longer.write_text(text.read_text() + " And more.")
    extended = invoke(
        [
            "generate",
            "--model",
            model,
            "--prompt-file",
            longer,
            "--max-tokens",
            "4",
            "--kv",
            "hadv2",
            "--prompt-cache",
            cache,
            "--prompt-cache-ro",
        ]
    )
    assert extended.exit_code == 0 and "prompt cache: reused" in extended.stderr
    assert cache.read_bytes() == before


def test_a_cache_made_in_another_dtype_is_refused_by_naming_the_dtype(model, tmp_path):
    text, cache = tmp_path / "doc.txt", tmp_path / "doc.kv"
    text.write_text("Cats and dogs. " * 8)
    args = ["generate", "--model", model, "--prompt-file", text, "--max-tokens", "2", "--prompt-cache", cache]
    assert invoke([*args, "--dtype", "bfloat16"]).exit_code == 0
    result = invoke([*args, "--dtype", "float32"])
    assert "made with bfloat16 weights, this run uses float32 (pass --dtype bfloat16 to use it)" in result.stderr


def test_a_chat_session_file_resumes_in_generate_with_the_default_dtype(model, tmp_path):
    """chat and generate default to one dtype (and --kv), so a cache written by one is read by the other."""
    session = tmp_path / "s.kv"
    chat = invoke(
        ["chat", "--model", model, "--temperature", "0", "--max-tokens", "3", "--prompt-cache", session], "hi\n"
    )
    assert chat.exit_code == 0, chat.output
    result = invoke(["generate", "hi", "--model", model, "--max-tokens", "2", "--prompt-cache", session])
    assert result.exit_code == 0 and "another" not in result.stderr and "dtype" not in result.stderr


# -- a damaged file is never trusted in part ----------------------------------------------------


def tamper_header(path: Path, edit) -> None:
    """Rewrite the JSON header of a safetensors file in place (same length, so the tensors still parse)."""
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    outer = json.loads(data[8 : 8 + size])
    fields = json.loads(outer["__metadata__"]["minillama"])
    edit(fields)
    outer["__metadata__"]["minillama"] = json.dumps(fields)
    new = json.dumps(outer, separators=(",", ":")).encode()  # safetensors writes it compact
    assert len(new) <= size, "the edit must not make the header longer"
    path.write_bytes(data[:8] + new.ljust(size) + data[8 + size :])


def test_a_tampered_chat_file_is_refused_whole_and_the_session_is_unchanged(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    session = ChatSession(tiny, parse_kv("kivi4"), ctx=256, params=SamplingParams(temperature=0), max_tokens=3)
    "".join(session.send("hello there"))
    said = []
    handle_command(session, "/save s.kv", said.append)

    def edit(fields):
        fields["extra"]["messages"][0]["content"] = "HACKED"  # the same length as "hello there" or shorter

    tamper_header(tmp_path / "s.kv", edit)
    other = ChatSession(tiny, parse_kv("kivi4"), ctx=256, params=SamplingParams(temperature=0), max_tokens=3)
    handle_command(other, "/load s.kv", said.append)
    assert "damaged" in said[-1] and "nothing was loaded" in said[-1]
    assert other.messages == [] and other.cached_ids == []
    handle_command(other, "/save t.kv", said.append)
    assert "HACKED" not in (tmp_path / "t.kv").read_bytes().decode("latin-1")


# -- temporary files: unique per process, gone on every exit path ------------------------------


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_a_run_in_this_process_puts_the_sigterm_handler_back():
    """main() turns SIGTERM into SystemExit for its run only: a program (or test) that calls the
    CLI in its own process keeps its own handler afterwards."""
    import signal

    from click.testing import CliRunner

    from minillama.app.cli import cli

    mine = lambda signum, frame: None  # noqa: E731
    before = signal.signal(signal.SIGTERM, mine)
    try:
        assert CliRunner().invoke(cli, ["--version"]).exit_code == 0
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


SLOW_WRITE = textwrap.dedent("""
    import os, sys, time
    from minillama.app import cli  # installs nothing by import; main() installs the SIGTERM handler
    import signal
    signal.signal(signal.SIGTERM, cli._terminated)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if the runner ignores SIGINT
    real_fsync = os.fsync
    def slow_fsync(fd):  # the bytes are in the temporary file; hold the rename back
        print("writing", flush=True)
        time.sleep(60)
    os.fsync = slow_fsync
    {body}
""")


def start(script: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def wait_for(proc: subprocess.Popen, word: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if word in line:
            return
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"the subprocess never said {word!r}: {proc.stderr.read()}")


@pytest.mark.parametrize(
    "sig, code", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)]
)  # KeyboardInterrupt: Python dies by the signal
def test_a_signal_during_a_write_leaves_the_old_file_and_no_temp_file(tmp_path, sig, code):
    target = tmp_path / "c.kv"
    target.write_bytes(b"the old file")
    proc = start(
        SLOW_WRITE.format(body="from minillama.kv.file import write_atomic\nwrite_atomic('c.kv', b'x' * 10_000_000)"),
        tmp_path,
    )
    wait_for(proc, "writing")
    assert len(leftovers(tmp_path)) == 1  # the temporary file, beside the target
    proc.send_signal(sig)
    proc.wait(timeout=60)
    assert proc.returncode == code
    assert target.read_bytes() == b"the old file" and leftovers(tmp_path) == []


def test_ctrl_c_during_chat_save_keeps_the_session_and_leaves_no_temp_file(tiny_dir, tmp_path):
    body = f"""
from minillama.app.chat import ChatSession, handle_command
from minillama.kv.spec import parse_kv
from minillama.native.fast import load_model
from minillama.model.sampling import SamplingParams
s = ChatSession(load_model({str(tiny_dir)!r}), parse_kv("kivi4"), ctx=256, params=SamplingParams(temperature=0), max_tokens=3)
"".join(s.send("hello"))
handle_command(s, "/save chat.kv", lambda m: print(m, flush=True))
os.fsync = real_fsync
print("still alive with", len(s.messages), "messages", flush=True)
handle_command(s, "/save chat.kv", lambda m: print(m, flush=True))
"""
    proc = start(SLOW_WRITE.format(body=body), tmp_path)
    wait_for(proc, "writing")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "error: interrupted; the session is unchanged" in out and "still alive with 2 messages" in out
    assert leftovers(tmp_path) == [] and read(tmp_path / "chat.kv").extra["messages"][0]["content"] == "hello"


def test_sigterm_during_generate_leaves_no_file_behind(model, tmp_path):
    cache = tmp_path / "run.kv"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "minillama",
            "generate",
            "hello",
            "--model",
            str(model),
            "--max-tokens",
            "100000",
            "--ctx",
            "200000",
            "--ignore-eos",
            "--on-full",
            "evict",
            "--prompt-cache",
            str(cache),
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.time() + 120
    while not proc.stdout.read(16) and proc.poll() is None and time.time() < deadline:
        pass  # until the reply is streaming
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert not cache.exists() and leftovers(tmp_path) == []


def test_two_writers_of_one_cache_path_both_succeed_and_the_file_is_valid(model, tmp_path):
    text = tmp_path / "doc.txt"
    text.write_text("Two processes, one cache file. " * 10)
    args = [
        sys.executable,
        "-m",
        "minillama",
        "generate",
        "--model",
        str(model),
        "--prompt-file",
        str(text),
        "--max-tokens",
        "8",
        "--kv",
        "hadv2",
        "--prompt-cache",
        "race.kv",
    ]
    procs = [
        subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[0][0] == outs[1][0] and "Traceback" not in outs[0][1] + outs[1][1]
    assert read(tmp_path / "race.kv").tokens and leftovers(tmp_path) == []


# -- the --kv spec: no silent last-wins, no out-of-range first, long input cut -------------------


def test_a_key_given_twice_is_refused():
    with pytest.raises(UserError, match="names k= twice"):
        parse_kv("k=int4,k=int2,v=int4")


def test_layers_for_another_model_are_refused(model):
    line = one_error_line(invoke(["generate", "hi", "--model", model, "--kv", "k=int4,v=int4,layers=int4/int4"]))
    assert "gives codecs for 1 layers; the model has 2" in line


def test_a_huge_kv_string_is_echoed_cut(model):
    line = one_error_line(invoke(["generate", "hi", "--model", model, "--kv", "x" * 100_000]))
    assert len(line) < 600 and "(100,000 characters)" in line


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="kvgroupresidualsinkscenterfirstint248hcslm=,0123456789 .-", max_size=80))
def test_any_kv_string_parses_or_is_one_clear_line(text):
    try:
        spec = parse_kv(text)
    except UserError as e:
        assert "\n" not in str(e) and len(str(e)) < 700
    else:
        assert parse_kv(spec.canonical()).canonical() == spec.canonical()


# -- model folders: every problem names the file and what is wrong --------------------------------


@pytest.mark.parametrize(
    "write, file, message",
    [
        (lambda m: (m / "config.json").write_text("[1, 2, 3]"), "config.json", "must hold a JSON object"),
        (
            lambda m: edit_config(m, num_hidden_layers="2"),
            "config.json",
            "num_hidden_layers must be a positive whole number",
        ),
        (lambda m: edit_config(m, rms_norm_eps=float("nan")), "config.json", "rms_norm_eps must be a finite number"),
        (lambda m: edit_config(m, rope_scaling={"rope_type": "linear"}), "config.json", "needs factor"),
        (lambda m: edit_config(m, tie_word_embeddings="yes"), "config.json", "must be true or false"),
        (lambda m: (m / "tokenizer.json").write_text("garbage"), "tokenizer.json", "is not a tokenizer"),
        (lambda m: (m / "tokenizer_config.json").write_text("{"), "tokenizer_config.json", "is not valid JSON"),
        (
            lambda m: (m / "generation_config.json").write_text('{"temperature": "hot"}'),
            "generation_config.json",
            "temperature must be a finite number",
        ),
    ],
)
def test_a_bad_model_file_is_named_in_one_line(model, write, file, message):
    write(model)
    line = one_error_line(invoke(["chat", "--model", model], "hi\n"))
    assert file in line and message in line


def edit_config(folder: Path, **fields) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **fields}))


JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 10**6),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.lists(st.integers(-1, 5), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
FIELDS = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "eos_token_id",
    "bos_token_id",
    "model_type",
    "hidden_act",
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=JSON_VALUES)
def test_any_config_field_loads_or_is_refused_naming_config_json(model, field, value):
    edit_config(model, **{field: value})
    try:
        load_model(str(model))
    except UserError as e:
        assert str(model) in str(e) and "\n" not in str(e)


# -- numbers, devices and usage errors -----------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--temperature", "nan"], "nan is not a finite number"),
        (["--temperature", "inf"], "inf is not a finite number"),
        (["--top-p", "nan"], "nan is not a finite number"),
        (["--top-p", "2"], "not in the range"),
        (["--seed", str(10**30)], "not in the range"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--max-tokens", "0"], "not in the range"),
    ],
)
def test_bad_numbers_and_devices_are_one_usage_line_before_the_model_loads(args, message):
    # The model does not exist: a refusal that comes before loading never gets to say so.
    line = one_error_line(invoke(["generate", "hi", "--model", "/no/such/model", *args]), code=2)
    assert message in line and line.endswith(" generate --help)")


def test_an_unknown_command_is_one_usage_line():
    line = one_error_line(invoke(["generat", "hi"]), code=2)
    assert "No such command 'generat'" in line


# -- what a llama.cpp user expects of generate ------------------------------------------------------


def test_generate_stops_at_the_end_of_sequence_token_unless_told_to_go_on(model):
    from minillama.kv.cache import KVCache
    from minillama.model.generate import GenerateOptions, generate

    lm = load_model(str(model), "bfloat16")  # generate's defaults: bfloat16 weights, an fp16 cache
    ids = lm.tokenizer.encode("hello")
    cache = KVCache.for_model(lm.config, parse_kv("fp16"))
    tokens = [t for t, _ in generate(lm.model, ids, cache, GenerateOptions(12, SamplingParams(temperature=0)))]
    cut = next(i for i in range(1, 12) if tokens[i] not in tokens[:i])  # a token that is new at its place
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": tokens[cut]}))
    stopped = invoke(["generate", "hello", "--model", model, "--max-tokens", "12"])
    assert stopped.exit_code == 0 and "(end of sequence)" in stopped.stderr
    assert stopped.stdout == lm.tokenizer.decode(tokens[:cut]) + "\n"
    going_on = invoke(["generate", "hello", "--model", model, "--max-tokens", "12", "--ignore-eos"])
    assert going_on.stdout == lm.tokenizer.decode(tokens) + "\n" and "end of sequence" not in going_on.stderr


def test_a_prompt_longer_than_the_cache_is_refused_or_evicted_with_a_warning(model):
    line = one_error_line(invoke(["generate", "word " * 60, "--model", model, "--ctx", "100"]))
    assert "more than the cache holds (--ctx 100)" in line and "--on-full evict" in line
    evicted = invoke(
        ["generate", "word " * 60, "--model", model, "--ctx", "100", "--on-full", "evict", "--max-tokens", "3"]
    )
    assert evicted.exit_code == 0
    assert [line for line in evicted.stderr.splitlines() if line.startswith("warning:")] == [
        "warning: the prompt is 300 tokens and the cache holds 100: its first 200 or more are evicted (--on-full evict)"
    ]


def test_a_reply_that_fills_the_cache_stops_with_a_note(model):
    result = invoke(["generate", "hello", "--model", model, "--ctx", "40", "--max-tokens", "100", "--ignore-eos"])
    assert result.exit_code == 0 and "the cache is full at --ctx 40" in result.stderr


def test_needle_says_before_starting_when_lengths_do_not_fit_and_how_big_the_job_is(model):
    result = invoke(["needle", "--model", model, "--kv", "fp16", "--lengths", "300", "--depths", "0.5", "--ctx", "200"])
    assert result.exit_code == 0, result.output
    err = result.stderr.splitlines()
    assert err[0].startswith("note: prompts of 300 tokens do not fit --ctx 200")
    assert "needle: 1 prompts, about 300 tokens to prefill" in result.stderr


def test_chat_help_names_both_ways_out():
    from minillama.app.chat import HELP

    assert "/exit, /quit" in HELP


@pytest.mark.skipif(not Path("/dev/zero").exists() or sys.platform != "linux", reason="Linux: /dev/zero, RLIMIT_AS")
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_an_endless_input_is_refused_within_a_memory_bound(tiny_dir, command):
    """`--prompt-file /dev/zero` and `chat < /dev/zero` read no further than a prompt that fits
    --ctx could reach, and end in one line: under a 6 GB address-space limit (they took the
    machine's 24 GB before), exit 1."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    args = [sys.executable, "-m", "minillama", command, "--model", str(tiny_dir), "--ctx", "64"]
    if command == "generate":
        args += ["--prompt-file", "/dev/zero", "--max-tokens", "1"]
    with open("/dev/zero") as zeros:
        done = subprocess.run(args, stdin=zeros, capture_output=True, text=True, preexec_fn=limit, timeout=300)
    assert done.returncode == 1, done.stderr[-500:]
    assert done.stderr.strip().splitlines()[-1].startswith("error: ") and "8,192 characters" in done.stderr


def test_an_allocator_failure_is_one_line_that_says_out_of_memory(model, monkeypatch):
    """PyTorch's allocator says "can't allocate memory" with a C++ backtrace in the message (135
    lines once): the command ends in one line that names the cause and what to do."""
    import minillama.model.prompt_cache as run

    backtrace = "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to "
    backtrace += "allocate 8589934592 bytes.\n" + "\n".join(f"frame #{i}: c10::alloc_cpu(...)" for i in range(135))

    def fail(*args, **kwargs):
        raise RuntimeError(backtrace)

    monkeypatch.setattr(run, "prefill", fail)  # where generate's prompt enters the cache
    line = one_error_line(invoke(["generate", "hi", "--model", model, "--raw"]))
    assert line.startswith("error: out of memory ([enforce fail") and "lower --ctx" in line


def test_weights_too_big_for_the_free_memory_are_refused_before_they_are_read(model, monkeypatch):
    """The weights' bytes in the asked dtype, from the files' headers, against the free memory."""
    import minillama.kv.memory as memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: 1000)
    line = one_error_line(invoke(["generate", "hi", "--model", model, "--dtype", "float32"]))
    assert "the model's weights in float32 needs" in line and "use --dtype bfloat16" in line
