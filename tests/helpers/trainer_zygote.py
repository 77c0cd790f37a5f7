"""The server side of `tests/helpers/trainer_process.py`: a process that has imported TensorFlow and the trainer once
and forks a trainer per request, so a test's trainer starts without the seconds `import tensorflow` takes.

Run as `python -m tests.helpers.trainer_zygote SOCKET` from the checkout's root (what `trainer_process` does). It
imports what `python trainer.py` imports before its first TensorFlow op, in the same order (the trainer's module
first: it sets TF_ENABLE_ONEDNN_OPTS before TensorFlow loads), and nothing runs a TensorFlow op or lists a device, so
no TensorFlow runtime thread exists to be lost in a fork. It then accepts one connection per trainer:

1. the client sends a JSON request (argv, cwd, environment) and the trainer's stdin, stdout and stderr as file
   descriptors (SCM_RIGHTS);
2. the server forks a watcher for the connection, and the watcher forks the trainer, answers `{"pid": PID}`, waits
   for it and answers `{"status": WAITSTATUS}` (exit code or signal, as `os.waitpid` gives it);
3. the trainer process takes the descriptors as 0, 1 and 2, the working directory, the environment and argv, and
   runs `trainer.py` as `__main__`; it ends as `python trainer.py` ends (SystemExit, atexit handlers, interpreter
   shutdown), so what it prints on the way out is what a user would see.
"""

from __future__ import annotations

import json
import os
import runpy
import select
import shutil
import signal
import socket
import sys

from absl import app

from gpipe_tf import tf_startup

MAX_REQUEST = 1 << 20


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def _trainer(request: dict, fds: list[int]) -> None:
    """In the forked trainer: the request's descriptors, directory, environment and argv; then trainer.py."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
    # TensorFlow's import queued an absl start-up callback (it lists the GPUs) for the app.run that had not started
    # yet; in `python trainer.py` it runs during the import, inside the trainer's start-up filter: run it so here.
    with tf_startup.known_notices_dropped():
        while app._init_callbacks:  # noqa: SLF001 - absl keeps the queue private; its entries are TensorFlow's
            app._init_callbacks.popleft()()
    # sys.stdin, sys.stdout and sys.stderr write to descriptors 0, 1 and 2 by number: they now reach the client.
    runpy.run_path(sys.argv[0], run_name="__main__")


def _watch(conn: socket.socket) -> dict | None:
    """In the watcher: reads the request, forks the trainer, reports its pid and then its wait status.
    Returns the request in the trainer process (which goes on to run it); the watcher itself never returns."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    data, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
    request = json.loads(data)
    pid = os.fork()
    if pid == 0:
        conn.close()
        request["fds"] = fds
        return request
    for fd in fds:
        os.close(fd)
    try:
        _send(conn, {"pid": pid})
        _, status = os.waitpid(pid, 0)
        _send(conn, {"status": status})
    finally:
        os._exit(0)


def _serve(path: str) -> dict:
    """Accepts connections until the client goes away; returns (in a forked trainer) the request to run."""
    import gpipe_tf.trainer_main  # noqa: F401 - sets TF_ENABLE_ONEDNN_OPTS as trainer.py does, before TensorFlow

    with tf_startup.known_notices_dropped():
        import tensorflow  # noqa: F401 - imported, not started: no op runs and no device is listed here

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # watchers are reaped by the kernel
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    print("ready", flush=True)
    while True:
        # Standard input is a pipe the test process holds open: end of file there means it has ended, however it
        # ended (even by SIGKILL, when its atexit handler cannot stop this process), and so does the zygote.
        if 0 in select.select([server, 0], [], [])[0]:
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
            sys.exit(0)
        conn, _ = server.accept()
        if os.fork() == 0:
            server.close()
            return _watch(conn)
        conn.close()


def main() -> None:
    """Serves until killed; in each forked trainer, runs trainer.py (see the module doc)."""
    request = _serve(sys.argv[1])
    _trainer(request, request.pop("fds"))


if __name__ == "__main__":
    main()
