"""One timed generate of the real pair at the job defaults (dense cache) with the specdec of the tree given."""
import json, os, sys, time
tree = sys.argv[1]
sys.path.insert(0, tree); sys.path.insert(0, os.path.join(tree, "bench"))
import torch
from engine_speed import load_bench_pair, add_model_args, timed_generate
from prompts import HELD_OUT, chat_ids
from specdec.config import SamplingParams, SpecConfig
from specdec.engine import SpecEngine
import argparse
ap = argparse.ArgumentParser(); add_model_args(ap); args = ap.parse_args(["--dtype", "float32"])
pair = load_bench_pair(args)
import specdec; assert specdec.__file__.startswith(tree), specdec.__file__
prompts = chat_ids(pair.tokenizer, HELD_OUT)
out = {}
for method in sys.argv[2].split(","):
    for bs in (1, 8, 32):
        ps = (prompts * 8)[:max(bs, 8)]
        eng = SpecEngine(pair, SamplingParams(max_new_tokens=64), SpecConfig(method=method), batch_size=bs)
        eng.measure_costs(); eng.generate(ps[:bs])
        r = timed_generate(eng, ps)
        out[f"{method} {bs}"] = r["tok_s"]
print(json.dumps(out))
