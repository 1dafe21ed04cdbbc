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


def commit_digest(commit: str, repo: Path = Path(".")) -> str:
    """:func:`tree_digest` of ``src/srtrain`` as committed at ``commit`` in ``repo``."""

    def git(*args: str) -> bytes:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, check=True
        ).stdout

    digest = hashlib.sha256()
    listing = git("ls-tree", "-r", "--name-only", commit, "src/srtrain").decode().split()
    files = sorted(
        (Path(name).relative_to("src/srtrain").as_posix(), name)
        for name in listing
        if name.endswith(".py")
    )
    for relative, name in files:
        digest.update(relative.encode() + b"\0")
        digest.update(git("show", f"{commit}:{name}") + b"\0")
    return digest.hexdigest()[:16]


def commit_with_digest(digest: str, repo: Path = Path("."), limit: int = 100) -> str | None:
    """The commit among the last ``limit`` of ``repo``'s history that changed src/srtrain
    whose sources have ``digest`` (:func:`tree_digest`): the commit that introduced the code
    a result was measured on; None if none has."""
    listed = subprocess.run(
        ["git", "-C", str(repo), "rev-list", f"--max-count={limit}", "HEAD", "--", "src/srtrain"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for commit in listed:
        if commit_digest(commit, repo) == digest:
            return commit[:7]
    return None
