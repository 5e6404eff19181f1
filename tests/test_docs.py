"""The user documents stay true to the code: the planner knobs' table lists every `Tuning` field with
its default, and every `jaxstitch/...` file a document or script names exists."""
from __future__ import annotations

import dataclasses
import pathlib
import re

from jaxstitch.core.config import Tuning

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCUMENTS = ["README.md", "docs/usage.md", "docs/architecture.md", "docs/performance.md", "scripts/README.md"]


def test_the_knobs_table_lists_every_tuning_field_with_its_default():
    text = (ROOT / "docs/usage.md").read_text().split("## Planner experiments")[1].split("\n## ")[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", text, re.M))
    assert list(rows) == list(Tuning.FIELDS) == [f.name for f in dataclasses.fields(Tuning)]  # (by stage)
    stages = re.findall(r"^\| \*\*(\w+)\*\* \|", text, re.M)
    source = (ROOT / "jaxstitch/core/config.py").read_text().split("class Tuning")[1].split("FIELDS = ")[0]
    assert stages == re.findall(r"^    # (\w+): ", source, re.M)  # the same stages, in order, in Tuning
    for field in dataclasses.fields(Tuning):
        default = field.default
        shown = rows[field.name].strip()
        assert shown == str(default) if default is not None else shown.startswith("("), (field.name, shown)


def test_every_package_file_the_documents_name_exists():
    named = set()
    for doc in DOCUMENTS + [str(p.relative_to(ROOT)) for p in (ROOT / "scripts").glob("*.py")]:
        named |= {(doc, m) for m in re.findall(r"\bjaxstitch/[\w/]+\.(?:py|cc)\b", (ROOT / doc).read_text())}
    missing = sorted((doc, path) for doc, path in named if not (ROOT / path).exists())
    assert named and not missing, missing
