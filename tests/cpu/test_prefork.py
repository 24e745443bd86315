"""The prefork server (``verl_stable/cpu/prefork*.py``): a forked child is the process it stands for, or none is forked.

Hand-computed environment comparisons; a real server with a cheap preload (``decimal``, ``fractions``) serving real
client processes: what the child sees, exit codes, signals, the lifeline, refusals and the plain start they fall back
to; the thread count of a torch child against a fresh process; the real preload never importing Ray. That a verl run
through the server logs what a plain run logs is asserted on two real runs in ``test_reproducible_runs.py``.
"""

from __future__ import annotations

import array
import json
import os
import shlex
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from verl_stable.cpu import prefork
from verl_stable.cpu.prefork_preload import EnvReads, import_time_differences
from verl_stable.cpu.prefork_protocol import Request

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the prefork server is Linux only")

# what each test script prints: enough to tell a forked child (the preload already imported) from a plain start
REPORT = textwrap.dedent(
    """
    import json, os, sys
    print(json.dumps({
        "pid": os.getpid(), "sid": os.getsid(0), "cwd": os.getcwd(), "argv": sys.argv, "path0": sys.path[0],
        "preloaded": "decimal" in sys.modules, "marker": os.environ.get("PREFORK_TEST_MARKER"),
        "stdout_line_buffered": sys.stdout.line_buffering,
    }), flush=True)
    """
)


def _reads(values=None, scans=None) -> EnvReads:
    return EnvReads(values=dict(values or {}), scans=dict(scans or {}))


# ---------------------------------------------------------------- the comparison, hand-computed


def test_a_read_variable_must_have_the_value_the_preload_read():
    reads = _reads({"HF_HOME": None, "VERL_PLATFORM": "cpu"})
    assert import_time_differences(reads, {}, {"VERL_PLATFORM": "cpu", "RAY_JOB_ID": "01000000"}) == ([], [])
    assert import_time_differences(reads, {}, {"VERL_PLATFORM": "cpu", "HF_HOME": "/x"}) == (["HF_HOME"], [])
    assert import_time_differences(reads, {}, {}) == (["VERL_PLATFORM"], [])


def test_native_prefixes_are_compared_whoever_sets_them_and_the_exempt_name_is_not():
    server = {"LD_PRELOAD": "a.so", "TORCH_CUDA_ARCH_LIST": "8.0"}
    assert import_time_differences(_reads(), server, {"LD_PRELOAD": "a.so"}) == ([], [])
    assert import_time_differences(_reads(), server, {}) == (["LD_PRELOAD"], [])
    assert import_time_differences(_reads(), {}, {"MALLOC_ARENA_MAX": "2", "PYTHONHASHSEED": "0"}) == (
        ["MALLOC_ARENA_MAX", "PYTHONHASHSEED"],
        [],
    )


def test_thread_counts_are_fixed_when_they_are_a_positive_integer_and_refused_otherwise():
    assert import_time_differences(_reads(), {}, {"OMP_NUM_THREADS": "1"}) == ([], ["OMP_NUM_THREADS"])
    assert import_time_differences(_reads(), {"OMP_NUM_THREADS": "4"}, {"OMP_NUM_THREADS": "2"}) == (
        [],
        ["OMP_NUM_THREADS"],
    )
    for bad in ({"OMP_NUM_THREADS": "0"}, {"OMP_NUM_THREADS": "two"}, {}):
        assert import_time_differences(_reads(), {"OMP_NUM_THREADS": "4"}, bad)[0] == ["OMP_NUM_THREADS"]


def test_a_scanned_prefix_counts_as_read():
    reads = _reads(scans={"tqdm.utils": "TQDM_"})
    assert import_time_differences(reads, {}, {"TQDM_DISABLE": "1"}) == (["TQDM_DISABLE"], [])
    assert import_time_differences(reads, {"TQDM_DISABLE": "1"}, {"TQDM_DISABLE": "1"}) == ([], [])


# ---------------------------------------------------------------- the record of reads


