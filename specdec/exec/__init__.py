"""Model execution: one forward over cache rows (tokens + positions + cache rows -> logits), and what it needs: the
models (`models`, `shard`, `tp`), their KV caches (`cache`, `prefix`), prefills planned on the host (`prefill`), the
inputs of a round's forward (`inputs`), the lean Llama forward and its CUDA graphs (`llama`, `graphs`, `runner`),
and the memory they take (`memory`). Nothing here knows drafts, rows' records or policies."""
