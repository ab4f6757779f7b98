"""A handler module that, imported by the parent before any fork (`workers.handler =
"inherithandlers:record"`), opens one of each kind of descriptor a worker could inherit: a file,
a pipe, a listening TCP socket, a UDP socket and a unix socket pair. It writes what they are
(inode numbers, the file's path) to $INHERIT_REPORT, so a test can look for each of them in the
workers' /proc/<pid>/fd."""

import json
import os
import socket

from testhandlers import record  # noqa: F401  (the handler itself)

_file = open(os.environ["INHERIT_FILE"], "w")
_pipe = os.pipe()
_tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
_tcp.bind(("127.0.0.1", 0))
_tcp.listen()
_udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
_udp.bind(("127.0.0.1", 0))
_pair = socket.socketpair()

_objects = {"file": _file.fileno(), "pipe_read": _pipe[0], "pipe_write": _pipe[1], "tcp_listener": _tcp.fileno(),
            "udp": _udp.fileno(), "unix_pair_0": _pair[0].fileno(), "unix_pair_1": _pair[1].fileno()}
with open(os.environ["INHERIT_REPORT"], "w") as out:
    json.dump({"parent": os.getpid(), "file": os.environ["INHERIT_FILE"],
               "inodes": {name: os.fstat(fd).st_ino for name, fd in _objects.items()}}, out)
