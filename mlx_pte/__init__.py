"""mlx-pte: export Hugging Face causal LMs to ExecuTorch .pte files and run them on MLX."""
from importlib import import_module
from typing import Any, Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` resolving ``name`` from submodule ``exports[name]`` on first
    use, so importing a light submodule of ``package`` does not load the heavy ones."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(exports[name], package), name)

    return __getattr__
