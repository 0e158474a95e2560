"""The device image's view of this Python, for the kit's checks here (tests/test_gpu_kit.py, rehearse.sh).

With this folder on PYTHONPATH, a module from this machine's site-packages imports only if its distribution is
on the image (../image.txt) or carried as a wheel (../wheels.txt); others raise ModuleNotFoundError, as on the
image, and `importlib.util.find_spec` answers None for them (transformers probes optional packages so; raising
there would break it). importlib.metadata sees only those distributions (pytest's plugins, version probes).
The image's packages, imported from site-packages, also get what their versions here require (a newer
huggingface-hub's httpx2); the checkout and the carried wheels do not. Modules outside site-packages (the
checkout, the wheels' --target folder) and the standard library import as usual, less what Python 3.12
dropped. Each refusal is appended to $KIT_VIEW_LOG when set.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import re
import site
import sys

_KIT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_GONE_IN_312 = {"distutils", "imp", "asynchat", "asyncore", "smtpd"}  # the image's Python is 3.12


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _listed(filename: str) -> set[str]:
    """Distribution names of a kit list: one a line, `#` comments, a requirement's pins dropped."""
    with open(os.path.join(_KIT, filename)) as f:
        lines = (line.split("#", 1)[0].strip() for line in f)
        return {_norm(re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0]) for line in lines if line}


ALLOWED = _listed("image.txt") | _listed("wheels.txt")
_SITE = tuple(os.path.realpath(p) + os.sep for p in site.getsitepackages() + [site.getusersitepackages()])
_distributions = importlib.metadata.distributions
_distribution = importlib.metadata.distribution
_find_spec = importlib.util.find_spec
_STDLIB = os.path.dirname(os.__file__) + os.sep
_owners: dict[str, list[str]] | None = None
_needs: set[str] | None = None
_strict_cache: dict[str, str | None] = {}
_logged: set[str] = set()


def _owner_map() -> dict[str, list[str]]:
    global _owners
    if _owners is None:
        _owners = {}
        for dist in _distributions():
            for top in (dist.read_text("top_level.txt") or "").split() or _tops(dist):
                _owners.setdefault(top, []).append(dist.metadata["Name"] or "?")
    return _owners


def _tops(dist) -> set[str]:
    return {f.parts[0].split(".")[0] for f in dist.files or () if f.parts and not f.parts[0].endswith(
        (".dist-info", ".egg-info", ".data", ".pth")) and f.parts[0] != ".."}


def _holders(where: str | None) -> list[str]:
    """The distributions of the site-packages folder a module lies inside (a package's vendored copies, such as
    setuptools/_vendor/jaraco, come with the package)."""
    real = os.path.realpath(where) if where else ""
    for folder in _SITE:
        rel = real[len(folder):] if real.startswith(folder) else ""
        if os.sep in rel:
            return _owner_map().get(rel.split(os.sep, 1)[0], [])
    return []


def _strict(name: str) -> str | None:
    """Why the image would not have top-level module `name` for the kit's own code, or None where it would."""
    if name in _strict_cache:
        return _strict_cache[name]
    why = None
    if name in _GONE_IN_312:
        why = f"{name} is not in the image's Python 3.12"
    elif name not in sys.builtin_module_names and name not in sys.stdlib_module_names:
        spec = importlib.machinery.PathFinder.find_spec(name)
        where = spec and (spec.origin if spec.origin not in (None, "namespace") else
                          next(iter(spec.submodule_search_locations or ()), None))
        if spec is None or (where and os.path.realpath(where).startswith(_SITE)):
            owners = _owner_map().get(name, []) or _holders(where)
            if (spec is not None or owners) and not any(_norm(o) in ALLOWED for o in owners):
                why = (f"{name} (distribution {', '.join(owners) or 'unknown'}) is neither on the device image "
                       f"(bench/gpu/image.txt) nor carried (bench/gpu/wheels.txt)")
    _strict_cache[name] = why
    return why


def _image_needs() -> set[str]:
    """Distributions that the image's packages, as installed here, require (their versions here may need
    others than the image's do: a newer huggingface-hub, httpx2)."""
    global _needs
    if _needs is None:
        dists = {_norm(d.metadata["Name"] or ""): d for d in _distributions()}
        _needs, todo = set(), [n for n in ALLOWED - _listed("wheels.txt") if n in dists]
        while todo:
            for req in dists[todo.pop()].requires or ():
                if "extra ==" not in req.replace('"', "").replace("'", ""):
                    dep = _norm(re.split(r"[<>=!~;\[ (]", req.strip(), maxsplit=1)[0])
                    if dep not in _needs and dep not in ALLOWED:
                        _needs.add(dep)
                        todo += [dep] if dep in dists else []
    return _needs


def _called_from_site_packages() -> bool:
    """Whether the import comes from an installed package's code (not the checkout's, nor a carried wheel's)."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        if path.startswith(_SITE) or os.path.realpath(path).startswith(_SITE):
            return True
        if not (path.startswith("<") or path == __file__ or path.startswith(_STDLIB)):
            return False
        f = f.f_back
    return False


def refusal(name: str) -> str | None:
    """Why the image would not have top-level module `name` here, or None where it would: the kit's code gets
    only the image's and the carried wheels' distributions; the image's own packages also what they need."""
    why = _strict(name)
    if why and any(_norm(o) in _image_needs() for o in _owner_map().get(name, [])) and _called_from_site_packages():
        return None
    if why and name not in _logged and os.environ.get("KIT_VIEW_LOG"):
        _logged.add(name)
        with open(os.environ["KIT_VIEW_LOG"], "a") as f:
            f.write(f"{why}\n")
    return why


class ImageView(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if path is None and (why := refusal(fullname)):
            raise ModuleNotFoundError(f"No module named {fullname!r}: {why}", name=fullname)
        return None


def find_spec(name, package=None):
    """importlib.util.find_spec as the image answers it: None for a refused top-level module."""
    if not name.startswith(".") and "." not in name and refusal(name):
        return None
    return _find_spec(name, package)


def distributions(**kwargs):
    seen = ALLOWED | _image_needs()
    return (d for d in _distributions(**kwargs) if _norm(d.metadata["Name"] or "") in seen)


def distribution(name):
    if _norm(name) not in ALLOWED | _image_needs():
        raise importlib.metadata.PackageNotFoundError(name)
    return _distribution(name)


sys.meta_path.insert(0, ImageView())
importlib.util.find_spec = find_spec
importlib.metadata.distributions = distributions
importlib.metadata.distribution = distribution
