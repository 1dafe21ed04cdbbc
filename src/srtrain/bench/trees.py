"""Source trees of srtrain: where a tree is, which commit it is, a digest of its sources.

The headline guard (``srtrain bench --headline --trees before=old/src,after=src``) runs each
tree in a fresh process that imports srtrain from it; :func:`tree_commit` names its commit
and :func:`tree_digest` fingerprints its sources, so a result measured on a machine whose
git cannot be trusted is filed under the commit whose sources it ran
(:func:`commit_with_digest`).
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path


def parse_trees(spec: str) -> dict[str, Path]:
    """``NAME=PATH,NAME=PATH,...`` → {name: path}; each path holds an ``srtrain`` package."""
    trees: dict[str, Path] = {}
    for item in spec.split(","):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--trees takes NAME=PATH,NAME=PATH; got {item!r}")
        if name in trees:
            raise ValueError(f"--trees names {name!r} twice")
        root = Path(path)
        if not (root / "srtrain" / "__init__.py").is_file():
            raise ValueError(
                f"--trees: {path!r} holds no srtrain package (give the directory "
                "that contains srtrain/, such as a checkout's src)"
            )
        trees[name] = root.resolve()
    if len(trees) < 2:
        raise ValueError("--trees needs two or more trees to compare")
    return trees


def tree_commit(root: Path) -> str:
    """The commit of the git checkout whose tracked files hold ``root``'s srtrain package
    (``git worktree add DIR COMMIT`` makes one of any commit), with ``+changes`` where its
    files differ from it; ``unknown`` for a tree git does not track (an export, or a copy
    in an ignored directory)."""

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=False
        )

    try:
        head = git("rev-parse", "--short", "HEAD")
        tracked = git("ls-files", "--error-unmatch", "srtrain/__init__.py")
        if head.returncode != 0 or tracked.returncode != 0:
            return "unknown"
        changed = git("status", "--porcelain", "--untracked-files=no", ".").stdout.strip()
    except OSError:
        return "unknown"
    return head.stdout.strip() + ("+changes" if changed else "")


def tree_digest(root: Path) -> str:
    """SHA-256 (first 16 hex digits) over the relative paths and contents of the ``.py``
    files of ``root``'s srtrain package: which code ran, readable where git is not (a copy
    of a checkout); :func:`commit_digest` gives a commit's, to match it."""
    digest = hashlib.sha256()
    package = Path(root) / "srtrain"
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


class _Blobs:
    """The contents of git blobs of ``repo`` by id, read through one ``git cat-file --batch``
    process and kept: successive commits share most of their files."""

    def __init__(self, repo: Path) -> None:
        self.cache: dict[str, bytes] = {}
        self.proc = subprocess.Popen(
            ["git", "-C", str(repo), "cat-file", "--batch"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    def __enter__(self) -> _Blobs:
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()

    def __getitem__(self, blob: str) -> bytes:
        if blob not in self.cache:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(blob.encode() + b"\n")
            self.proc.stdin.flush()
            size = int(self.proc.stdout.readline().split()[2])
            self.cache[blob] = self.proc.stdout.read(size)
            self.proc.stdout.read(1)  # the newline after the contents
        return self.cache[blob]


def _digest_at(commit: str, repo: Path, blobs: _Blobs) -> str:
    """:func:`tree_digest` of ``src/srtrain`` as committed at ``commit``."""
    listing = subprocess.run(
        ["git", "-C", str(repo), "ls-tree", "-r", commit, "src/srtrain"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    files = []
    for line in listing:
        meta, name = line.split("\t", 1)
        if name.endswith(".py"):
            files.append((Path(name).relative_to("src/srtrain").as_posix(), meta.split()[2]))
    digest = hashlib.sha256()
    for relative, blob in sorted(files):
        digest.update(relative.encode() + b"\0")
        digest.update(blobs[blob] + b"\0")
    return digest.hexdigest()[:16]


def commit_digest(commit: str, repo: Path = Path(".")) -> str:
    """:func:`tree_digest` of ``src/srtrain`` as committed at ``commit`` in ``repo``."""
    with _Blobs(repo) as blobs:
        return _digest_at(commit, repo, blobs)


def commit_with_digest(digest: str, repo: Path = Path(".")) -> str | None:
    """The newest commit of ``repo``'s history that changed src/srtrain whose sources have
    ``digest`` (:func:`tree_digest`): the commit that introduced the code a result was
    measured on; None if none has. ValueError when ``repo`` is not a git checkout."""
    listing = subprocess.run(
        ["git", "-C", str(repo), "rev-list", "HEAD", "--", "src/srtrain"],
        capture_output=True,
        text=True,
        check=False,
    )
    if listing.returncode != 0:
        raise ValueError(f"{repo.resolve()} is not a git checkout: {listing.stderr.strip()}")
    listed = listing.stdout.split()
    with _Blobs(repo) as blobs:
        for commit in listed:
            if _digest_at(commit, repo, blobs) == digest:
                return commit[:7]
    return None
