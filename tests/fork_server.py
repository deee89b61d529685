"""A fork server for the tests' train.py / eval.py runs: an interpreter (one per pytest worker and environment)
that has imported what a run imports (torch, DeepSpeed with its Muon module, Hydra, the trainer: ~15 s of CPU
on the 2-core machine, most of a short run's cost) forks a child per run, and the child executes the script as
`python SCRIPT ARGS` would: `sys.argv`, `sys.path`, the working directory and the environment of the run, stdout
and stderr to the caller's files, `__main__` run from the file, the interpreter's exit (non-daemon threads
joined, atexit handlers run) and its exit status (or the killing signal) reported back. With `nproc` the script
runs as torchrun's workers: one child per rank with the environment torchrun gives it (`torchrun_env`).

What a forked run does not repeat is the import of its modules: their import-time code ran once, in the
server, in train.py's order and under the run's environment (a server is started per environment; only
PER_RUN's variables, which a child sets up itself, may differ). So a test that checks something of a fresh
interpreter's start-up (DeepSpeed's import-time probes and banner, a run killed during start-up), kills a running
process with SIGKILL, or tests the launcher itself keeps starting real processes (`subprocess`). SIGTERM, SIGINT
and SIGHUP reach a child through this file's client (`python_command`), which passes them on.

`run_script(argv, cwd, env, timeout, nproc=None)` → `subprocess.CompletedProcess`. A server starts on its first
use in a worker (~10 s of wall time, once) and ends with the worker.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What train.py and eval.py import, imported by the server in this order before it serves (train.py's own
# start-up order first: its logging filter before DeepSpeed is imported). DeepSpeed imports its Muon optimizer
# module (and with it torch._dynamo and torch._inductor: ~8 s of CPU) from inside deepspeed.initialize. Hydra scans
# its installed plugins once per process, at a run's first config composition (~0.23 s of CPU on the CI-class
# machine, ~50 runs a suite): the server scans once, before it forks.
PRELOAD = """
from ling.train.logger import quiet_library_noise
quiet_library_noise()
import ling.train.launch
import hydra
import omegaconf
import ling.config_check
import ling.train.trainer
import ling.analysis.evaluate
import deepspeed.runtime.zero.muon.muon_optimizer
from hydra.core.plugins import Plugins
Plugins.instance()
"""
SCRIPTS = ("train.py", "eval.py")


def _serve(sock_path: str, parent: int) -> None:
    """Runs in the server: preload, then serve requests (each in a forked handler) until the parent (the pytest
    worker) ends."""
    sys.path[:] = [p for p in sys.path if p not in ("", ".")]  # as under `python SCRIPT`: the script's folder only
    exec(compile(PRELOAD, "<fork_server preload>", "exec"), {})
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path + ".tmp")
    listener.listen(4)
    os.rename(sock_path + ".tmp", sock_path)  # the caller connects once the path exists
    while True:
        ready, _, _ = select.select([listener], [], [], 1.0)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:  # reap the handlers that are done
                pass
        if os.getppid() != parent:  # the pytest worker is gone (an xdist worker ends without running atexit)
            shutil.rmtree(os.path.dirname(sock_path), ignore_errors=True)
            os._exit(0)
        if not ready:
            continue
        conn, _ = listener.accept()
        if os.fork() == 0:  # a handler per request (a copy of the server), so that requests run side by side
            listener.close()
            _handle(conn)  # never returns
        conn.close()


def _handle(conn: socket.socket) -> None:
    """In a handler: read the request (and the caller's stdin, stdout and stderr when it passes them), fork the
    run's processes, report their pids, wait for them, report their exit codes."""
    try:
        first, fds, _, _ = socket.recv_fds(conn, 65536, 3)
        request = json.loads(first.decode() if first.endswith(b"\n") else first.decode() + _read_line(conn))
        pids = []
        for rank_env in request["ranks"]:
            pid = os.fork()
            if pid == 0:
                conn.close()
                _child({**request, "env": {**request["env"], **rank_env}}, fds)  # never returns
            pids.append(pid)
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):  # the caller may have given up (its timeout)
            conn.sendall(json.dumps({"pids": pids}).encode() + b"\n")
        codes = {}
        while len(codes) < len(pids):
            pid, status = os.waitpid(-1, 0)
            codes[pid] = _returncode(status)
            if codes[pid] != 0:  # as torchrun does when a worker fails: stop the others
                for other in pids:
                    if other not in codes:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(other, signal.SIGKILL)
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"returncodes": [codes[p] for p in pids]}).encode() + b"\n")
    finally:
        os._exit(0)