def test_the_record_sees_every_kind_of_read_and_restores_os_environ(monkeypatch):
    monkeypatch.setenv("PREFORK_TEST_SET", "yes")
    monkeypatch.delenv("PREFORK_TEST_UNSET", raising=False)
    environ_cls = type(os.environ)
    before = (environ_cls.__getitem__, environ_cls.__iter__)
    reads = EnvReads()
    with reads.recording():
        os.environ.get("PREFORK_TEST_SET")
        assert "PREFORK_TEST_UNSET" not in os.environ
        os.getenv("PREFORK_TEST_GETENV")
        os.environ["PREFORK_TEST_SET"]
        # a known scanner and an unknown one, as their modules would iterate
        exec("[k for k in os.environ if k.startswith('TQDM_')]", {"__name__": "tqdm.utils", "os": os})
        exec("dict(os.environ)", {"__name__": "somepkg.config", "os": os})
    assert (environ_cls.__getitem__, environ_cls.__iter__) == before
    assert reads.values["PREFORK_TEST_SET"] == "yes"
    assert reads.values["PREFORK_TEST_UNSET"] is None and reads.values["PREFORK_TEST_GETENV"] is None
    assert reads.scans == {"tqdm.utils": "TQDM_", "somepkg.config": None}
    assert reads.unknown_scans() == ["somepkg.config"]
    # the scanners' own reads of each name are part of their scan, not reads of their own
    assert "PATH" not in reads.values


def test_the_request_names_a_script_or_a_module_and_nothing_else():
    assert Request(["w.py", "--x"], {}, "/").target() == ("script", "w.py")
    assert Request(["-m", "pkg.mod", "a"], {}, "/").target() == ("module", "pkg.mod")
    for argv in ([], ["-c", "print()"], ["-u", "w.py"], ["-m"]):
        with pytest.raises(ValueError, match="script or -m"):
            Request(argv, {}, "/").target()


# ---------------------------------------------------------------- a real server and real clients


@pytest.fixture
def server(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != prefork.ENV_SOCKET}
    (tmp_path / "mods").mkdir()
    # the server imports verl_stable from this tree; mods/ holds the test's module for -m
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "mods"), *(p for p in sys.path if p)])
    proc = prefork.ServerProcess(
        tmp_path / "p.sock", env, tmp_path / "prefork.log", tmp_path, modules=("decimal", "fractions")
    )
    yield proc, env, tmp_path
    proc.stop()


