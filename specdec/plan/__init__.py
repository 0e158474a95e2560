"""Planning: how long each round drafts (`policies/`: fixed, heuristic, confidence, SpecDec++'s acceptance head,
goodput) and what a round costs (`costmodel`, measured by `profiler`); `head` trains SpecDec++'s head and
`calibrate` FSD's threshold. A policy sees a batch as a `BatchView` and keeps per-row state in its `Slots`."""
