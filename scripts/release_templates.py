"""Write fsdp2gen/previous_templates/<version>.tar.xz: the template (templates/) of each earlier release, from git.

`fsdp2gen update` re-renders a project as the version it records made it (the base of its three-way merge), with
no network: the package carries the template of every release it can update from, one compressed tar of that
release's `templates/` folder each (about 150 KB). Before releasing a new version, add the release being
superseded to RELEASES (its version and commit) and run this from the repository root:

    python scripts/release_templates.py

Archives that already exist are rewritten identically (the tar is git's own, of the commit; xz is deterministic).
tests/test_update_from_release.py checks each archive against `git archive` of its commit.
"""

from __future__ import annotations

import lzma
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "fsdp2gen" / "previous_templates"
# version -> the commit it was released from (0.1.0 was released untagged, from main at bd34fd4).
RELEASES = {"0.1.0": "bd34fd4f15329d0c9d167e2fc32aa413da975458"}


def archive(commit: str) -> bytes:
    """`templates/` of `commit` as an xz-compressed tar (paths start with templates/)."""
    tar = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", commit, "templates"], check=True, capture_output=True
    ).stdout
    return lzma.compress(tar, preset=9 | lzma.PRESET_EXTREME)


def main() -> int:
    OUT.mkdir(exist_ok=True)
    for version, commit in RELEASES.items():
        path = OUT / f"{version}.tar.xz"
        path.write_bytes(archive(commit))
        print(f"{path.relative_to(REPO)}: templates/ of {commit[:12]} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
