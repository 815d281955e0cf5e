"""House rules checked on the tree: lint, domain language, function length, layering, references, supply
chain."""