def _client(env, args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([*prefork.client_command(), *args], env=env, stdout=subprocess.PIPE, text=True, **kwargs)


def _script(tmp_path: Path, body: str = "") -> Path:
    path = tmp_path / "child.py"
    path.write_text(REPORT + textwrap.dedent(body))
    return path


def test_a_forked_child_runs_the_script_as_a_plain_process_would(server):
    proc, env, tmp_path = server
    script = _script(tmp_path, "sys.exit(7)")
    run_env = {**env, **proc.env(), "PREFORK_TEST_MARKER": "m1"}
    client = _client(run_env, [str(script), "--flag", "v"], cwd=tmp_path)
    out, _ = client.communicate(timeout=60)
    seen = json.loads(out)
    assert client.returncode == 7
    assert seen["preloaded"], "not forked from the server"
    assert seen["pid"] != client.pid and seen["sid"] == seen["pid"]  # a child of the server, in a session of its own
    plain = subprocess.run(
        [sys.executable, str(script), "--flag", "v"], env=run_env, cwd=tmp_path, capture_output=True, text=True
    )
    expected = json.loads(plain.stdout)
    assert plain.returncode == 7 and not expected["preloaded"]
    same = ("argv", "path0", "cwd", "marker", "stdout_line_buffered")
    assert {k: seen[k] for k in same} == {k: expected[k] for k in same}
    assert seen["argv"] == [str(script), "--flag", "v"] and seen["marker"] == "m1"
    assert "forked" in (tmp_path / "prefork.log").read_text()


def test_another_working_directory_is_refused_because_imports_read_it(server):
    """torch._dynamo and torch._inductor derive directories from the working directory when they load."""
    proc, env, tmp_path = server
    (tmp_path / "elsewhere").mkdir()
    script = _script(tmp_path)
    client = _client({**env, **proc.env()}, [str(script)], cwd=tmp_path / "elsewhere", stderr=subprocess.PIPE)
    out, err = client.communicate(timeout=60)
    seen = json.loads(out)
    assert seen["cwd"] == str(tmp_path / "elsewhere") and not seen["preloaded"]
    assert "working directory" in err and "without the prefork server" in err


def test_a_module_runs_as_python_dash_m_would_run_it(server):
    proc, env, tmp_path = server
    (tmp_path / "mods" / "pkgmod.py").write_text(REPORT)
    run_env = {**env, **proc.env()}
    seen = json.loads(_client(run_env, ["-m", "pkgmod", "a"], cwd=tmp_path).communicate(timeout=60)[0])
    plain = subprocess.run(
        [sys.executable, "-m", "pkgmod", "a"], env=run_env, cwd=tmp_path, capture_output=True, text=True
    )
    expected = json.loads(plain.stdout)
    assert seen["preloaded"] and not expected["preloaded"]
    assert (seen["argv"], seen["path0"]) == (expected["argv"], expected["path0"])
    assert seen["argv"] == [str(tmp_path / "mods" / "pkgmod.py"), "a"] and seen["path0"] == str(tmp_path)


def test_a_refused_fork_starts_plain_python_and_says_why(server):
    proc, env, tmp_path = server
    script = _script(tmp_path, "sys.exit(3)")
    client = subprocess.Popen(
        [*prefork.client_command(), str(script)],
        env={**env, **proc.env(), "MALLOC_ARENA_MAX": "2"},
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = client.communicate(timeout=60)
    seen = json.loads(out)
    assert client.returncode == 3 and seen["pid"] == client.pid and not seen["preloaded"]
    assert "MALLOC_ARENA_MAX" in err and "without the prefork server" in err


def test_a_malformed_request_is_dropped_and_the_server_serves_on(server):
    proc, env, tmp_path = server
    for payload, fds in ((b'{"argv": 1}', 4), (b"not json", 4), (b"{}", 2)):
        pipes = [os.pipe() for _ in range(fds)]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(proc.socket_path))
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r for r, _ in pipes]))]
            conn.sendmsg([struct.pack("!I", len(payload)) + payload], ancillary)
            try:
                answer = conn.recv(100)
            except ConnectionResetError:  # closed with the payload unread
                answer = b""
            assert answer == b""  # dropped: no answer, the connection closed
        for r, w in pipes:
            os.close(r)
            os.close(w)
    seen = json.loads(_client({**env, **proc.env()}, [str(_script(tmp_path))], cwd=tmp_path).communicate(timeout=60)[0])
    assert seen["preloaded"]
    assert (tmp_path / "prefork.log").read_text().count("bad request") == 3


def test_without_a_server_the_client_is_plain_python(tmp_path):
    script = _script(tmp_path, "sys.exit(5)")
    for env in (
        {**os.environ, prefork.ENV_SOCKET: str(tmp_path / "missing.sock")},
        {k: v for k, v in os.environ.items() if k != prefork.ENV_SOCKET},
    ):
        client = _client(env, [str(script)], stderr=subprocess.PIPE)
        out, err = client.communicate(timeout=60)
        assert client.returncode == 5 and json.loads(out)["pid"] == client.pid
    assert "no server at" in err or err == ""


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_the_child_dies_with_its_client_even_by_sigkill(server):
    proc, env, tmp_path = server
    script = _script(tmp_path, "import time; time.sleep(120)")
    client = _client({**env, **proc.env()}, [str(script)], cwd=tmp_path)
    child = json.loads(client.stdout.readline())["pid"]
    assert child != client.pid
    client.kill()
    client.wait(timeout=10)
    assert _wait_gone(child), "the forked child outlived its client"


def test_signals_reach_the_child_and_its_death_is_the_clients(server):
    proc, env, tmp_path = server
    script = _script(tmp_path, "import time; time.sleep(120)")
    client = _client({**env, **proc.env()}, [str(script)], cwd=tmp_path)
    child = json.loads(client.stdout.readline())["pid"]
    client.send_signal(signal.SIGTERM)
    assert client.wait(timeout=10) == -signal.SIGTERM
    assert _wait_gone(child)
    # the server's side: a child killed directly (as Ray kills a worker by its pid) ends its client the same way
    client = _client({**env, **proc.env()}, [str(script)], cwd=tmp_path)
    child = json.loads(client.stdout.readline())["pid"]
    os.kill(child, signal.SIGKILL)
    assert client.wait(timeout=10) == -signal.SIGKILL


