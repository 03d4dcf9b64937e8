"""Child Python processes forked from one that has already imported torch.

A test child that runs `import torch, compiledump` and captures costs about 6 s of CPU on the
2-core CI box (torch, and torch._dynamo, which the capture calls import): most of what the
signal, exit-flush, recover and multi-process tests of tests/capture cost, a child each. `start()`
and `run()` run such a child as a fork of one server process per pytest process that imported
torch and torch._dynamo once, and nothing of compiledump.

Each child is still a process of its own, started for its scenario: its own pid and exit status
(a signal's death reads as with subprocess: -SIGTERM), its own import of compiledump (its
settings read from the environment the test gave), the signal dispositions a new interpreter
starts with, and its own interpreter shutdown: the script runs as `__main__` at the server's top
level, so an uncaught exception, SystemExit, atexit handlers (compiledump's exit flush) and the
exit by SIGINT after an uncaught KeyboardInterrupt take the path of `python -c`'s. What a child
does not redo is torch's import, made with the server's environment: the pytest process's,
OMP_NUM_THREADS=1 (libgomp reads it when torch loads it; the children's tensors are tiny).

A test about the fresh interpreter itself (what `import compiledump` imports) keeps subprocess.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading

_SERVER = r'''
import builtins, fcntl, json, os, select, signal, socket, sys, types
import numpy, torch, torch._dynamo  # noqa: F401  (the cost the children share)

assert len(os.listdir("/proc/self/task")) == 1, "the fork server must be single-threaded"
CTL = socket.socket(fileno=int(sys.argv[1]))
SITE = sys.path[1:]


def serve():
    """Fork a child per request; report its pid, then its exit status. Returns in the child."""
    children = set()
    while True:
        ready, _, _ = select.select([CTL], [], [], 0.02 if children else None)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                CTL.send(json.dumps({"exited": pid, "rc": os.waitstatus_to_exitcode(status)}).encode())
        if not ready:
            continue
        message, fds, _, _ = socket.recv_fds(CTL, 1 << 22, 16)
        if not message:  # the test process is gone
            for pid in children:
                os.kill(pid, signal.SIGKILL)
            os._exit(0)
        pid = os.fork()
        if pid == 0:
            CTL.close()
            return json.loads(message), fds
        for fd in fds:
            os.close(fd)
        children.add(pid)
        CTL.send(json.dumps({"started": pid}).encode())


REQUEST, FDS = serve()
# The descriptors arrive under new numbers: moved out of the way first, then onto the numbers the
# test process gave (stdin, stdout, stderr, then its pass_fds), none of them clobbering another.
FDS = [os.open(os.devnull, os.O_RDONLY), *FDS]
_moved = [fcntl.fcntl(_fd, fcntl.F_DUPFD, 1000) for _fd in FDS]
for _fd in FDS:
    os.close(_fd)
for _target, _fd in zip((0, 1, 2, *REQUEST["pass_fds"]), _moved):
    os.dup2(_fd, _target)
    os.close(_fd)
os.environ.clear()
os.environ.update(REQUEST["env"])
os.chdir(REQUEST["cwd"])
sys.argv = REQUEST["argv"]
sys.path[:] = [REQUEST["path0"], *filter(None, REQUEST["env"].get("PYTHONPATH", "").split(os.pathsep)), *SITE]
_main = types.ModuleType("__main__")
_main.__builtins__ = builtins
if REQUEST["file"]:
    _main.__file__ = REQUEST["file"]
sys.modules["__main__"] = _main
# What the server's imports fixed that a fresh interpreter would draw or read anew: the temporary
# directory (the child's TMPDIR) and the random states (a fresh process seeds them at random).
import tempfile
tempfile.tempdir = None
numpy.random.seed()
if torch.initial_seed() != 67280421310721:  # older torch's fixed seed; newer ones draw one per process
    torch.seed()
del serve, CTL, FDS, _moved, _target, _fd, _main, tempfile
exec(compile(REQUEST["code"], REQUEST["file"] or "<string>", "exec"), sys.modules["__main__"].__dict__)
'''


class _Server:
    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("COMPILEDUMP_") and k not in ("RANK", "WORLD_SIZE", "PYTHONPATH")}
        env["OMP_NUM_THREADS"] = "1"
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(theirs.fileno())], env=env,
                                     pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL)
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        self.started: queue.Queue = queue.Queue()
        self.exited: dict[int, int] = {}
        self.dead = False  # the server ended: no exit status will come for its children
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while message := self.sock.recv(1 << 16):
            message = json.loads(message)
            if "started" in message:
                self.started.put(message["started"])
            else:
                with self.changed:
                    self.exited[message["exited"]] = message["rc"]
                    self.changed.notify_all()
        with self.changed:
            self.dead = True
            self.changed.notify_all()
        self.started.put(None)

    def fork(self, request: dict, fds: list[int]) -> int:
        if self.dead:
            raise RuntimeError(f"the fork server ended ({self.proc.poll()})")
        with self.lock:
            socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
            pid = self.started.get(timeout=300)
        if pid is None:
            raise RuntimeError(f"the fork server ended ({self.proc.poll()})")
        return pid

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        with self.changed:
            self.changed.wait_for(lambda: pid in self.exited or self.dead, timeout)
            if pid not in self.exited and self.dead:
                raise RuntimeError(f"the fork server ended ({self.proc.poll()}) before child {pid} did")
            return self.exited.get(pid)

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)  # the server's end of file: it kills what is left, and exits
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.sock.close()


_server: _Server | None = None


def _get_server() -> _Server:
    global _server
    if _server is None:
        _server = _Server()
        atexit.register(_server.close)
    return _server


class Child:
    """The part of subprocess.Popen the tests use (text pipes for stdout and stderr)."""

    def __init__(self, args: list[str], env: dict | None = None, cwd=None, pass_fds=(), stdout=subprocess.PIPE):
        if args[0] == "-c":
            code, file, path0, argv = args[1], None, "", ["-c", *args[2:]]
        else:
            file = os.path.abspath(args[0])
            with open(file) as f:
                code = f.read()
            path0, argv = os.path.dirname(os.path.realpath(file)), [args[0], *args[1:]]
        (out_r, out_w) = os.pipe() if stdout == subprocess.PIPE else (None, os.open(os.devnull, os.O_WRONLY))
        err_r, err_w = os.pipe()
        request = {"code": code, "file": file, "path0": path0, "argv": argv, "pass_fds": list(pass_fds),
                   "env": dict(os.environ if env is None else env), "cwd": os.path.abspath(cwd or os.getcwd())}
        try:
            self.pid = _get_server().fork(request, [out_w, err_w, *pass_fds])
        finally:
            os.close(out_w)
            os.close(err_w)
        self.args = args
        self.stdout = None if out_r is None else os.fdopen(out_r)
        self.stderr = os.fdopen(err_r)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.wait(timeout=0) if self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if self.returncode is None:
            self.returncode = _get_server().exit_code(self.pid, timeout)
            if self.returncode is None and timeout:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # exited and reaped by the server (no zombie), not yet reported
                self.wait(timeout=60)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        results = {None: None}  # stdout=DEVNULL: nothing to read
        readers = [threading.Thread(target=lambda f=f: results.__setitem__(f, f.read()), daemon=True)
                   for f in (self.stdout, self.stderr) if f is not None]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(timeout)
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(timeout)
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        return results[self.stdout], results[self.stderr]


def start(args: list[str], env: dict | None = None, cwd=None, pass_fds=(), stdout=subprocess.PIPE) -> Child:
    """`subprocess.Popen([sys.executable, *args], stdout=stdout, stderr=PIPE, text=True, pass_fds=pass_fds)`
    (stdout PIPE or DEVNULL), forked."""
    return Child(args, env, cwd, pass_fds, stdout)


def run(args: list[str], env: dict | None = None, cwd=None, timeout: float | None = None,
        check: bool = False) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, *args], capture_output=True, text=True)`, forked."""
    child = Child(args, env, cwd)
    try:
        out, err = child.communicate(timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        raise
    done = subprocess.CompletedProcess([sys.executable, *args], child.returncode, out, err)
    if check and done.returncode:
        sys.stderr.write(err)  # what subprocess.run's inherited stderr would have shown
        done.check_returncode()
    return done
