"""The engine: token ids in, `SampleResult`s out (`engine.SpecEngine`), in four rooms whose imports run one way
(exec <- spec, plan <- sched; tests/test_layers.py checks it):

- `exec/`: one forward: tokens, positions and cache rows in, logits out (models, caches, prefills, prefixes, CUDA
  graphs, the memory plan, tensor-parallel ranks); it knows no drafts, rows or policies;
- `spec/`: what is drafted and how it is accepted (the draft, proposers, verification rules, sampling, token trees,
  output formats): tensors in, tensors out;
- `plan/`: how long to draft and what a round costs (length policies, the cost model and its profiler, SpecDec++'s
  head, FSD's calibration);
- `sched/`: the rows' host state and the round loop (slots, the batch, rounds, stop strings).

On top: `config` (settings and results), `choices` (the method and policy tables) and `engine`.
"""