def test_the_server_stops_when_its_lifeline_closes_after_its_children(server):
    proc, env, tmp_path = server
    script = _script(tmp_path, "import time; time.sleep(1.5)")
    client = _client({**env, **proc.env()}, [str(script)], cwd=tmp_path)
    json.loads(client.stdout.readline())
    proc.stop()
    assert client.wait(timeout=10) == 0  # its exit still reached the client
    assert proc.proc.returncode == 0 and not (tmp_path / "p.sock").exists()
    assert "stopping: 1 forked, 0 refused" in (tmp_path / "prefork.log").read_text()


# ---------------------------------------------------------------- torch and the real preload


def test_a_torch_child_has_the_thread_count_and_results_of_a_fresh_process(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (prefork.ENV_SOCKET, "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    script = tmp_path / "t.py"
    script.write_text(
        textwrap.dedent(
            """
        import json, sys, torch
        torch.manual_seed(0)
        x = torch.randn(192, 192, dtype=torch.float32)
        print(json.dumps({"threads": torch.get_num_threads(), "interop": torch.get_num_interop_threads(),
                          "value": (x @ x).softmax(-1).sum(0).tolist()[:8], "forked": "decimal" in sys.modules}))
        """
        )
    )
    with prefork.ServerProcess(
        tmp_path / "t.sock", env, tmp_path / "log", tmp_path, modules=("torch", "decimal")
    ) as proc:
        for extra in ({}, {"OMP_NUM_THREADS": "1"}):
            run_env = {**env, **extra}
            forked = json.loads(
                _client({**run_env, **proc.env()}, [str(script)], cwd=tmp_path).communicate(timeout=120)[0]
            )
            fresh = json.loads(
                subprocess.run([sys.executable, str(script)], env=run_env, capture_output=True, text=True).stdout
            )
            assert forked.pop("forked") and not fresh.pop("forked")
            assert forked == fresh, extra


def test_the_real_preload_serves_and_never_imports_ray(tmp_path):
    """The contract with the installed packages: :data:`PRELOAD` imports without Ray, verl or an unknown scan of
    the environment (a new release of one of them could change that; the server would then serve nothing)."""
    code = textwrap.dedent(
        """
        import sys
        from verl_stable.cpu import prefork_preload
        reads = prefork_preload.preload()
        print(sorted(m for m in prefork_preload.NEVER_PRELOADED if m in sys.modules), reads.unknown_scans())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[] []"


# ---------------------------------------------------------------- the launcher's choice


def test_the_switch_is_strictly_zero_or_one():
    assert prefork.enabled({}) is sys.platform.startswith("linux")
    assert prefork.enabled({prefork.ENV_SWITCH: "1"}) is sys.platform.startswith("linux")
    assert prefork.enabled({prefork.ENV_SWITCH: "0"}) is False
    for bad in ("true", "yes", "", " 1"):
        with pytest.raises(ValueError, match=prefork.ENV_SWITCH):
            prefork.enabled({prefork.ENV_SWITCH: bad})


def test_the_launcher_routes_the_driver_and_workers_through_a_named_server_and_respects_an_override(tmp_path):
    from verl_stable.toy.trainer_process import _PY_EXECUTABLE_KEY, _prefork_server, hydra_quote

    with _prefork_server({prefork.ENV_SWITCH: "0"}, tmp_path, []) as (python, extra):
        assert (python, extra) == ([sys.executable], [])
    named = {prefork.ENV_SOCKET: str(tmp_path / "sweep.sock")}
    with _prefork_server(dict(named), tmp_path, []) as (python, extra):
        assert python == prefork.client_command()
        assert extra == [f"++{_PY_EXECUTABLE_KEY}={hydra_quote(shlex.join(prefork.client_command()))}"]
    assert not (tmp_path / "prefork.log").exists()  # a named server is used, none is started
    mine = f"+{_PY_EXECUTABLE_KEY}=/opt/python"
    with _prefork_server(dict(named), tmp_path, [mine]) as (python, extra):
        assert python == prefork.client_command() and extra == []
