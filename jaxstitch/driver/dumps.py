"""JAXSTITCH_DUMP_DIR's folders, and JAXSTITCH_OVERRIDE_DIR's hand-edited kernels.

A dump writes each program to a folder of its own, `<function>-<hash>`, the hash over what it writes
(so the same program dumps to the same folder, and programs never overwrite each other):

    report.txt              what jaxstitch.explain would print for the program
    region<id>.cu           a region's kernel source, as compiled
    region<id>.plan.txt     its plan, estimate and reason, and `source <hash>`: the name an
                            override of this kernel takes

Kernel override: where JAXSTITCH_OVERRIDE_DIR holds `<hash>.cu` for a generated source of that hash
(the first 16 hex digits of its sha256, as region<id>.plan.txt names it), that file is compiled in
its place, with a warning naming it: copy region<id>.cu there under that name and edit it. It must
keep the generated kernel's name and parameters; an override NVRTC rejects leaves its region to
XLA with NVRTC's log (its lines numbered as in the file). The hash names the generated source, so an
override applies until the planner generates something else for the region.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading

from . import progress

log = logging.getLogger("jaxstitch")

HASH_CHARS = 16         # of a source's sha256, naming its override
FOLDER_HASH_CHARS = 10  # of a dump's sha256, in its folder's name
OVERRIDE_MARK = "// jaxstitch: JAXSTITCH_OVERRIDE_DIR's file in place of generated source "
_warned: set[tuple[str, str]] = set()   # (override path, its sha256): each said once
_warned_lock = threading.Lock()


def source_hash(code: str) -> str:
    """The generated source's hash: of `code`, or for an override the hash of the source it replaced."""
    if code.startswith(OVERRIDE_MARK):
        return code[len(OVERRIDE_MARK):len(OVERRIDE_MARK) + HASH_CHARS]
    return hashlib.sha256(code.encode()).hexdigest()[:HASH_CHARS]


def overridden(source, override_dir: str | None):
    """`source` (a codegen.Source), or with its code replaced by `override_dir`'s file named by its
    hash. The code compiled then starts with a mark naming the hash and a #line naming the file."""
    if not override_dir:
        return source
    h = source_hash(source.code)
    path = os.path.abspath(os.path.join(override_dir, h + ".cu"))
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return source
    except (OSError, UnicodeDecodeError) as e:
        log.warning("JAXSTITCH_OVERRIDE_DIR: cannot read %s (%s); compiling the generated source", path, e)
        return source
    said = (path, hashlib.sha256(text.encode()).hexdigest())
    with _warned_lock:
        first = said not in _warned
        _warned.add(said)
    if first:
        log.warning("JAXSTITCH_OVERRIDE_DIR: compiling %s in place of the generated kernel source %s", path, h)
    quoted = path.replace("\\", "\\\\").replace('"', '\\"')
    return dataclasses.replace(source, code=f'{OVERRIDE_MARK}{h}\n#line 1 "{quoted}"\n{text}')


def write(program, report_text: str, dump_dir: str) -> str:
    """Writes `program` (a pipeline.Program) and its report to its folder in `dump_dir`; returns
    the folder."""
    files = {"report.txt": report_text + "\n"}
    for where, c in program.all_regions():
        body = where.replace("/", ".").replace("[", "").replace("]", "")
        rid = f"{body}.{c.plan.region.id}" if body else str(c.plan.region.id)
        plan = repr(c.plan.kernel) + "\n" + repr(c.plan.estimate) + f"\nreason: {c.reason}\n"
        if c.source:
            files[f"region{rid}.cu"] = c.source
            h = source_hash(c.source)
            plan += f"source {h} (JAXSTITCH_OVERRIDE_DIR/{h}.cu compiles in its place)\n"
        files[f"region{rid}.plan.txt"] = plan
    digest = hashlib.sha256()
    for name in sorted(files):
        if not name.endswith(".plan.txt"):  # (plans print Python objects, not all of them stable)
            digest.update(name.encode() + b"\x00" + files[name].encode() + b"\x00")
    folder = os.path.join(dump_dir, f"{progress.current_name() or 'program'}-"
                                    f"{digest.hexdigest()[:FOLDER_HASH_CHARS]}")
    os.makedirs(folder, exist_ok=True)
    for name, text in files.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
    return folder
