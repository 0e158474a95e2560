"""specbatch from Python: `Generator` (text in, rows out, in this process) and, with the `data` extra, the Ray
Data stage `specbatch.ray_data.SpecbatchStage`."""

from .generator import Generator, GeneratorSpec

__all__ = ["Generator", "GeneratorSpec"]
