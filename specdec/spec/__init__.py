"""Speculation: what is drafted (`draft`: chains or token trees; `proposers/`: a draft model, prompt lookup) and how
it is accepted (`verify`: lossless, fuzzy, conditional and coupled rules; `sampling`; `trees`; `grammar`: output
formats' masks). Tensors in, tensors out: a proposer sees a batch only as its `Slots`."""
