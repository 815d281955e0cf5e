"""Crash-safe, optionally owner-only files: the one atomic writer of the library, the drivers and the node.

Torch-free (the node's per-message process, the site kit and ``verify`` import it): a run's checkpoints and
noise secret (``training.checkpoint``), the node's secure-aggregation state (``edge.secure``) and its site
cache (``edge.site_cache``) all go through :func:`atomic_write_bytes`.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import FetaError


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the file itself is already fsynced
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _process_umask() -> int:
    # Read once at import (os.umask can only be read by setting it; doing that per write would race other
    # threads).
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _process_umask()


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, private: bool = False) -> Path:
    """Write ``data`` to ``path`` atomically and durably (tmp + fsync + os.replace + directory fsync).

    The temporary file comes from ``tempfile.mkstemp`` in the target's directory: a random name created with
    O_EXCL at mode 0600, so a local user can neither predict it nor plant a link there that would receive the
    bytes (a checkpoint holds the DP-SGD noise stream's state; the noise secret is a file too). ``private``:
    the file stays 0600 (whoever reads it can subtract the noise); otherwise it gets the ordinary 0666 &
    ~umask."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            if not private:
                os.fchmod(fh.fileno(), 0o666 & ~_UMASK)
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(p.parent)
    return p


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    """A JSON record (a coordinator's device or public-inputs file, ...), sorted and indented, atomically."""
    return atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def read_run_json(path: str | os.PathLike) -> Any:
    """A record :func:`atomic_write_json` wrote; unreadable JSON means someone else edited the run
    directory."""
    p = Path(path)
    try:
        return json.loads(p.read_text("utf-8"))
    except json.JSONDecodeError as exc:
        raise FetaError(
            f"{p}: corrupt JSON ({exc}); the run directory was modified outside feta-release"
        ) from None


def private_dir(path: str | os.PathLike, *, error: type[Exception] = FetaError) -> Path:
    """``path`` as a directory only this account can list or enter (0700), tightened if it already exists
    looser: it holds a run's checkpoints and noise secret, or the node worker's socket and state. A link, a
    file or another account's directory there is refused (``error``): whoever owns it could read or swap what
    is put inside."""
    p = Path(path)
    p.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = p.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise error(
            f"{p}: must be a directory owned by this account (not a link, a file or another account's "
            "directory); remove it or choose another place"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(p, 0o700)
    return p


# -- reading files that someone else supplied
# --------------------------------------------------------------------- A release directory (and a dataset)
# comes from elsewhere: an archive unpacked from a coordinator, a share. Each file is read through no symbolic
# link (a link could point at /dev/zero, at a key, at a patient file whose hash would land in a shareable
# report), only when it is a regular file, and only up to a size known BEFORE the first byte is read: the size
# the signed document that names it states, and a hard cap.

_OPEN_FLAGS = (
    os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
)
_DIR_FLAGS = (
    os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
)
_CHUNK = 1 << 20


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        return "a pipe or socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _open_beneath(path: Path, root: Path | None) -> int:
    """An fd of ``path`` opened without following a symbolic link in its last part, nor (with ``root``) in any
    part below ``root``: each folder is opened relative to the one above it, so a link swapped in between is
    never followed. O_NONBLOCK: opening a FIFO returns at once (fstat then refuses it) instead of hanging."""
    if root is None or not os.supports_dir_fd >= {os.open}:
        return os.open(path, _OPEN_FLAGS)
    parts = path.relative_to(root).parts
    dfd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        for part in parts[:-1]:
            nfd = os.open(part, _DIR_FLAGS, dir_fd=dfd)
            os.close(dfd)
            dfd = nfd
        return os.open(parts[-1], _OPEN_FLAGS, dir_fd=dfd)
    finally:
        os.close(dfd)


def read_regular(
    path: str | os.PathLike,
    *,
    limit: int,
    error: type[Exception],
    what: str = "file",
    size: int | None = None,
    root: str | os.PathLike | None = None,
    fix: str = "",
) -> bytes:
    """The bytes of ``path``, which must be a REGULAR file reached through no symbolic link (below ``root``,
    when given, through none at all) and hold at most ``limit`` bytes, exactly ``size`` when a signed document
    states it. Both are checked on the opened file's fstat before a byte is read, and at most that many bytes
    are read (a file that grows meanwhile is refused). Any refusal is one ``error`` line naming the file, what
    is wrong and ``fix``."""
    p = Path(path)
    tail = f"; {fix}" if fix else ""
    fd = _open_regular(p, root, error, what, tail, name_missing=True)
    try:
        return _read_fd(fd, p, limit, size, error, what, tail)
    finally:
        os.close(fd)


def hash_regular(
    path: str | os.PathLike,
    *,
    error: type[Exception],
    what: str = "file",
    root: str | os.PathLike | None = None,
    fix: str = "",
) -> tuple[int, str]:
    """(size, sha256 hex) of ``path``, a regular file reached through no link (as :func:`read_regular`),
    hashed in 1 MiB chunks: a file of any size is listed without being held in memory, and a link is never
    followed into a file of the reader's machine whose hash would then be shown."""
    import hashlib

    p = Path(path)
    tail = f"; {fix}" if fix else ""
    fd = _open_regular(p, root, error, what, tail, name_missing=False)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{p}: the {what} is {_kind(st.st_mode)}, not a regular file; it is not read{tail}")
        h, size = hashlib.sha256(), 0
        while chunk := os.read(fd, _CHUNK):
            h.update(chunk)
            size += len(chunk)
        return size, h.hexdigest()
    finally:
        os.close(fd)


def _open_regular(
    p: Path,
    root: str | os.PathLike | None,
    error: type[Exception],
    what: str,
    tail: str,
    *,
    name_missing: bool,
) -> int:
    """A descriptor of ``p`` if it is a regular file reached through no link (below ``root``: none at all),
    else one ``error`` line; ``name_missing``: a missing file says so rather than naming the open's OS
    error."""
    try:
        st = os.lstat(p)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{p}: the {what} is {_kind(st.st_mode)}, not a regular file; it is not read{tail}")
        return _open_beneath(p, Path(root) if root is not None else None)
    except OSError as exc:  # ELOOP: a link in a folder below root (O_NOFOLLOW); EACCES ...
        if name_missing and isinstance(exc, FileNotFoundError):
            raise error(f"{p}: cannot read the {what}: missing or unreadable{tail}") from None
        raise error(
            f"{p}: the {what} cannot be opened as a regular file without following a link "
            f"({exc.strerror or exc}){tail}"
        ) from None


def _read_fd(
    fd: int, p: Path, limit: int, size: int | None, error: type[Exception], what: str, tail: str
) -> bytes:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # swapped between the lstat and the open
        raise error(f"{p}: the {what} is {_kind(st.st_mode)}, not a regular file; it is not read{tail}")
    if st.st_size > limit:
        raise error(
            f"{p}: the {what} is {st.st_size:,} bytes, over the limit of {limit:,}; it is not read{tail}"
        )
    if size is not None and st.st_size != size:
        raise error(
            f"{p}: the {what} is {st.st_size:,} bytes, the signed manifest says {size:,}; it is not "
            f"read{tail}"
        )
    want = st.st_size if size is None else size
    buf = bytearray()
    while len(buf) <= want:
        chunk = os.read(fd, min(_CHUNK, want + 1 - len(buf)))
        if not chunk:
            break
        buf += chunk
    if len(buf) != want:
        raise error(f"{p}: the {what} changed while being read ({len(buf):,} bytes, expected {want:,}){tail}")
    return bytes(buf)


# -- bounded .npz reading
# ------------------------------------------------------------------------------------- np.load trusts the
# archive: a 1.2 MB file of deflated zeros inflates to gigabytes, and an array header may claim any shape.
# Here every member's header is read first (a few hundred bytes), its shape x dtype must be exactly the bytes
# its zip entry declares, the total must fit the caller's limit, a large member must not inflate more than
# NPZ_MAX_RATIO times (no real image data does; deflated zeros do ~1000x), and each array is read into a
# buffer of exactly its declared size.

NPZ_MAX_MEMBERS = 64
NPZ_MAX_RATIO = 100
NPZ_RATIO_FLOOR = 16 << 20  # members below this uncompressed size are never refused for their ratio


@dataclass(frozen=True)
class NpyHeader:
    """One array of an .npz as its header declares it (nothing of its data read yet)."""

    name: str
    shape: tuple[int, ...]
    dtype: Any  # numpy.dtype
    fortran_order: bool
    nbytes: int


def read_npz(
    source: bytes | str | os.PathLike,
    where: str,
    *,
    names: Sequence[str],
    max_bytes: int,
    error: type[Exception],
    optional: Sequence[str] = (),
    check: Callable[[dict[str, NpyHeader]], None] | None = None,
) -> dict[str, Any]:
    """The arrays ``names`` (and those of ``optional`` that are present) of an .npz given as bytes or a path,
    read with bounded memory (see above); ``check`` sees every header before any data is read and raises to
    refuse. Pickled (object) arrays are refused. Any refusal is one ``error`` line naming ``where``."""
    import io
    import struct
    import zipfile
    import zlib

    try:
        with zipfile.ZipFile(io.BytesIO(source) if isinstance(source, bytes) else Path(source)) as zf:
            infos = _npz_members(zf, where, names, optional, error)
            headers = {n: _npy_header(zf, info, n, where, error) for n, info in infos.items()}
            if check is not None:
                check(headers)
            _check_npz_bounds(headers, infos, where, max_bytes, error)
            return {n: _read_npy(zf, infos[n], headers[n], where, error) for n in headers}
    except (
        zipfile.BadZipFile,
        OSError,
        EOFError,
        ValueError,
        zlib.error,
        struct.error,
        NotImplementedError,
        KeyError,
    ) as exc:
        if isinstance(exc, error):
            raise
        raise error(f"{where}: not a readable .npz file (corrupt or truncated: {exc})") from None
    except MemoryError:
        raise error(f"{where}: its arrays do not fit in this machine's memory") from None


def _npz_members(
    zf: Any, where: str, names: Sequence[str], optional: Sequence[str], error: type[Exception]
) -> dict[str, Any]:
    infos = zf.infolist()
    if len(infos) > NPZ_MAX_MEMBERS:
        raise error(f"{where}: {len(infos)} members; an .npz here holds at most {NPZ_MAX_MEMBERS} arrays")
    seen = [i.filename for i in infos]
    twice = sorted({n for n in seen if seen.count(n) > 1})
    if twice:
        raise error(
            f"{where}: member(s) {', '.join(twice[:5])} appear more than once; two readers would see two "
            "different arrays: write the file again"
        )
    by_name = {i.filename[:-4]: i for i in infos if i.filename.endswith(".npy")}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise error(f"{where}: missing array(s) {missing}; it needs {list(names)} (found {sorted(by_name)})")
    return {n: by_name[n] for n in [*names, *(o for o in optional if o in by_name)]}


def _npy_header(zf: Any, info: Any, name: str, where: str, error: type[Exception]) -> NpyHeader:
    import math
    import zipfile

    from numpy.lib import format as npy_format

    if info.flag_bits & 0x1 or info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise error(
            f"{where}: array {name!r} is encrypted or compressed with method {info.compress_type}; only "
            "stored or deflated arrays (numpy.savez / savez_compressed) are read"
        )
    with zf.open(info) as fh:
        major, _ = npy_format.read_magic(fh)
        read = npy_format.read_array_header_1_0 if major == 1 else npy_format.read_array_header_2_0
        shape, fortran, dtype = read(fh)
        offset = fh.tell()
    if dtype.hasobject or dtype.itemsize == 0:
        raise error(
            f"{where}: unsupported array contents: array {name!r} has dtype {dtype} (Python objects need a "
            "pickle, which is never read); store plain numeric or string arrays"
        )
    nbytes = math.prod(shape) * dtype.itemsize
    if offset + nbytes != info.file_size:
        raise error(
            f"{where}: array {name!r} declares shape {shape} ({dtype}, {nbytes:,} bytes) but its member "
            f"holds {max(info.file_size - offset, 0):,} bytes of data; the file is corrupt or truncated"
        )
    return NpyHeader(name, tuple(int(v) for v in shape), dtype, bool(fortran), int(nbytes))


def _check_npz_bounds(
    headers: dict[str, NpyHeader], infos: dict[str, Any], where: str, max_bytes: int, error: type[Exception]
) -> None:
    total = sum(h.nbytes for h in headers.values())
    if total > max_bytes:
        raise error(
            f"{where}: its arrays would take {total:,} bytes, over the limit of {max_bytes:,}; it is not read"
        )
    for n, info in infos.items():
        if info.file_size > NPZ_RATIO_FLOOR and info.file_size > NPZ_MAX_RATIO * max(info.compress_size, 1):
            raise error(
                f"{where}: array {n!r} inflates {info.compress_size:,} compressed bytes to "
                f"{info.file_size:,} (over {NPZ_MAX_RATIO}x): a decompression bomb, not image data; it is "
                "not read"
            )


def _read_npy(zf: Any, info: Any, h: NpyHeader, where: str, error: type[Exception]) -> Any:
    import numpy as np

    buf = bytearray(h.nbytes)
    view = memoryview(buf)
    with zf.open(info) as fh:
        fh.read(info.file_size - h.nbytes)  # the header, parsed already
        got = 0
        while got < h.nbytes:
            chunk = fh.read(min(_CHUNK, h.nbytes - got))
            if not chunk:
                break
            view[got : got + len(chunk)] = chunk
            got += len(chunk)
        if got != h.nbytes or fh.read(1):  # the read to the end also checks the member's CRC
            raise error(
                f"{where}: array {h.name!r} holds {got:,} bytes, its header declares {h.nbytes:,}; the file "
                "is corrupt or truncated"
            )
    flat = np.frombuffer(buf, dtype=h.dtype, count=h.nbytes // h.dtype.itemsize if h.dtype.itemsize else 0)
    return flat.reshape(h.shape, order="F" if h.fortran_order else "C")
