"""A filesystem whose flock does not work, as Lustre mounted without -o flock (ENOSYS) or NFSv3 without its lock
daemon (ENOLCK) is: an in-memory FUSE filesystem served here over /dev/fuse (the kernel's FUSE protocol, no
libfuse), which takes the file locks on itself (FUSE_FLOCK_LOCKS, FUSE_POSIX_LOCKS) and answers every lock request
with the errno it was started with. Everything else works: files, folders, rename, statfs.

    python tests/helpers/noflock_fs.py MOUNTPOINT ERRNO_NAME   # mounts, prints "ready", serves until unmounted

Needs root (mount(2)) and /dev/fuse. Unmount with umount2(MOUNTPOINT, MNT_DETACH) (or `umount -l`): the server
then ends. `available()` says why it cannot run here, or None.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct
import sys
import time

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding
OUT_HEADER = struct.Struct("<IiQ")  # len, error (a negative errno), unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # ino size blocks atime mtime ctime *nsec mode nlink uid gid rdev ...
ENTRY_OUT = struct.Struct("<QQQQII")  # nodeid, generation, entry_valid, attr_valid, their nsec; then ATTR
OPEN_OUT = struct.Struct("<QIi")  # fh, open_flags, backing_id
FUSE_POSIX_LOCKS, FUSE_FLOCK_LOCKS = 1 << 1, 1 << 10
FATTR_MODE, FATTR_SIZE = 1, 8
MAX_WRITE = 1 << 17

# The opcodes served (include/uapi/linux/fuse.h); any other one is answered ENOSYS, which the kernel handles.
LOOKUP, FORGET, GETATTR, SETATTR, MKDIR, UNLINK, RMDIR, RENAME = 1, 2, 3, 4, 9, 10, 11, 12
OPEN, READ, WRITE, STATFS, RELEASE, FSYNC, FLUSH, INIT = 14, 15, 16, 17, 18, 20, 25, 26
OPENDIR, READDIR, RELEASEDIR, GETLK, SETLK, SETLKW, CREATE = 27, 28, 29, 31, 32, 33, 35
INTERRUPT, DESTROY, BATCH_FORGET, RENAME2 = 36, 38, 42, 45
NO_REPLY = {FORGET, BATCH_FORGET, INTERRUPT}


def available() -> str | None:
    """Why this filesystem cannot be mounted here, or None."""
    if sys.platform != "linux":
        return "a FUSE mount needs Linux"
    if os.geteuid() != 0:
        return "mounting a FUSE filesystem needs root"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is missing"
    return None


class Node:
    def __init__(self, ino: int, mode: int) -> None:
        self.ino, self.mode = ino, mode
        self.data = bytearray()
        self.children: dict[bytes, Node] = {}
        self.mtime = time.time()

    def attr(self) -> bytes:
        size = len(self.data) if stat.S_ISREG(self.mode) else 4096
        seconds, nanos = int(self.mtime), int(self.mtime % 1 * 1e9)
        nlink = 2 if stat.S_ISDIR(self.mode) else 1
        return ATTR.pack(self.ino, size, (size + 511) // 512, seconds, seconds, seconds, nanos, nanos, nanos,
                         self.mode, nlink, 0, 0, 0, 4096, 0)  # fmt: skip

    def entry(self) -> bytes:
        # Valid for 0 s: the kernel asks again each time, so nothing it caches can be stale.
        return ENTRY_OUT.pack(self.ino, 0, 0, 0, 0, 0) + self.attr()


class NoFlockFS:
    def __init__(self, lock_errno: int) -> None:
        self.lock_errno = lock_errno
        self.nodes = {1: Node(1, stat.S_IFDIR | 0o755)}
        self.next_ino = 2

    def new(self, parent: Node, name: bytes, mode: int) -> Node:
        if name in parent.children:
            raise OSError(errno.EEXIST, "exists")
        node = self.nodes[self.next_ino] = Node(self.next_ino, mode)
        self.next_ino += 1
        parent.children[name] = node
        return node

    def handle(self, opcode: int, node: Node | None, body: bytes) -> bytes:  # noqa: C901, PLR0911, PLR0912
        if opcode == INIT:
            major, minor, readahead, flags = struct.unpack_from("<IIII", body)
            granted = flags & (FUSE_POSIX_LOCKS | FUSE_FLOCK_LOCKS)
            return struct.pack("<IIIIHHIIHHII", 7, 31, readahead, granted, 16, 12, MAX_WRITE, 1, 0, 0, 0, 0) + bytes(24)
        if node is None:
            raise OSError(errno.ENOENT, "no such node")
        if opcode in (GETLK, SETLK, SETLKW):
            raise OSError(self.lock_errno, "locks do not work here")
        if opcode == LOOKUP:
            child = node.children.get(body.rstrip(b"\0"))
            if child is None:
                raise OSError(errno.ENOENT, "no such file")
            return child.entry()
        if opcode == GETATTR:
            return struct.pack("<QII", 0, 0, 0) + node.attr()
        if opcode == SETATTR:
            valid = struct.unpack_from("<I", body)[0]
            size, mode = struct.unpack_from("<Q", body, 16)[0], struct.unpack_from("<I", body, 68)[0]
            if valid & FATTR_SIZE:
                node.data = node.data[:size] + bytes(max(0, size - len(node.data)))
            if valid & FATTR_MODE:
                node.mode = stat.S_IFMT(node.mode) | stat.S_IMODE(mode)
            node.mtime = time.time()
            return struct.pack("<QII", 0, 0, 0) + node.attr()
        if opcode == MKDIR:
            mode = struct.unpack_from("<I", body)[0]
            return self.new(node, body[8:].rstrip(b"\0"), stat.S_IFDIR | stat.S_IMODE(mode)).entry()
        if opcode == CREATE:
            flags, mode = struct.unpack_from("<II", body)
            name = body[16:].rstrip(b"\0")
            child = node.children.get(name) or self.new(node, name, stat.S_IFREG | stat.S_IMODE(mode))
            if flags & os.O_TRUNC:
                child.data = bytearray()
            return child.entry() + OPEN_OUT.pack(0, 0, 0)
        if opcode in (OPEN, OPENDIR):
            if opcode == OPEN and struct.unpack_from("<I", body)[0] & os.O_TRUNC:
                node.data = bytearray()
            return OPEN_OUT.pack(0, 0, 0)
        if opcode == READ:
            offset, size = struct.unpack_from("<QI", body, 8)
            return bytes(node.data[offset : offset + size])
        if opcode == WRITE:
            offset, size = struct.unpack_from("<QI", body, 8)
            data = body[40 : 40 + size]
            if len(node.data) < offset:
                node.data += bytes(offset - len(node.data))
            node.data[offset : offset + len(data)] = data
            node.mtime = time.time()
            return struct.pack("<II", len(data), 0)
        if opcode in (UNLINK, RMDIR):
            name = body.rstrip(b"\0")
            child = node.children.get(name)
            if child is None:
                raise OSError(errno.ENOENT, "no such file")
            if opcode == RMDIR and child.children:
                raise OSError(errno.ENOTEMPTY, "not empty")
            del node.children[name]
            return b""
        if opcode in (RENAME, RENAME2):
            newdir, start = struct.unpack_from("<Q", body)[0], 8 if opcode == RENAME else 16
            old, new = body[start:].split(b"\0")[:2]
            if old not in node.children:
                raise OSError(errno.ENOENT, "no such file")
            target = self.nodes[newdir]
            if new in target.children and target.children[new].children:
                raise OSError(errno.ENOTEMPTY, "not empty")
            target.children[new] = node.children.pop(old)
            return b""
        if opcode == READDIR:
            offset, size = struct.unpack_from("<QI", body, 8)
            entries = [(b".", node), (b"..", node), *node.children.items()]
            out = b""
            for index, (name, child) in enumerate(entries[offset:], start=offset + 1):
                kind = 4 if stat.S_ISDIR(child.mode) else 8  # DT_DIR, DT_REG
                record = struct.pack("<QQII", child.ino, index, len(name), kind) + name
                record += bytes(-len(record) % 8)
                if len(out) + len(record) > size:
                    break
                out += record
            return out
        if opcode == STATFS:
            return struct.pack("<QQQQQIIII", 1 << 24, 1 << 23, 1 << 23, 1 << 20, 1 << 19, 4096, 255, 4096, 0) + bytes(
                24
            )
        if opcode in (RELEASE, RELEASEDIR, FLUSH, FSYNC, DESTROY):
            return b""
        raise OSError(errno.ENOSYS, "not served")


def serve(mountpoint: str, lock_errno: int) -> None:
    fd = os.open("/dev/fuse", os.O_RDWR)
    options = f"fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other,default_permissions".encode()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"noflock", mountpoint.encode(), b"fuse.noflock", 0, options) != 0:
        raise OSError(ctypes.get_errno(), f"mount {mountpoint}")
    print("ready", flush=True)
    fs = NoFlockFS(lock_errno)
    while True:
        try:
            request = os.read(fd, MAX_WRITE + 4096)
        except OSError as exc:
            if exc.errno == errno.ENODEV:  # unmounted
                return
            if exc.errno in (errno.EINTR, errno.ENOENT):  # interrupted; a request the kernel took back
                continue
            raise
        _, opcode, unique, nodeid, *_ = IN_HEADER.unpack_from(request)
        try:
            reply, error = fs.handle(opcode, fs.nodes.get(nodeid), request[IN_HEADER.size :]), 0
        except OSError as exc:
            reply, error = b"", -exc.errno
        if opcode not in NO_REPLY:
            try:
                os.write(fd, OUT_HEADER.pack(OUT_HEADER.size + len(reply), error, unique) + reply)
            except OSError as exc:
                if exc.errno != errno.ENOENT:  # the request was interrupted and dropped
                    raise
        if opcode == DESTROY:
            return


if __name__ == "__main__":
    serve(sys.argv[1], getattr(errno, sys.argv[2]))
