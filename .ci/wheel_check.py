"""Run by .ci/wheel_check.sh in the wheel's virtual environment: checks that `import jaxstitch` is the
installed wheel (not the source tree), that the wheel holds every module and CUDA template of the
source tree, and that the launcher came along where the source tree has one; then runs the script
given (examples/quickstart.py) as __main__ in this process."""
import os
import pathlib
import runpy
import sys

import jaxstitch
from jaxstitch.integration import ffi

src = pathlib.Path(os.environ["JAXSTITCH_SRC"]).resolve()
venv = pathlib.Path(os.environ["VENV"]).resolve()
installed = pathlib.Path(jaxstitch.__file__).resolve().parent
print(f"wheel check: jaxstitch.__file__ = {jaxstitch.__file__}")


def fail(message: str) -> None:
    sys.exit(f"wheel check FAILED: {message}")


def files(root: pathlib.Path, patterns) -> set[str]:
    return {str(p.relative_to(root)) for pattern in patterns for p in root.rglob(pattern)
            if "__pycache__" not in p.parts}


def check_modules() -> None:
    if not installed.is_relative_to(venv):
        fail(f"jaxstitch was imported from {installed}, not from the wheel in {venv}")
    missing = files(src / "jaxstitch", ["*.py"]) - files(installed, ["*.py"])
    if missing:
        fail(f"the wheel lacks {sorted(missing)}")
    templates = files(src / "csrc_templates", ["*.cu", "*.cuh"])
    if not templates or templates - files(installed / "csrc_templates", ["*.cu", "*.cuh"]):
        fail(f"the wheel lacks CUDA templates: {sorted(templates)}")
    if os.environ.get("NEEDS_LAUNCHER") and ffi._find_library() is None:
        fail("the source tree's launcher was built, the wheel's was not (see the build's messages)")
    ok, why = ffi.register()
    if ffi._find_library() is not None and not ok:
        fail(f"the wheel's launcher does not register: {why}")


def check_loaded() -> None:
    """Every jaxstitch module the script imported came from the wheel."""
    outside = [name for name, m in sys.modules.items() if name.split(".")[0] == "jaxstitch"
               and getattr(m, "__file__", None) and not pathlib.Path(m.__file__).resolve().is_relative_to(venv)]
    if outside:
        fail(f"modules imported from outside the wheel: {outside}")


check_modules()
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
check_loaded()
print(f"wheel check: {script} ran against {installed}")