def _read_line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("fork server: connection closed")
        data += chunk
    return data.decode()


def _returncode(status: int) -> int:
    """As subprocess reports it: the exit code, or minus the signal that killed the process."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: become `python SCRIPT ARGS` in `cwd` with `env`, stdin, stdout and stderr the caller's
    (`fds`) or /dev/null and the request's files; exit as the interpreter would."""
    code = 1
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # what a fresh interpreter installs
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if fds:
            for fd, theirs in enumerate(fds):
                os.dup2(theirs, fd)
        else:
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
                out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)  # ranks share the files
                os.dup2(out, fd)
                os.close(out)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1 if request["env"].get("PYTHONUNBUFFERED") else -1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
        sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr
        argv = request["argv"]
        module = argv[1] if argv[0] == "-m" else None
        script = str(Path(request["cwd"]) / argv[0])
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        # as `python SCRIPT` / `python -m MODULE` set it up: the script's folder, or the working directory, first
        sys.path[:] = [request["cwd"] if module else str(Path(script).parent), *extra, *sys.path[1:]]
        sys.argv = argv[1:] if module else list(argv)
        import runpy

        try:
            if module:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as stop:
            if stop.code is None:
                code = 0
            elif isinstance(stop.code, int):
                code = stop.code
            else:
                print(stop.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 (the interpreter's own report of an uncaught exception)
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()  # as the interpreter does at exit: join the non-daemon threads, then atexit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001
        try:
            import traceback

            traceback.print_exc()
        finally:
            code = 1
    finally:
        os._exit(code & 0xFF)


# ------------------------------------------------------------------------------------------------ the client
# Variables no module reads when it is imported (a child sets up sys.path and its stdio buffering itself, from the
# request): they may differ between the runs of one server, and a server is started without them (PYTHONPATH: with
# this process's own, for its pre-imports; a child puts its request's entries before it). The launcher's RANK,
# LOCAL_RANK and WORLD_SIZE among them: an in-process train() of an earlier test leaves them in the pytest
# worker's environment (ling.ranks.init_distributed), and some tests drop RANK from theirs and some do not; a
# server per combination cost ~15 CPU-s each. The preload reads RANK once (ling.train.logger.quiet_library_noise,
# where none means 0, all a pytest worker's one-process group sets); a rank's child gets its own from the request.
# And the address Inductor puts in the environment of its own process before it loads a compiled module (torch
# 2.13's `CppPythonBindingsCodeCache._load_library_inner`, which each process sets again before the module reads
# it): a compiling test in the pytest worker set it, and the next run started a second server (seen in the suite).
PER_RUN = ("PYTEST_CURRENT_TEST", "PYTHONUNBUFFERED", "PYTHONPATH", "MASTER_ADDR", "MASTER_PORT", "RANK",
           "LOCAL_RANK", "WORLD_SIZE", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR")
_servers: dict[frozenset, dict] = {}
SOCKET_VAR = "LING_FORK_SERVER"  # the client's server (python_command)
CLIENT = (sys.executable, str(Path(__file__).resolve()))  # `python tests/fork_server.py`: the client's command
_lock = threading.Lock()


def _key(env: dict[str, str]) -> frozenset:
    return frozenset((k, v) for k, v in env.items() if k not in PER_RUN)


def _start(env: dict[str, str]) -> dict:
    folder = tempfile.mkdtemp(prefix="ling_fork_server_")
    sock_path = os.path.join(folder, "sock")
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from tests.fork_server import _serve; "
            f"_serve({sock_path!r}, {os.getpid()})")
    server_env = {k: v for k, v in env.items() if k not in PER_RUN}
    if os.environ.get("PYTHONPATH"):  # the server pre-imports what this process imports, from where it found them
        server_env["PYTHONPATH"] = os.environ["PYTHONPATH"]  # (e.g. the GPU machine's wheels in /tmp/site)
    with open(os.path.join(folder, "server.log"), "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=server_env, stdout=log, stderr=log)
    return {"proc": proc, "sock": sock_path, "folder": folder}


def _stop() -> None:
    while _servers:
        _, server = _servers.popitem()
        if server["proc"].poll() is None:
            server["proc"].kill()
            server["proc"].wait()
        shutil.rmtree(server["folder"], ignore_errors=True)


atexit.register(_stop)


def _socket_path(env: dict[str, str]) -> str:
    """The socket of this worker's server for `env` (started on first use)."""
    with _lock:
        server = _servers.get(_key(env))
        if server is None:
            server = _servers[_key(env)] = _start(env)
        while not os.path.exists(server["sock"]):  # bound once the server has imported everything
            if server["proc"].poll() is not None:
                log = Path(server["folder"], "server.log").read_text()[-5000:]
                raise RuntimeError(f"the fork server exited with {server['proc'].returncode}:\n{log}")
            time.sleep(0.05)
    return server["sock"]


def _connect(env: dict[str, str]) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(_socket_path(env))
    return conn


def python_command(env: dict[str, str]) -> dict[str, str]:
    """For a shell script that runs Python as `$PYTHON SCRIPT ARGS`: PYTHON and the variable that make each such
    command a child of the server for `env` (through this file's client: `python tests/fork_server.py SCRIPT
    ARGS`, an interpreter that imports nothing heavy, hands its stdin, stdout, stderr, working directory and
    environment to the server, passes SIGTERM, SIGINT and SIGHUP on, and exits as the child did)."""
    return {"PYTHON": " ".join(CLIENT), SOCKET_VAR: _socket_path(env)}


def torchrun_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    """What torchrun (`--nproc_per_node=nproc`, one node) sets for a worker, except its agent's own store
    (TORCHELASTIC_USE_AGENT_STORE: here rank 0 hosts the rendezvous store, as without an agent) and error file."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def run_script(argv: list[str], cwd: Path, env: dict[str, str], timeout: float,
               nproc: int | None = None) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout)` for `argv` one of SCRIPTS, a .py file under tests/ or `-m MODULE`, and its arguments: run in
    a child of the fork server started under `env` (less PER_RUN). With `nproc`, the script runs as torchrun's
    `nproc` workers would (`torchrun_env`; the ranks share stdout and stderr), and the returncode is the first
    non-zero one of the ranks (the others are killed then, as torchrun stops them)."""
    assert argv[0] in SCRIPTS or argv[0] == "-m" or argv[0].startswith("tests/"), argv
    conn = _connect(env)
    if nproc is None:
        ranks = [{}]
    else:
        from ling.ranks import free_port

        port = free_port()
        ranks = [torchrun_env(rank, nproc, port) for rank in range(nproc)]
    with tempfile.TemporaryDirectory(prefix="ling_run_") as out, conn:
        paths = {"stdout": os.path.join(out, "stdout"), "stderr": os.path.join(out, "stderr")}
        request = {"argv": argv, "cwd": str(cwd), "env": env, "ranks": ranks, **paths}
        conn.sendall(json.dumps(request).encode() + b"\n")
        conn.settimeout(timeout)
        reply = conn.makefile("r")
        pids = json.loads(reply.readline())["pids"]
        try:
            line = reply.readline()
        except TimeoutError:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired(argv, timeout) from None
        codes = json.loads(line)["returncodes"]
        stdout, stderr = (Path(paths[k]).read_text(errors="replace") for k in ("stdout", "stderr"))
    returncode = next((c for c in codes if c != 0), 0)
    return subprocess.CompletedProcess([sys.executable, *argv], returncode, stdout, stderr)


def _client(argv: list[str]) -> None:
    """`python tests/fork_server.py SCRIPT ARGS` (python_command): `python SCRIPT ARGS` as a child of the server
    at $LING_FORK_SERVER, with this process's stdin, stdout, stderr, working directory and environment."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(os.environ[SOCKET_VAR])
    env = {k: v for k, v in os.environ.items() if k != SOCKET_VAR}
    request = {"argv": argv, "cwd": os.getcwd(), "env": env, "ranks": [{}]}
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
    reply = conn.makefile("r")
    pids = json.loads(reply.readline())["pids"]

    def forward(signum, frame):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    code = json.loads(reply.readline())["returncodes"][0]
    if code < 0:  # killed by a signal: so is this process
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    _client(sys.argv[1:])
