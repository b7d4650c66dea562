"""The templates test what a model family can do (capabilities derived in copier.yml: transformers_model,
model_presets, block_class), never its name: only copier.yml, the files whose name is conditioned on the family
(model.py, model_args.py, the export variants, sharded_init, check_init/check_pretrained) and the docs compare
`family`. A new family then sets its capabilities and brings its own files."""

from __future__ import annotations

import re

from tests.conftest import REPO

PROJECT = REPO / "templates" / "project"
# Documentation, which describes each family in its own words.
DOCS = {"README.md.jinja", "AGENTS.md.jinja"}


def test_no_template_compares_family_outside_the_familys_own_files() -> None:
    offenders = {}
    for path in sorted(PROJECT.rglob("*")):
        if not path.is_file() or "family" in path.name or path.name in DOCS:
            continue
        found = re.findall(r"family\s*(?:==|!=)", path.read_text(encoding="utf-8", errors="replace"))
        if found:
            offenders[str(path.relative_to(PROJECT))] = len(found)
    assert offenders == {}, f"use a capability from templates/copier.yml instead of comparing family in {offenders}"
