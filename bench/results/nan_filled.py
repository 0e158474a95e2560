"""Run a bench script with every tensor torch allocates uninitialized (`torch.empty` and kin) filled with NaN (floats)
or the largest value (integers), as torch's deterministic mode does: a read of memory nothing wrote then changes
tokens or fails, as a GPU's reused memory (leftovers of earlier allocations) could make it do, where a CPU's fresh
pages hold zeros.

    python bench/results/nan_filled.py SCRIPT [ARGS...]
"""

import runpy
import sys

import torch

torch.use_deterministic_algorithms(True, warn_only=True)
torch.utils.deterministic.fill_uninitialized_memory = True
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
