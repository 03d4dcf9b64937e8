"""Short child processes that do not each pay for `import torch`.

Tests of what a dying process leaves (an unhandled exception, a signal, SIGKILL, the exit flush)
each start a real child process running a few lines of capture calls. Each child's CPU time
(about 5.5 s, measured on a busy 2-core machine) was mostly importing torch and dynamo (which the capture API
imports); `Forker` starts one Python process that imports those once and forks a child per script
(a forked child: 0.25 s killed, 1.9 s ending normally, most of that the interpreter's shutdown).

Each child is still a separate process ending the way `python -c SCRIPT` would: its own pid and
start time, its own exit status (a signal's is -SIGNUM, as subprocess reports it), and it runs
the script as `__main__` and then the interpreter's normal shutdown (atexit hooks), an unhandled
exception going through `sys.excepthook` (exit status 1). Nothing of compiledump is imported
before the fork, and the child's environment is set before its script runs: the capture state
and settings each child starts with are those of a fresh process. (Forking after importing torch
and numpy is what multiprocessing's default start method on Linux does.)
"""

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

_SERVER = r"""
import json, os, sys, types
import numpy, torch, torch._dynamo  # the costly imports, once for every child

for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        break
    sys.stdout.write(json.dumps({"pid": pid}) + "\n")
    sys.stdout.flush()
    _, status = os.waitpid(pid, 0)
    sys.stdout.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
    sys.stdout.flush()
else:  # no more scripts: the server's own interpreter shutdown (a second of CPU) is no test's
    os._exit(0)

# The child, from here on the script's process.
for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY),
                        (2, request["stderr"], os.O_WRONLY)):
    os.dup2(os.open(path, flags), fd)
sys.stdin = open(os.devnull)
os.environ.clear()
os.environ.update(request["env"])
sys.argv = ["-c", *request["args"]]
main = types.ModuleType("__main__")
sys.modules["__main__"] = main
exec(compile(request["source"], "<string>", "exec"), main.__dict__)
"""


class Forker:
    """One server process; `run` is `subprocess.run([python, "-c", source, *args], env=env,
    capture_output=True, text=True, timeout=timeout)` with the child forked from it."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.count = 0
        with open(self.workdir / "server.err", "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, bufsize=0)
        self._buffer = b""

    def run(self, source: str, args=(), env=None, timeout: float = 120) -> subprocess.CompletedProcess:
        self.count += 1
        out, err = (self.workdir / f"{self.count}.out", self.workdir / f"{self.count}.err")
        out.touch()
        err.touch()
        request = {"source": source, "args": [str(a) for a in args], "env": dict(os.environ if env is None else env),
                   "stdout": str(out), "stderr": str(err)}
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        pid = self._reply(deadline)["pid"]
        try:
            returncode = self._reply(deadline)["returncode"]
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)
            self._reply(time.monotonic() + 60)  # its exit status: the next run's reply comes next
            raise subprocess.TimeoutExpired(["python", "-c", source, *request["args"]], timeout,
                                            out.read_text(), err.read_text()) from None
        return subprocess.CompletedProcess(["python", "-c", source, *request["args"]], returncode,
                                           out.read_text(), err.read_text())

    def _reply(self, deadline: float) -> dict:
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise subprocess.TimeoutExpired("forked child", 0)
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError("the fork server died: " + (self.workdir / "server.err").read_text()[-3000:])
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
