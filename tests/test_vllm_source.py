"""Reading Python sources with ``ast`` (actors/vllm_source.py), on a small tree shaped like vLLM's: a name
re-exported through a package, relative imports, inherited members, ``self`` attributes, dataclass fields, a
``Literal`` alias, and a method that passes ``**kwargs`` on to another class's method of the same name (Model Runner
V2's ``reload_weights`` before 0.32 does)."""

from pathlib import Path

from horizonrl.actors.vllm_source import (SourceTree, constructor_parameters, forwarded_parameters, literal_values,
                                          parameters)


def write(root: Path, files: dict[str, str]) -> SourceTree:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return SourceTree(root)


def test_names_are_followed_through_packages_bases_and_forwarded_keywords(tmp_path):
    tree = write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/inputs/__init__.py": "from .data import Prompt\n",
        "pkg/inputs/data.py": "class Base(TypedDict):\n    ids: list\nclass Prompt(Base, total=False):\n    salt: str\n",
        "pkg/config.py": "Mode = Literal['raw', 'processed']\n",
        "pkg/runner.py": (
            "from dataclasses import dataclass\n"
            "class Runner:\n"
            "    def __init__(self):\n        self.requests = {}\n"
            "    def reload(self, weights=None, *, fmt=True):\n        pass\n"
            "@dataclass\nclass Args:\n    model: str\n    seed: int = 0\n"),
        "pkg/v2/runner.py": (
            "from ..runner import Runner as Base\n"
            "class Runner2(Base):\n"
            "    def reload(self, *args, **kwargs):\n"
            "        from pkg.runner import Runner as V1\n"
            "        V1.reload(self, *args, **kwargs)\n"),
    })
    prompt = tree.class_info("pkg.inputs", "Prompt")
    assert prompt.module == "pkg.inputs.data" and constructor_parameters(prompt).names == ("ids", "salt")
    assert literal_values(tree, "pkg.config", "Mode") == ("raw", "processed")
    runner2 = tree.class_info("pkg.v2.runner", "Runner2")
    assert "requests" in runner2.attributes  # assigned to self in the base's __init__
    own = parameters(runner2.methods["reload"])
    assert own.names == () and own.any_keyword
    forwarded = forwarded_parameters(tree, runner2.method_modules["reload"], runner2.methods["reload"])
    assert forwarded.names == ("weights", "fmt")
    assert constructor_parameters(tree.class_info("pkg.runner", "Args")).names == ("model", "seed")
    assert tree.class_info("pkg.runner", "Missing") is None and not tree.has_module("pkg.absent")
